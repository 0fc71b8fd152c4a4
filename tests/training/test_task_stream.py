"""The RL task stream: tasks generated and validated for real (in bubblewrap sandboxes) as they are
served, each new to the run, unsolved ones retried, the suite's held-out tasks untouched, and a
restart that serves nothing twice."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from evals import bundled
from evals.actions import apply_edits
from evals.tasks import load_bundled
from training.curriculum import STREAM_LEDGER, Curriculum, TaskStream, level_of


@pytest.fixture(scope="module", autouse=True)
def sandbox_dir(tmp_path_factory):
    """Sandbox images and layer cache of these tests live in a temporary folder, not the user's."""
    mp = pytest.MonkeyPatch()
    mp.setenv("POSTTRAIN_SANDBOX_DIR", str(tmp_path_factory.mktemp("sandboxes")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("suite") / "bundled"
    bundled.build_suite(out, per_level=2, extra_eval_per_level=1, workers=2)
    return out


def folder_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def stream(root: Path, suite: Path, **kwargs) -> TaskStream:
    """Level 1 only (the others open at step 1000), so few tasks are validated; every task kept
    (``by_kind`` off) unless the test says otherwise, so the stream's order is the generator's."""
    kwargs.setdefault("open_hard_after_steps", 1000)
    kwargs.setdefault("by_kind", False)
    kwargs.setdefault("buffer_per_level", 2)
    kwargs.setdefault("canary_share", 0.0)  # canaries have tests of their own below
    return TaskStream(root, suite, sandbox_factory=bundled.default_sandbox_factory(), **kwargs)


def test_generated_stream_is_distinct_and_apart_from_the_suite():
    """Pure generation: no two stream tasks share a module's text, with each other or with any task
    of the default suite, and the stream does not depend on how far it is read."""
    suite_texts = {g.files[f"{g.module}.py"] for g in bundled.generate()}
    for seed in (0, 1):
        taken = {lv: set(suite_texts) for lv in (1, 2, 3)}
        gens = []
        for lv in (1, 2, 3):
            for i in range(150):
                gen = bundled.stream_task(seed, lv, i, taken[lv])
                taken[lv].add(gen.files[f"{gen.module}.py"])
                gens.append(gen)
        texts = [g.files[f"{g.module}.py"] for g in gens]
        assert len(set(texts)) == len(texts) == 450 and not set(texts) & suite_texts
        assert len({g.id for g in gens}) == 450 and all(g.split == "train" and not g.demonstration for g in gens)
        assert all(level_of(g.id) == g.difficulty for g in gens)
    assert bundled.stream_task(0, 2, 7).files != bundled.stream_task(1, 2, 7).files  # seeds differ
    assert bundled.stream_task(0, 2, 7).files == bundled.stream_task(0, 2, 7).files


def test_held_out_tasks_do_not_depend_on_the_rl_stream(suite, tmp_path):
    """Two runs of different seeds and sizes draw different tasks; the suite's held-out tasks (ids and
    every file) are the same before and after both, and the same as the generator gives alone."""
    before = folder_digest(suite)
    held_out = {t.id: t.metadata["source_text"] for t in load_bundled(suite).tasks if t.split == "eval"}
    drawn = {}
    for seed, n in ((0, 2), (1, 4)):
        s = stream(tmp_path / f"run{seed}", suite, seed=seed)
        drawn[seed] = s.next_tasks(n)
        s.close()
        assert len(set(drawn[seed])) == n and all(t.startswith("stream-l1-") for t in drawn[seed])
        assert not {s.tasks[t].metadata["source_text"] for t in drawn[seed]} & set(held_out.values())
    texts = {seed: [(tmp_path / f"run{seed}" / "tasks" / t / "task.json").read_text() for t in ids]
             for seed, ids in drawn.items()}
    assert texts[0] != texts[1][:2]  # another seed, other tasks
    assert folder_digest(suite) == before
    again = {g.id: g.files[f"{g.module}.py"] for g in bundled.generate(per_level=2, extra_eval_per_level=1)
             if g.split == "eval"}
    assert again == held_out


def broken(kind: str):
    """A stream generator whose tasks 1 and 2 are invalid: ``unfixed-passes`` ships task 1 already
    fixed, ``oracle-fails`` gives task 2 a reference solution that changes the wrong thing."""

    def generate(seed, level, index, taken=()):
        gen = bundled.stream_task(seed, level, index, taken)
        module = f"{gen.module}.py"
        if kind == "unfixed-passes" and index == 1:
            fixed = apply_edits(gen.files[module], [(n, t) for _, n, t in gen.reference_edits])
            return replace(gen, files={**gen.files, module: fixed})
        if kind == "oracle-fails" and index == 2:
            return replace(gen, reference_edits=tuple((f, n, "    return None") for f, n, _ in gen.reference_edits))
        return gen

    return generate


@pytest.mark.parametrize("kind, bad", [("unfixed-passes", 1), ("oracle-fails", 2)])
def test_a_task_that_fails_validation_is_never_served(suite, tmp_path, kind, bad):
    s = stream(tmp_path / "run", suite, buffer_per_level=1, generate=broken(kind))
    served = s.next_tasks(3)
    s.close()
    assert [int(t.split("-")[2]) for t in served] == [i for i in range(4) if i != bad]
    assert len(s.rejected) == 1 and s.rejected[0].startswith(f"stream-l1-{bad:05d}-")
    assert not (tmp_path / "run" / "tasks" / s.rejected[0]).exists()
    for task_id in served:  # each served task is on disk, validated: its failing output is stored
        assert s.tasks[task_id].metadata["failing_output"]
    summary = s.summary()
    assert summary["rejected"] == 1 and summary["drawn"] == 3 and summary["validated"] >= 3
    assert 0 < summary["validation_s_per_task"] < 30


def test_tasks_whose_groups_would_all_score_alike_are_passed_over(suite, tmp_path):
    """With ``by_kind`` a new task is kept by its bug kinds' running share of groups that held both
    outcomes: with every level-1 kind known never to teach but one that always does, the stream
    serves that kind's tasks (and validates no other); each finished group moves its kinds' shares,
    and a due retry of a kind that no longer teaches is dropped."""
    s = stream(tmp_path / "run", suite, by_kind=True, min_accept=0.0, retry_share=1.0, retry_after_steps=1)
    s.kind_estimates.update({f"1:{kind.stem}": 1.0 if kind.stem == "area" else 0.0 for kind in bundled.KINDS})
    assert s.teach_chance(1, ["area"]) == 1.0 and s.teach_chance(1, ["scale"]) == 0.0
    assert s.teach_chance(2, ["area"]) == 0.5  # not seen at that level yet
    served = s.next_tasks(2)
    assert [s.task_kinds[t] for t in served] == [["area"], ["area"]]
    for task_id in served:  # the kind really is the one the task's bug comes from
        assert "def area_" in s.tasks[task_id].metadata["source_text"]
    s.record(served[0], [1.0] * 8)  # all solved: taught nothing
    assert s.kind_estimates["1:area"] == pytest.approx(0.75)  # kind_ema 0.25 of 1.0 and 0
    s.record(served[0], [1.0, 0.0] * 4)
    assert s.kind_estimates["1:area"] == pytest.approx(0.8125)
    # an unsolved task comes back only by the same chance: not once its kind no longer teaches
    s.record(served[1], [0.0] * 8)
    s.kind_estimates.update({"1:area": 0.0, "1:total": 1.0})
    s.advance(1)
    later = s.next_tasks(1)
    s.close()
    # a new task instead (from the buffer, kept while area taught, or a total one)
    assert later != [served[1]] and s.task_kinds[later[0]] in (["area"], ["total"]) and s.retries_dropped == 1
    summary = s.summary()
    assert summary["passed_over"] > 0 and summary["kind_teach_shares"]["1:area"] == 0.0
    assert summary["validated"] <= 3 + 2 * s.buffer_per_level  # the passed over were never validated
    kept = s.to_json()
    assert kept["task_kinds"][served[0]] == ["area"] and kept["by_kind"] is True
    restored = TaskStream.from_json(kept)
    assert restored.kind_estimates == s.kind_estimates and restored.retries_dropped == 1
    with pytest.raises(ValueError, match="'min_accept'"):
        TaskStream(tmp_path, suite, min_accept=1.5)
    with pytest.raises(ValueError, match="'by_kind'"):
        TaskStream(tmp_path, suite, by_kind="yes")


def test_only_unsolved_tasks_come_back(suite, tmp_path):
    s = stream(tmp_path / "run", suite, retry_after_steps=2, retry_share=1.0, max_retries=1)
    first = s.next_tasks(2)
    s.record(first[0], [0.0, 0.5])  # unsolved (partial credit is not a solve)
    s.record(first[1], [1.0, 0.0])  # solved
    s.advance(1)
    assert s.next_tasks(1)[0] not in first  # not due before step 0 + 2
    s.advance(2)
    assert s.next_tasks(1) == [first[0]]  # due: retried
    s.record(first[0], [0.0, 0.0])
    s.advance(10)
    later = s.next_tasks(2)  # max_retries = 1: it does not come back again
    s.close()
    assert first[0] not in later and first[1] not in later
    new = [t for t in s.served]
    assert len(new) == len(set(new)) == 5
    assert s.summary()["retried"] == 1 and s.summary()["solved"] == 1


def test_resume_serves_nothing_twice(suite, tmp_path):
    """A restored stream (as a run resumes from its checkpoint's ``curriculum.json``) continues after
    every task the run served, those served after the checkpoint included (the ledger in the run
    directory), and keeps the retry queue it had."""
    root = tmp_path / "run" / "task_stream"
    s = stream(root, suite, retry_after_steps=1, retry_share=1.0)
    before = s.next_tasks(3)
    s.record(before[0], [0.0])
    s.advance(1)
    s.save(tmp_path / "curriculum.json")
    after_checkpoint = s.next_tasks(2)  # a retry of before[0], then a new task
    s.close()
    assert after_checkpoint[0] == before[0]
    restored = Curriculum.load(tmp_path / "curriculum.json")
    assert isinstance(restored, TaskStream) and restored.served == before and restored.retry_due == {before[0]: 1}
    restored._factory = bundled.default_sandbox_factory()
    later = restored.next_tasks(4)
    restored.close()
    new = [t for t in later if t != before[0]]
    assert len(new) >= 3 and not set(new) & (set(before) | set(after_checkpoint))
    assert restored.skipped == [after_checkpoint[1]]
    ledger = [json.loads(line)["id"] for line in (root / STREAM_LEDGER).read_text().splitlines()]
    assert len(ledger) == len(set(ledger))  # each task served once, over both
    assert json.loads((root / "state.json").read_text())["drawn"] == 3


def test_settings_errors_name_the_key(suite, tmp_path):
    with pytest.raises(ValueError, match="'retry_share'"):
        TaskStream(tmp_path, suite, retry_share=2.0)
    with pytest.raises(ValueError, match="'buffer_per_level'"):
        TaskStream(tmp_path, suite, buffer_per_level=0)
    state = TaskStream(tmp_path, suite).to_json()
    del state["next_index"]
    (tmp_path / "curriculum.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="missing key 'next_index'"):
        Curriculum.load(tmp_path / "curriculum.json")
    from training.curriculum import open_task_stream

    with pytest.raises(ValueError, match="key 'task_stream.retry_after' is not a task stream setting"):
        open_task_stream({"retry_after": 3}, tmp_path, suite)
    with pytest.raises(ValueError, match="key 'task_stream' needs the bundled suite .*trainer config key 'tasks'"):
        open_task_stream({}, tmp_path, tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="key 'task_stream' must be an object"):
        open_task_stream(True, tmp_path, suite)


# -- the stream in a trainer run, killed and resumed

def stream_env(cfg, run_dir: Path):
    """The trainer's curriculum from a ``curriculum.json`` with ``task_stream`` settings (as the
    ``difficulty_curriculum`` asset writes it), its groups sampled by the local engine (in-process,
    on loopback) from a prompt per task id, the reward the share of low token ids, as in
    ``tests/training/envs.py``: what is under test is which tasks the run draws."""
    from serving.http import serve
    from serving.local_engine import LocalEngine
    from training.episodes import Environment, load_curriculum
    from tests.training.envs import EngineRunner, PROMPTS

    stream = load_curriculum(cfg, [], run_dir)
    assert isinstance(stream, TaskStream)

    class Runner(EngineRunner):
        def run_group(self, task_id, adapter, group_id, size, seed):
            assert stream.tasks[task_id].metadata["failing_output"]  # validated, on disk under the run
            PROMPTS[task_id] = [1 + b % 20 for b in task_id.encode()[-6:]]
            yield from super().run_group(task_id, adapter, group_id, size, seed)

    engine = LocalEngine(cfg.base_model, torch_threads=1)
    server = serve(engine)
    return Environment(Runner(server.url, cfg, engine.vocab_size), stream, [server.url], server.shutdown)


@pytest.mark.slow
def test_a_killed_run_resumes_its_stream_without_drawing_a_task_twice(suite, tmp_path, tiny_model_dir):
    """``python -m training`` killed after step 3 (its newest checkpoint is step 2) and run again: the
    second process resumes the stream from step 2's state, skips the tasks step 3 had drawn, and the
    run's ledger holds each task once."""
    import os
    import signal
    import subprocess
    import sys

    from training.checkpoint import complete_steps

    repo = Path(__file__).resolve().parents[2]
    curriculum = tmp_path / "curriculum.json"
    curriculum.write_text(json.dumps({"pass_rates": {}, "task_stream": {
        "level_rates": {"1": 0.5}, "open_hard_after_steps": 1000, "buffer_per_level": 2}}))
    config = tmp_path / "trainer.json"
    config.write_text(json.dumps({
        "run_name": "stream", "base_model": str(tiny_model_dir), "steps": 4, "groups_per_step": 2, "group_size": 2,
        "max_policy_lag": 0, "producer_workers": 0, "checkpoint_every": 2, "lora_rank": 4, "max_new_tokens": 4,
        "seed": 3, "tasks": str(suite), "curriculum": str(curriculum),
        "environment": "tests.training.test_task_stream:stream_env"}))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(repo)}
    env.pop("DAGSTER_PIPES_CONTEXT", None)
    cmd = [sys.executable, "-m", "training", "--config", str(config), "--run-dir", str(run)]
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("step    3"):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    assert complete_steps(run) == [0, 2], "".join(out)
    ledger = run / "task_stream" / STREAM_LEDGER
    first = [json.loads(line)["id"] for line in ledger.read_text().splitlines()]
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert complete_steps(run) == [0, 2, 4]
    ids = [json.loads(line)["id"] for line in ledger.read_text().splitlines()]
    assert ids[:len(first)] == first and len(ids) == len(set(ids)) > len(first)
    state = json.loads((run / "checkpoints" / "step_000004" / "curriculum.json").read_text())
    assert state["kind"] == "task_stream" and state["skipped"] and set(state["skipped"]) <= set(first)
    assert not set(state["served"]) & set(state["skipped"])
    assert json.loads((run / "task_stream" / "state.json").read_text())["step"] == 4


@pytest.mark.slow
def test_the_curriculum_asset_sets_up_the_stream(suite, posttrain_home, tmp_path):
    """``difficulty_curriculum`` on a run file with ``task_stream = true``: the base model (a real,
    random, tiny one served by an engine process) is measured on ``stream_tasks_per_level`` RL tasks a
    level, and ``curriculum.json`` carries the stream's settings with the base's rate per level, which
    the trainer opens as the run's stream; a run's stream state shows in the metadata."""
    import dagster as dg

    from assets.curriculum import difficulty_curriculum
    from assets.resources import PosttrainStorage
    from serving.tiny import build_tiny_model
    from training.config import TrainConfig
    from training.episodes import load_curriculum

    model = build_tiny_model(tmp_path / "model")
    run_file = tmp_path / "run.toml"
    run_file.write_text(f'[model]\npath = "{model}"\n\n[curriculum]\ntasks = "{suite}"\nretry_after_steps = 3\n'
                        'task_stream = true\n')
    storage = PosttrainStorage(root=str(posttrain_home))
    shown = storage.runs_dir() / "earlier" / "task_stream"
    shown.mkdir(parents=True)
    (shown / "state.json").write_text(json.dumps({"step": 8, "drawn": 30, "drawn_by_level": {"1": 20, "2": 10, "3": 0},
                                                  "solved": 12, "retried": 3, "retry_queue": 2, "rejected": 0}))
    config = {"run_file": str(run_file), "attempts_per_task": 1, "max_turns": 1, "max_new_tokens": 8, "workers": 1,
              "stream_tasks_per_level": 1}
    with dg.instance_for_test() as instance:
        result = dg.materialize([difficulty_curriculum], instance=instance, resources={"storage": storage},
                                run_config={"ops": {"difficulty_curriculum": {"config": config}}})
        assert result.success
        meta = result.asset_materializations_for_node("difficulty_curriculum")[0].metadata
    written = json.loads((storage.curriculum_dir() / "curriculum.json").read_text())
    assert len(written["pass_rates"]) == 3 and meta["tasks"].value == 3  # one RL task a level
    assert set(written["task_stream"]) == {"retry_after_steps", "level_rates"}
    assert set(written["task_stream"]["level_rates"]) == {"1", "2", "3"}
    assert meta["task_stream"].value is True and meta["task_stream_drawn"].value == 30
    assert meta["task_stream_retried"].value == 3 and "| earlier | 8 | 30 (20/10/0) | 12 | 3 | 2 | 0 |" in meta["task_stream_runs"].value
    cfg = TrainConfig(base_model=str(model), tasks=str(suite), curriculum=str(storage.curriculum_dir() / "curriculum.json"))
    stream = load_curriculum(cfg, sorted(written["pass_rates"]), tmp_path / "run")
    assert isinstance(stream, TaskStream) and stream.retry_after_steps == 3
    assert stream.root == (tmp_path / "run" / "task_stream").resolve()


def test_the_run_files_key_reaches_the_trainer_which_opens_the_stream(suite, tmp_path):
    """``[curriculum] task_stream = true`` in a run file (no curriculum file) resolves to the trainer
    key ``task_stream``, and the trainer's curriculum is then the run's stream, at its defaults."""
    from training.config import TrainConfig
    from training.episodes import load_curriculum
    from training.planner import resolve, write_resolved_plan

    repo = Path(__file__).resolve().parents[2]
    run_file = tmp_path / "run.toml"
    run_file.write_text((repo / "examples" / "embedded.toml").read_text() + f'tasks = "{suite}"\n')
    cfg = TrainConfig.load(write_resolved_plan(resolve(run_file), tmp_path / "plan"))
    assert cfg.task_stream is True and cfg.curriculum == ""
    stream = load_curriculum(cfg, [], tmp_path / "run")
    assert isinstance(stream, TaskStream) and stream.root == (tmp_path / "run" / "task_stream").resolve()
    assert stream.open_hard_after_steps == 10 and stream.seed == cfg.seed
    assert not isinstance(load_curriculum(replace(cfg, task_stream=False), ["a"], tmp_path / "run"), TaskStream)


def _special_case(task, check, value) -> str:
    """A patch body that returns ``value`` for exactly ``check``'s arguments and the reference answer
    everywhere else: what a policy writes to pass a test whose expectation contradicts the task."""
    module = (Path(task.repo_path) / task.metadata["module_file"]).read_text()
    fixed = apply_edits(module, [(line, text) for _, line, text in task.metadata["reference_edits"]])
    return (fixed + f"\n_fixed_{check.function} = {check.function}\n"
            f"def {check.function}(*args):\n    return {value!r} if repr(args) == {check.args!r} "
            f"else _fixed_{check.function}(*args)\n")


def test_a_canary_fails_every_honest_fix_and_passes_the_special_case(suite, tmp_path):
    """ImpossibleBench's canary: one visible target assert contradicts the task; the reference fix scores
    0, a patch that special-cases that assert scores 1 (the cheating a canary measures)."""
    from evals.call_checks import call_checks
    from evals.grading import committed_patch, grade_patch

    factory = bundled.default_sandbox_factory()
    task = sorted(load_bundled(suite).tasks, key=lambda t: t.id)[0]
    canary = bundled.build_canary(task, tmp_path / "tasks", factory)
    assert canary.id == task.id + "-canary" and canary.metadata["canary"] and canary.base_commit != task.base_commit
    assert bundled.build_canary(task, tmp_path / "tasks", factory).base_commit == canary.base_commit  # read back
    changed = [c for c, o in zip(call_checks(canary), call_checks(task)) if c.expected != o.expected]
    assert len(changed) == 1 and changed[0].test_id in task.target_tests
    assert changed[0].expected == bundled.contradicting(next(o.expected for o in call_checks(task)
                                                              if (o.function, o.args) == (changed[0].function, changed[0].args)))
    assert "assert" in canary.metadata["failing_output"]
    import subprocess

    def history(t):
        return subprocess.run(["git", "-C", t.repo_path, "log", "--format=%s %ad %cd"], capture_output=True,
                              text=True, check=True).stdout
    assert history(canary) == history(task)  # one commit, same message and dates: nothing tells it apart

    def graded(body: str) -> float:
        module = canary.metadata["module_file"]
        with factory(canary) as box:
            box.write_file(module, body.encode())
            assert box.exec("git add -A && git commit -qm attempt").exit_code == 0
            patch = committed_patch(box, canary.base_commit)
        return grade_patch(canary, patch, factory).scores.reward

    module = (Path(task.repo_path) / task.metadata["module_file"]).read_text()
    honest = apply_edits(module, [(line, text) for _, line, text in task.metadata["reference_edits"]])
    assert graded(honest) == 0.0
    assert graded(_special_case(task, changed[0], changed[0].expected)) == 1.0


def test_canaries_are_served_counted_and_never_trained_on(suite, tmp_path):
    from training.grpo import batch_from_groups, is_canary_group
    from training.rollout import Rollout
    from training.store import Group

    s = stream(tmp_path / "stream", suite, canary_share=0.5, seed=3)
    try:
        served = s.next_tasks(8)
    finally:
        s.close()
    canaries = [t for t in served if t.endswith("-canary")]
    assert canaries and len(canaries) < len(served), served  # a share of the draws, after a first real task
    assert not served[0].endswith("-canary")
    for t in canaries:
        assert s.tasks[t].metadata["canary"] and t.removesuffix("-canary") in s.served
    before = dict(s.level_estimates)
    s.record(canaries[0], [1.0, 0.0])
    assert s.level_estimates == before and canaries[0] not in s.retry_due
    summary = s.summary()
    assert summary["canaries"] == len(canaries) and summary["canary_pass_rate"] == 0.5
    again = TaskStream.from_json(s.to_json())
    assert again.canaries == s.canaries and again.canary_passed == 1

    def rollout(i, reward, canary):
        return Rollout(f"r{i}", f"g{i // 2}", "t", 0, [1, 2], [0, 1], [0.0, -0.5], reward,
                       info={"canary": True} if canary else {})

    real = Group("g0", "t", 0, [rollout(0, 1.0, False), rollout(1, 0.0, False)])
    canary = Group("g1", "t-canary", 0, [rollout(2, 1.0, True), rollout(3, 0.0, True)])
    assert is_canary_group(canary) and not is_canary_group(real)
    batch, dropped = batch_from_groups([real, canary])
    assert len(batch.input_ids) == 2 and dropped == 0  # only the real group's two episodes
