"""Episodes end to end: a real tiny engine (serving's LocalEngine on a random tiny model), and a
scripted policy that answers with the reference solution (it stands in for a trained model, which
this test cannot train; everything else in the episode is real)."""

import json

import pytest

from evals.actions import JSON_TOOLS, demonstration, parse_json_tools, reference_actions
from evals.bundled import default_sandbox_factory
from evals.evaluate import evaluate, write_rows
from evals.harness import InProcessClient, closest_line, run_episode


class ScriptedPolicy:
    """Answers every call with fixed text, in SGLang's response shape (logprobs 0.0: it is certain)."""

    def __init__(self, tokenizer, answers):
        self.tokenizer, self.answers, self.bodies = tokenizer, list(answers), []

    def generate(self, input_ids, sampling_params=None, *, return_logprob=False, lora_path=None, rid=None):
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob,
                "lora_path": lora_path, "rid": rid}
        self.bodies.append(body)
        text = self.answers[min(len(self.bodies) - 1, len(self.answers) - 1)]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"text": text, "output_ids": ids,
                "meta_info": {"weight_version": body.get("lora_path") or "base",
                              "output_token_logprobs": [[0.0, t, None] for t in ids]}}


def test_reference_answer_earns_reward_one(small_tasks, tokenizer):
    task = small_tasks[-1]  # level 3: two edits
    _, action_text = demonstration(task)
    policy = ScriptedPolicy(tokenizer, [action_text])
    traj = run_episode(task, policy, tokenizer, default_sandbox_factory(), adapter_version="step_000004",
                       session_id="s-1", max_turns=3)
    assert traj.stop_reason == "commit" and traj.committed
    assert traj.reward == 1.0 and traj.grade.scores.f2p_passed == len(task.target_tests)
    assert [s.action["tool"] for s in traj.steps] == ["str_replace", "str_replace", "commit"]
    body = policy.bodies[0]
    assert body["lora_path"] == "step_000004" and body["rid"] == "s-1" and body["return_logprob"] is True
    assert traj.calls[0].input_ids == body["input_ids"]
    assert f"+{task.metadata['reference_edits'][0][2]}" in traj.patch
    json.loads(traj.to_json())


def test_uncommitted_fix_earns_nothing_and_turns_chain_tokens(small_tasks, tokenizer):
    task = small_tasks[0]
    _, action_text = demonstration(task)
    edits_only = action_text.replace("commit\n", "")
    policy = ScriptedPolicy(tokenizer, [edits_only, "test\n"])
    traj = run_episode(task, policy, tokenizer, default_sandbox_factory(), max_turns=2)
    assert traj.stop_reason == "max_turns" and not traj.committed
    assert traj.reward == 0.0 and traj.patch == ""
    assert traj.steps[-1].observation == "all tests pass"  # the fix worked, but was never committed
    first, second = traj.calls
    assert second.input_ids[: len(first.input_ids) + len(first.output_ids)] == first.input_ids + first.output_ids


def test_bad_actions_become_observations(small_tasks, tokenizer):
    task = small_tasks[0]
    module = task.metadata["module_file"]
    policy = ScriptedPolicy(tokenizer, [f"replace {module}:999 x\nhello\n", "commit\n"])
    traj = run_episode(task, policy, tokenizer, default_sandbox_factory(), max_turns=3)
    observations = [s.observation for s in traj.steps]
    assert observations[0].startswith("error: line 999 is outside the file")
    assert "is not an action" in observations[1]
    assert traj.stop_reason == "commit" and traj.reward == 0.0


def test_json_tool_calls():
    text = ('I will fix it. <tool_call>{"tool": "replace_line", "args": {"path": "a.py", "line": 2, "text": "  y"}}'
            '</tool_call> then {"name": "commit", "arguments": "{\\"message\\": \\"fix\\"}"}')
    actions = parse_json_tools(text)
    assert [(a.tool, a.args) for a in actions] == [("replace_line", {"path": "a.py", "line": 2, "text": "  y"}),
                                                  ("commit", {"message": "fix"})]


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from serving.local_engine import LocalEngine
    from serving.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    engine = LocalEngine(path, torch_threads=1)
    yield engine
    engine.close()


def test_real_tiny_engine_episode_and_evaluate(small_tasks, tiny_engine, tmp_path):
    tokenizer = tiny_engine.tokenizer
    client = InProcessClient(tiny_engine)
    task = small_tasks[0]
    traj = run_episode(task, client, tokenizer, default_sandbox_factory(), max_turns=2, max_new_tokens=16,
                       seed=1, action_format=JSON_TOOLS)
    assert 1 <= len(traj.calls) <= 2
    for call in traj.calls:
        assert len(call.output_logprobs) == len(call.output_ids) > 0
        assert all(lp <= 0.0 for lp in call.output_logprobs)
    assert traj.grade is not None and traj.reward in (0.0, 1.0)

    rows = evaluate(small_tasks[:2], client, tokenizer, default_sandbox_factory(), checkpoint="t-step_000000",
                    attempts=2, max_turns=1, max_new_tokens=8, workers=1)
    assert [(r["task_id"], r["attempt"]) for r in rows] == [(t.id, a) for t in small_tasks[:2] for a in range(2)]
    assert all(r["status"] in ("graded", "apply_failed") and r["reward"] in (0.0, 1.0) for r in rows)
    import pandas as pd

    frame = pd.read_parquet(write_rows(rows, tmp_path / "rows.parquet"))
    assert len(frame) == 4 and frame["f2p_total"].tolist() == [len(small_tasks[0].target_tests)] * 2 + [len(small_tasks[1].target_tests)] * 2


def test_end_of_sequence_token_is_not_part_of_the_action(small_tasks, tokenizer):
    task = small_tasks[0]
    _, action_text = demonstration(task)

    class EndsWithEos(ScriptedPolicy):
        def generate(self, *args, **kwargs):
            out = super().generate(*args, **kwargs)
            out["output_ids"] = out["output_ids"] + [tokenizer.eos_token_id]
            out["meta_info"]["output_token_logprobs"].append([-0.1, tokenizer.eos_token_id, None])
            return out

    traj = run_episode(task, EndsWithEos(tokenizer, [action_text]), tokenizer, default_sandbox_factory(), max_turns=1)
    assert traj.calls[0].output_ids[-1] == tokenizer.eos_token_id
    assert traj.stop_reason == "commit" and traj.reward == 1.0


def test_an_agent_that_never_acts_opens_no_sandbox(small_tasks, tokenizer):
    opened = []

    def counting_factory(task):
        opened.append(task.id)
        return default_sandbox_factory()(task)

    traj = run_episode(small_tasks[0], ScriptedPolicy(tokenizer, ["no idea"]), tokenizer, counting_factory, max_turns=2)
    assert traj.stop_reason == "max_turns" and traj.patch == ""
    # no agent sandbox: only the one answering the hidden inputs (once per task and factory) and the grader's
    assert opened == [small_tasks[0].id] * 2
    assert traj.reward == 0.0 and traj.grade.scores.p2p == 1.0


def test_a_tested_work_tree_seen_before_takes_the_cached_test_observation(small_tasks, tokenizer):
    """Two episodes that make the same edit and run ``test``: with a shared ``grade_cache`` the
    second takes the first's real observation without running the tests; an episode that ran
    ``bash`` (the tree is no longer known from its edits) runs them again."""
    from evals.actions import reference_actions

    task = small_tasks[0]
    fix = "\n".join(a.to_compact() for a in reference_actions(task)[:-1])
    test_runs = []

    def counting_factory(t):
        from contextlib import contextmanager

        @contextmanager
        def opened():
            with default_sandbox_factory()(t) as box:
                real_exec = box.exec

                def exec_(command, **kw):
                    if command == t.test_command:
                        test_runs.append(command)
                    return real_exec(command, **kw)

                box.exec = exec_
                yield box
        return opened()

    cache: dict = {}
    answers = [f"{fix}\ntest", "commit"]
    first = run_episode(task, ScriptedPolicy(tokenizer, answers), tokenizer, counting_factory, max_turns=3, grade_cache=cache)
    ran = len(test_runs)
    second = run_episode(task, ScriptedPolicy(tokenizer, answers), tokenizer, counting_factory, max_turns=3, grade_cache=cache)
    assert [s.observation for s in first.steps] == [s.observation for s in second.steps]
    assert first.steps[-2].observation == "all tests pass" and first.reward == second.reward == 1.0
    assert len(test_runs) == ran  # neither the test action nor the grading ran again

    edits = [a.args for a in reference_actions(task, by_line=True)[:-1]]
    calls = ([json.dumps({"tool": "bash", "args": {"command": "true"}})]
             + [json.dumps({"tool": "replace_line", "args": e}) for e in edits] + [json.dumps({"tool": "test", "args": {}})])
    third = run_episode(task, ScriptedPolicy(tokenizer, [" ".join(calls)]), tokenizer, counting_factory,
                        action_format=JSON_TOOLS, max_turns=1, grade_cache=cache, grade=False)
    assert third.steps[-1].observation == "all tests pass" and len(test_runs) == ran + 1


def test_a_test_run_that_cannot_collect_shows_its_error_lines_not_pages_of_output(small_tasks, tokenizer):
    """An edit that breaks the module's syntax: the ``test`` observation is pytest's ``E`` lines
    (the file, the line, the error), short enough for a small model's context."""
    task = small_tasks[0]
    module = task.metadata["module_file"]
    answer = f"replace {module}:1         return 1\ntest"
    traj = run_episode(task, ScriptedPolicy(tokenizer, [answer]), tokenizer, default_sandbox_factory(), max_turns=1, grade=False)
    observation = traj.steps[-1].observation
    assert "IndentationError" in observation and len(observation.splitlines()) <= 6
    assert "short test summary" not in observation and "====" not in observation


def test_reset_undoes_every_edit_so_a_retry_starts_from_the_base_commit(small_tasks, tokenizer):
    """A broken first attempt, ``test``, then ``reset`` and the fix: the retry is graded on the fix
    alone (the broken line is gone from the committed patch)."""
    from evals.actions import reference_actions

    task = small_tasks[0]
    module = task.metadata["module_file"]
    fix = "\n".join(a.to_compact() for a in reference_actions(task)[:-1])
    answers = [f"replace {module}:1 BROKEN = (\ntest", f"reset\n{fix}\ntest", "commit"]
    traj = run_episode(task, ScriptedPolicy(tokenizer, answers), tokenizer, default_sandbox_factory(), max_turns=4,
                       grade_cache={})
    tools = [(s.action["tool"], s.observation) for s in traj.steps]
    assert tools[0] == ("replace_line", "ok") and "SyntaxError" in tools[1][1]
    assert tools[2] == ("reset", "ok") and tools[-2] == ("test", "all tests pass") and tools[-1][0] == "commit"
    assert traj.reward == 1.0 and "BROKEN" not in traj.patch


def test_an_edit_that_miscopies_a_line_is_told_the_closest_line(small_tasks, tokenizer):
    """An ``edit`` whose old text is a line of the module with one constant or operator changed (the
    common miss of a small model) is told the line it most likely meant, quoted so it can be copied;
    text like no line of the module gets no suggestion."""
    task = small_tasks[0]
    module = task.metadata["module_file"]
    fix = reference_actions(task)[0]
    line = fix.args["old"]
    miscopied = line[:-1] + ("7" if line[-1] != "7" else "8")
    traj = run_episode(task, ScriptedPolicy(tokenizer, [f"edit {miscopied} => {fix.args['new']}\ntest\n"]), tokenizer,
                       default_sandbox_factory(), max_turns=1)
    assert traj.steps[0].observation == f"error: {miscopied!r} occurs 0 times in {module}; closest line: {line!r}"
    assert closest_line("def f(x):\n    return x + 1\n", "completely different") is None
    assert closest_line("a = 1\n  b = 2\n", "b = 3") == "b = 2"


def test_an_edit_whose_text_is_missing_or_repeated_is_an_error_observation_and_changes_nothing(small_tasks, tokenizer):
    """``edit OLD => NEW`` changes the one occurrence of OLD in the task's file; OLD found zero or
    several times is the agent's mistake: an observation naming the count and the file, the file as
    it was. The JSON ``str_replace`` tool takes a path."""
    task = small_tasks[0]
    module = task.metadata["module_file"]
    fix = reference_actions(task)[0]
    answers = ["edit no such code => x\nedit return => x\ntest\n",
               json.dumps({"tool": "str_replace", "args": {"path": module, "old": fix.args["old"], "new": fix.args["new"]}})
               + json.dumps({"tool": "commit", "args": {}})]
    traj = run_episode(task, ScriptedPolicy(tokenizer, answers[:1]), tokenizer, default_sandbox_factory(), max_turns=1)
    missing, repeated, tested = (s.observation for s in traj.steps)
    assert missing == f"error: 'no such code' occurs 0 times in {module}; give text that occurs once"
    assert repeated.startswith("error: 'return' occurs ") and f"times in {module}" in repeated
    assert tested.startswith("assert ")  # the module is unchanged: the target test still fails
    traj = run_episode(task, ScriptedPolicy(tokenizer, answers[1:]), tokenizer, default_sandbox_factory(),
                       action_format="json", max_turns=1)
    assert [s.observation for s in traj.steps] == ["ok", "committed"] and traj.reward == 1.0
