"""One run config: each section declared once, in the package that uses it, and passed down whole.

``[eval]`` is ``evals.settings.EvalSection``: the planner composes it into the run file, the plan
keeps it, the checkpoint sensor's run request carries it, and ``deepswe_eval``'s Dagster config is
generated from it and read back into it once. The loss's keys are ``training.config.LossConfig``:
the trainer's config holds it whole and ``[trainer]`` is made from the trainer's config. The key
reference, ``docs/run-file.md``, is written from the same declarations.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import dagster as dg
import pytest

ROOT = Path(__file__).resolve().parents[1]
DENSE = {"name": "dense-7b", "weights_gib": 14.2, "full_attention_layers": 28, "kv_heads": 4, "head_dim": 128,
         "kv_dtype_bytes": 2}


def test_the_run_file_reference_is_written_from_the_declarations() -> None:
    """docs/run-file.md is what the declarations say, every section and every key (``[eval]``'s and
    the loss's among them, with their defaults and allowed values)."""
    from training.planner.schema import RUN_FILE_REFERENCE, SECTIONS, run_file_reference

    text = run_file_reference()
    written = (ROOT / RUN_FILE_REFERENCE).read_text()
    assert written == text, f"{RUN_FILE_REFERENCE} is stale: rewrite it with `posttrain keys > {RUN_FILE_REFERENCE}`"
    for name in SECTIONS:
        assert f"## `[{name}]`" in text
    assert "| `attempts` | integer | `8` | > 0 | attempts per task (the k of pass@k) |" in text
    assert "| `loss_weighting` | string | `\"token\"` | `token`, `sequence` |" in text
    assert "| `tis_cap` | number | `2.0` | > 0 | truncated importance-sampling cap |" in text


def test_the_eval_section_is_declared_once_in_evals_and_deepswe_evals_config_is_made_from_it() -> None:
    """The run file's ``[eval]`` is the evals package's section; the asset's Dagster config has
    exactly its keys, types and defaults (and shows each key's meaning in the launchpad)."""
    from assets.evals import DeepSWEEvalConfig
    from evals.settings import EvalSection
    from training.planner.schema import SECTIONS, RunFile

    assert SECTIONS["eval"] is EvalSection and typing.get_type_hints(RunFile)["eval"] is EvalSection
    section = {f.name: f for f in dataclasses.fields(EvalSection)}
    config = DeepSWEEvalConfig.model_fields
    assert list(config) == list(section)
    for name, f in section.items():
        default = list(f.default) if isinstance(f.default, tuple) else f.default
        assert config[name].default == default, name
        assert config[name].description == (f.metadata["doc"] or None), name


def test_an_eval_key_goes_from_the_run_file_to_deepswe_eval_as_one_section(tmp_path) -> None:
    """``[eval] attempts`` (and every other key) from the run file, through the plan on disk and the
    checkpoint sensor's run request, reaches deepswe_eval's config and is read back into the same
    ``EvalSection``."""
    from assets.evals import DeepSWEEvalConfig
    from assets.resources import PosttrainStorage
    from dagster_project.sensors import eval_request
    from evals.settings import EvalSection, parse_eval_table
    from training.planner import resolve, write_resolved_plan

    storage = PosttrainStorage(root=str(tmp_path))
    table = {"attempts": 3, "task_ids": ["a", "b"], "max_infra_error_share": 0.5, "sources": "/src"}
    plan = resolve({"model": DENSE, "inference": {"max_context_length": 4096}, "eval": table}, source="r.toml")
    assert plan.run_file.eval == EvalSection(attempts=3, task_ids=("a", "b"), max_infra_error_share=0.5, sources="/src")
    write_resolved_plan(plan, storage.run_dir("r"))
    request = eval_request(storage, "r-step_000004", "r-step_000004")
    config = request.run_config["ops"]["deepswe_eval"]["config"]
    assert config["attempts"] == 3 and config["task_ids"] == ["a", "b"]
    section = parse_eval_table(DeepSWEEvalConfig(**config).model_dump(), source="deepswe_eval config")
    assert section == plan.run_file.eval


def test_a_bad_eval_config_given_to_deepswe_eval_is_refused_naming_the_key(posttrain_home) -> None:
    """A config typed in the launchpad is validated by the section's own rules before anything runs:
    0 attempts is refused naming the config and the key (it used to go on to load the checkpoint)."""
    from assets.evals import deepswe_eval
    from assets.resources import PosttrainStorage

    storage = PosttrainStorage(root=str(posttrain_home))
    key = "t-step_000000"
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("checkpoints", [key])
        result = dg.materialize([deepswe_eval], instance=instance, resources={"storage": storage}, partition_key=key,
                                raise_on_error=False,
                                run_config={"ops": {"deepswe_eval": {"config": {"attempts": 0, "workers": 1}}}})
    assert not result.success
    error = str(result.get_step_failure_events()[0].event_specific_data.error)
    assert "deepswe_eval config of t-step_000000: [eval] attempts: expected a positive value, got 0" in error


def test_the_loss_settings_are_declared_once_and_the_trainer_config_holds_them_whole() -> None:
    """``LossConfig`` (training.config) declares every loss key; the trainer's config holds it as
    ``loss`` (no flat copy of its fields), ``[trainer]`` offers its keys with its types and choices,
    and the trainer's JSON keeps the flat keys it always had."""
    from training import grpo
    from training.config import LossConfig, TrainConfig
    from training.planner.schema import TrainerSection

    assert grpo.LossConfig is LossConfig
    assert not {"tis_cap", "kl_coef", "loss_weighting", "scale_advantages_by_std"} & {
        f.name for f in dataclasses.fields(TrainConfig)}
    trainer = typing.get_type_hints(TrainerSection)
    fields = {f.name: f for f in dataclasses.fields(TrainerSection)}
    for f in dataclasses.fields(LossConfig):
        key = f.metadata.get("key") or f.name
        assert trainer[key] == typing.get_type_hints(LossConfig)[f.name] | None, key
        assert fields[key].metadata["choices"] == f.metadata["choices"] and fields[key].default is None, key
    cfg = TrainConfig.from_mapping({"base_model": "m", "tis_cap": 3, "kl_coef": 0.05, "loss_weighting": "sequence"})
    assert cfg.loss == LossConfig(tis_cap=3.0, kl_coef=0.05, weighting="sequence")
    assert not hasattr(cfg, "tis_cap") and not hasattr(cfg, "loss_weighting")  # read as cfg.loss.<field> only
    data = cfg.to_json()
    assert "loss" not in data and (data["tis_cap"], data["loss_weighting"]) == (3.0, "sequence")
    assert set(data) == TrainConfig.keys()  # what bench/recipe_trial.py --set may change
    assert TrainConfig.from_mapping(data) == cfg
    with pytest.raises(ValueError, match="trainer config: key 'loss_weighting' must be one of token, sequence"):
        TrainConfig.from_mapping({"base_model": "m", "loss_weighting": "episode"})


def test_a_loss_key_in_the_run_file_reaches_the_loss_as_that_object() -> None:
    """``[trainer] tis_cap`` in the run file: validated by the planner with the loss's own
    constraint, written to the plan's trainer table, and read by the trainer into ``cfg.loss``."""
    from training.config import TrainConfig
    from training.planner import PlanError, resolve

    plan = resolve({"model": DENSE, "inference": {"max_context_length": 4096}, "trainer": {"tis_cap": 1.5}},
                   source="r.toml")
    cfg = TrainConfig.from_mapping({**plan.trainer_config(), "base_model": "m"})
    assert cfg.loss.tis_cap == 1.5
    with pytest.raises(PlanError) as bad:
        resolve({"model": DENSE, "inference": {"max_context_length": 4096}, "trainer": {"tis_cap": 0}}, source="r.toml")
    assert "r.toml: [trainer] tis_cap: expected a positive value, got 0 (int)" in str(bad.value)
