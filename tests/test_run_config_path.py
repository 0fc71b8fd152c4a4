"""The path of a run-file key to where it acts: each section declared by the package that acts on it,
composed by the planner, and handed on by its own lists rather than copies of its keys.

``training.planner.schema`` composes the run file and declares no section of its own: ``[eval]`` is
``evals.settings.EvalSection``, the planner's own sections are ``training.planner.sections``'s, and
``[trainer]`` is made from ``training.config``. ``[eval]`` says which of its keys pick the tasks and
which run them; the eval pod (``training.planner.k8s.EVAL_SETTINGS``) and the evaluation
(``EvalSection.run_settings``) take those lists from it, so no module spells them again.
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
    assert where == {"eval": "evals.settings", **{name: "training.planner.sections" for name in
                     ("run", "model", "inference", "async", "sandbox", "curriculum", "kubernetes")}}
    tree = ast.parse((ROOT / "training/planner/schema.py").read_text())
    assert [node.name for node in tree.body if isinstance(node, ast.ClassDef)] == ["RunFile"]
    composed = {f.name for f in dataclasses.fields(TrainerSection)}
    assert composed == set(trainer_keys(TrainConfig)) | set(TRAINER_POD_KEYS)


def test_the_eval_pod_and_the_evaluation_take_the_eval_keys_from_the_eval_section() -> None:
    """Which ``[eval]`` keys pick the tasks and which run them is said once, on the section's
    fields; the eval pod's settings and the trainer-side pod module read those lists, and every key
    that runs a task is a keyword argument of the evaluation that receives it."""
    from evals.evaluate import evaluate
    from evals.settings import POD_KEYS, RUN_KEYS, TASK_KEYS, EvalSection
    from training import fleet_eval
    from training.planner import k8s

    assert set(TASK_KEYS) == {"dataset", "split", "task_ids"}
    assert set(RUN_KEYS) == {"attempts", "max_turns", "max_new_tokens", "temperature", "seed", "workers"}
    assert k8s.EVAL_SETTINGS == POD_KEYS == TASK_KEYS + RUN_KEYS
    assert fleet_eval.RUN_SETTINGS == RUN_KEYS
    keywords = inspect.signature(evaluate).parameters
    assert all(keywords[key].kind is inspect.Parameter.KEYWORD_ONLY for key in RUN_KEYS)
    assert EvalSection(attempts=3, seed=5).run_settings() == {
        "attempts": 3, "max_turns": 4, "max_new_tokens": 48, "temperature": 1.0, "seed": 5, "workers": 2}
    # no module of the planner spells a list of the eval's keys again
    for path in sorted((ROOT / "training/planner").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List)):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                assert len(names & set(POD_KEYS)) < 3, f"{path.name}:{node.lineno} lists [eval] keys"


def test_an_eval_run_setting_goes_from_the_run_file_to_the_evaluation_as_the_section_says(tmp_path) -> None:
    """``[eval] attempts`` and the other run settings from a run file, through the plan on disk, the
    checkpoint sensor's run request and deepswe_eval's config, are the keywords the evaluation is
    called with: ``evaluate`` takes them (here on no task, so nothing is served)."""
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
    rows = evaluate([], None, None, platform_sandbox_factory("bwrap"), checkpoint="r-step_000004",
                    **section.run_settings())
    assert rows == []
