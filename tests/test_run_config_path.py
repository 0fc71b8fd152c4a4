"""The path of a run-file key to where it acts: each section declared by the package that acts on it,
composed by the planner, and handed on by its own lists rather than copies of its keys.

``training.planner.schema`` composes the run file and declares no section of its own: ``[eval]`` is
``evals.settings.EvalSection``, ``[inference]`` ``serving.settings.InferenceSection``, ``[sandbox]``
``sandboxes.settings.SandboxSection``, the planner's own sections are ``training.planner.sections``'s,
and ``[trainer]`` is made from ``training.config``. ``[eval]`` says which of its keys pick the tasks
and which run them; the eval pod (``evals.settings.POD_KEYS``) and the evaluation (handed the
section whole) take those lists from it, so no module spells them again, and no function on the
path gives a run key a default of its own.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DENSE = {"name": "dense-7b", "weights_gib": 14.2, "full_attention_layers": 28, "kv_heads": 4, "head_dim": 128,
         "kv_dtype_bytes": 2}


def test_schema_composes_the_sections_and_declares_none_of_them() -> None:
    """Every section but ``[trainer]`` (composed here from the trainer's config and the pod's
    ``gpus``) is a class of the package that acts on it; schema.py defines no class but ``RunFile``."""
    from training.config import TrainConfig
    from training.planner.schema import SECTIONS, TRAINER_POD_KEYS, TrainerSection, trainer_keys

    where = {name: cls.__module__ for name, cls in SECTIONS.items() if name != "trainer"}
    assert where == {"eval": "evals.settings", "inference": "serving.settings", "sandbox": "sandboxes.settings",
                     **{name: "training.planner.sections" for name in ("run", "model", "async", "curriculum", "kubernetes")}}
    tree = ast.parse((ROOT / "training/planner/schema.py").read_text())
    assert [node.name for node in tree.body if isinstance(node, ast.ClassDef)] == ["RunFile"]
    composed = {f.name for f in dataclasses.fields(TrainerSection)}
    assert composed == set(trainer_keys(TrainConfig)) | set(TRAINER_POD_KEYS)


def test_the_eval_pod_and_the_evaluation_take_the_eval_keys_from_the_eval_section() -> None:
    """Which ``[eval]`` keys pick the tasks and which run them is said once, on the section's
    fields; the eval pod's module reads the section itself (no alias of the list in the planner),
    and the evaluation is handed the section whole: no run key is a parameter of ``evaluate`` or
    ``evaluate_checkpoint`` with a default of its own (``evaluate``'s ``max_new_tokens`` was 64
    while ``[eval]``'s is 48)."""
    from evals.attempts import run_attempts
    from evals.evaluate import evaluate, evaluate_checkpoint
    from evals.settings import EVAL_DEFAULTS, POD_KEYS, RUN_KEYS, TASK_KEYS, EvalSection
    from training.planner import k8s

    assert set(TASK_KEYS) == {"dataset", "split", "task_ids"}
    assert set(RUN_KEYS) == {"attempts", "max_turns", "max_new_tokens", "temperature", "seed", "workers"}
    assert POD_KEYS == TASK_KEYS + RUN_KEYS
    assert not hasattr(k8s, "EVAL_SETTINGS")
    for function in (evaluate, evaluate_checkpoint):
        parameters = inspect.signature(function).parameters
        assert not set(RUN_KEYS) & set(parameters), f"{function.__name__} declares [eval] run keys again"
        assert parameters["settings"].default is EVAL_DEFAULTS == EvalSection()
    # where attempts and workers act, they have no default of their own either
    acting = inspect.signature(run_attempts).parameters
    assert acting["attempts"].default is acting["workers"].default is inspect.Parameter.empty
    assert EvalSection(attempts=3, seed=5).run_settings() == {
        "attempts": 3, "max_turns": 4, "max_new_tokens": 48, "temperature": 1.0, "seed": 5, "workers": 2}
    # the eval pod's module takes the keys from the evals package, not from the planner's manifests
    tree = ast.parse((ROOT / "training/fleet_eval.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {m for m in imported if m and m.startswith("training.planner")}
    # no module of the planner spells a list of the eval's keys again
    for path in sorted((ROOT / "training/planner").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List)):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                assert len(names & set(POD_KEYS)) < 3, f"{path.name}:{node.lineno} lists [eval] keys"


def test_each_section_key_is_declared_once() -> None:
    """Every key of ``[eval]``, ``[inference]`` and ``[sandbox]`` is a field of one dataclass, in
    the module of the package that acts on it, and no other module of the planner, the eval path or
    the Dagster layer declares a dataclass or config class field of that name with a default (a
    field that defaults to ``None``, "not given", as ``Preset.gpus_per_engine``, gives none):
    ``DeepSWEEvalConfig`` is generated from ``EvalSection``, ``training.planner.sections`` holds
    neither the inference nor the sandbox section."""
    import dataclasses as dc

    from sandboxes.settings import SandboxSection
    from serving.settings import InferenceSection

    from evals.settings import EvalSection

    declared = {"evals/settings.py": EvalSection, "serving/settings.py": InferenceSection,
                "sandboxes/settings.py": SandboxSection}
    others = [*sorted((ROOT / "training/planner").glob("*.py")), ROOT / "training/fleet_eval.py",
              ROOT / "evals/evaluate.py", ROOT / "assets/evals.py", ROOT / "dagster_project/sensors.py",
              ROOT / "dagster_project/model_eval.py"]
    for home, cls in declared.items():
        keys = {f.name for f in dc.fields(cls)} - {"image"}  # [kubernetes] image is another key of that name
        for path in others:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    fields = {t.target.id for t in node.body if isinstance(t, ast.AnnAssign)
                              and isinstance(t.target, ast.Name) and t.value is not None and not _is_none(t.value)}
                    assert not fields & keys, f"{path.relative_to(ROOT)}: {node.name} declares {home}'s keys " \
                                              f"{sorted(fields & keys)} again"


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def test_an_eval_run_setting_goes_from_the_run_file_to_the_evaluation_as_the_section_says(tmp_path) -> None:
    """``[eval] attempts`` and the other run settings from a run file, through the plan on disk, the
    checkpoint sensor's run request and deepswe_eval's config, are the section the evaluation is
    handed: ``evaluate`` takes it whole (here on no task, so nothing is served)."""
    from assets.evals import DeepSWEEvalConfig
    from assets.resources import PosttrainStorage
    from dagster_project.sensors import eval_request
    from evals.evaluate import evaluate
    from evals.sandbox import platform_sandbox_factory
    from evals.settings import parse_eval_table
    from training.planner import resolve, write_resolved_plan

    storage = PosttrainStorage(root=str(tmp_path))
    table = {"attempts": 3, "max_turns": 2, "max_new_tokens": 16, "temperature": 0.5, "seed": 7, "workers": 1}
    plan = resolve({"model": DENSE, "inference": {"max_context_length": 4096}, "eval": table}, source="r.toml")
    write_resolved_plan(plan, storage.run_dir("r"))
    config = eval_request(storage, "r-step_000004", "r-step_000004").run_config["ops"]["deepswe_eval"]["config"]
    section = parse_eval_table(DeepSWEEvalConfig(**config).model_dump(), source="deepswe_eval config")
    assert section.run_settings() == table
    rows = evaluate([], None, None, platform_sandbox_factory("bwrap"), section, checkpoint="r-step_000004")
    assert rows == []


def test_a_command_line_eval_takes_the_run_files_eval_then_its_options(tmp_path) -> None:
    """``posttrain eval --run-file`` and ``posttrain backfill --run-file``: the whole run file is
    validated, its ``[eval]`` is the base, the options given override it, and the result is one
    ``EvalSection`` (read from ``evals.settings``, not through the planner); a bad key of another
    section of the file is refused, naming the file and the key."""
    import argparse

    import pytest

    from dagster_project.cli import eval_section
    from evals.settings import EvalSection
    from training.planner.schema import PlanError

    run_file = tmp_path / "r.toml"
    run_file.write_text('[eval]\nattempts = 3\nmax_turns = 2\ntask_ids = ["a", "b"]\n')
    args = argparse.Namespace(run_file=str(run_file), attempts=None, max_turns=5, dataset=None)
    section = eval_section(args, None, "posttrain eval")
    assert section == EvalSection(attempts=3, max_turns=5, task_ids=("a", "b"))
    run_file.write_text('[eval]\nattempts = 3\n[trainer]\nkl_coef = -1\n')
    with pytest.raises(PlanError, match=r"r.toml: \[trainer\] kl_coef"):
        eval_section(args, None, "posttrain eval")


def _calls_into(path: str, function: str) -> set[str]:
    """The names a module-level ``function`` of ``path`` calls that the module imports from another
    module of posttrain (``from X import name``, X not a library)."""
    tree = ast.parse((ROOT / path).read_text())
    imported = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module and (ROOT / node.module.split(".")[0]).is_dir() for alias in node.names}
    body = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function)
    return {node.func.id for node in ast.walk(body) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id in imported}


def _called(path: str, name: str) -> int:
    """How many calls of ``name`` (a bare name) ``path`` makes."""
    return sum(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
               for node in ast.walk(ast.parse((ROOT / path).read_text())))


def test_the_eval_key_goes_through_each_module_once_on_its_way_to_the_evaluation() -> None:
    """The checkpoint sensor makes its request from one function of ``assets.evals`` (the partition
    key in, the run config out) rather than parsing the key itself and going back to the asset's
    module; the tasks an ``[eval]`` picks are read in ``evals.evaluate`` (``eval_tasks``), once per
    ``deepswe_eval`` run whichever way it evaluates, and by the eval pod and ``posttrain eval`` alike,
    none of which spells the dataset/split/ids reading again; the loss is read as ``cfg.loss``, with
    no accessor of its own."""
    from assets.evals import checkpoint_eval_run_config
    from evals.evaluate import eval_tasks
    from training.config import LossConfig

    assert _calls_into("dagster_project/sensors.py", "eval_request") == {checkpoint_eval_run_config.__name__}
    for path in ("assets/evals.py", "training/fleet_eval.py", "dagster_project/cli.py"):
        for spelled in ("load_eval_tasks", "select_tasks", "eval_split"):
            assert not _called(path, spelled), f"{path} picks the [eval] tasks itself ({spelled})"
    assert _called("assets/evals.py", eval_tasks.__name__) == 1  # before the fleet/local branch, not in each
    assert inspect.signature(eval_tasks).parameters["settings"].annotation == "EvalSection"
    assert not hasattr(LossConfig, "from_config")


def test_a_commands_eval_options_are_set_over_the_runs_section_not_over_a_table_of_it(tmp_path) -> None:
    """``posttrain backfill`` evaluates a partition as its run's ``[eval]`` says with the options
    given over it: the run's section (already valid) is the base, the options alone are validated
    and set on it, and nothing turns the section back into a table to read it again. A bad option
    names the key; the tasks the section picks are the same whichever caller asks."""
    import argparse

    import pytest

    from dagster_project.cli import eval_section
    from evals.evaluate import eval_tasks
    from evals.settings import EvalSection, override_eval_section
    from sandboxes.settings import SettingsError

    run = EvalSection(attempts=3, max_turns=2, task_ids=("a", "b"), temperature=0.5)
    args = argparse.Namespace(run_file=None, attempts=None, max_turns=5, dataset=None)
    assert eval_section(args, run, "posttrain backfill") == EvalSection(
        attempts=3, max_turns=5, task_ids=("a", "b"), temperature=0.5)
    assert override_eval_section(run, {"seed": 4, "workers": None}, "opts") == EvalSection(
        attempts=3, max_turns=2, task_ids=("a", "b"), temperature=0.5, seed=4)
    with pytest.raises(SettingsError, match=r"posttrain backfill: \[eval\] max_turns: expected a positive value"):
        eval_section(argparse.Namespace(run_file=None, attempts=None, max_turns=0, dataset=None), run,
                     "posttrain backfill")
    tree = ast.parse((ROOT / "dagster_project/cli.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in ("as_table", "eval_config")]
    # the bundled suite as a task source: its eval split, then the ids named, in that order
    from evals.bundled import build_suite

    suite = tmp_path / "suite"
    build_suite(suite, per_level=2, extra_eval_per_level=0, workers=2)
    held_out = [t.id for t in eval_tasks(EvalSection(), bundled_dir=suite)]
    assert held_out and [t.id for t in eval_tasks(EvalSection(task_ids=tuple(held_out[::-1])), bundled_dir=suite)] \
        == held_out[::-1]
    with pytest.raises(ValueError, match=r"\[eval\] task_ids: nope is not a task of bundled"):
        eval_tasks(EvalSection(task_ids=("nope",)), bundled_dir=suite)


def test_a_loss_knob_is_checked_as_the_loss_declares_it_in_the_planner_and_in_the_trainer(tmp_path) -> None:
    """``[trainer] tis_cap`` and ``kl_coef`` are refused out of their declared range both where the run
    file is planned and where the trainer reads its JSON (``TrainConfig.load``, the plan's trainer
    table or a hand-written one): the trainer took ``tis_cap = 0`` and ``kl_coef = -1`` that the
    planner refuses. A valid knob goes through the plan's trainer table into ``cfg.loss`` as it was."""
    import json

    import pytest

    from training.config import TrainConfig
    from training.planner import resolve
    from training.planner.schema import PlanError

    for key, bad, expected in (("tis_cap", 0.0, "a positive value"), ("kl_coef", -1.0, "a value of 0 or more")):
        with pytest.raises(PlanError, match=rf"\[trainer\] {key}: expected {expected}"):
            resolve({"model": DENSE, "inference": {"max_context_length": 4096}, "trainer": {key: bad}},
                    source="r.toml")
        path = tmp_path / "trainer.json"
        path.write_text(json.dumps({"base_model": "m", key: bad}))
        with pytest.raises(ValueError, match=rf"{path}: key '{key}' must be {expected}, got {bad}"):
            TrainConfig.load(path)
    run = {"model": DENSE, "inference": {"max_context_length": 4096}, "trainer": {"kl_coef": 0.05, "tis_cap": 3.0}}
    planned = resolve(run, source="r.toml").to_json()
    planned["trainer"]["base_model"] = "m"  # the run file names no model folder here
    path.write_text(json.dumps(planned))
    loss = TrainConfig.load(path).loss
    assert (loss.kl_coef, loss.tis_cap) == (0.05, 3.0)
