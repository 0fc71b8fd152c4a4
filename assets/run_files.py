"""Run files as the assets read them: the TOML with the embedded default placed under the storage root.

``difficulty_curriculum`` and ``rl_run`` both start from a run file (default
``examples/embedded.toml``) and from its base model, which for the embedded default is built here
from the bundled suite's demonstrations the first time it is needed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dagster as dg

from assets.resources import PosttrainStorage
from evals.bundled import read_suite
from evals.tasks import demonstration_tasks
from training.planner.k8s import RUN_AS
from training.planner.schema import read_run_toml

PROJECT_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_RUN_FILE = PROJECT_ROOT / "examples" / "embedded.toml"
EMBEDDED_MODEL_NAME = "embedded-base"


def run_file_dict(storage: PosttrainStorage, run_file: str) -> tuple[dict[str, Any], str]:
    """The run TOML as a dict, with the embedded default's model and tasks placed under ``storage``, and
    the ``[eval]`` dataset and sources made absolute (relative to the folder posttrain runs in)."""
    path = Path(run_file) if run_file else EMBEDDED_RUN_FILE
    if not path.is_file():
        raise FileNotFoundError(f"run file {path} is missing")
    data = read_run_toml(path)
    model = data.setdefault("model", {})
    if model.get("name") == EMBEDDED_MODEL_NAME:
        model["path"] = str(storage.path / "models" / "base")
    curriculum = data.setdefault("curriculum", {})
    curriculum.setdefault("tasks", str(storage.datasets_dir() / "bundled"))
    evaluation = data.get("eval")
    if isinstance(evaluation, dict):  # the plan keeps them absolute: the checkpoint evals run elsewhere
        for key in ("dataset", "sources"):
            value = evaluation.get(key)
            if isinstance(value, str) and value not in ("", "bundled") and not Path(value).is_absolute():
                evaluation[key] = str(Path(value).resolve())
    return data, str(path)


def ensure_embedded_base(context: dg.AssetExecutionContext, data: dict[str, Any],
                         *, sft_steps: int = 0, reuse_any: bool = False) -> Path:
    """The base model folder. The embedded default's is built from the training split unless a build
    of the same settings and data is there (``reuse_any``: any complete build is used as is)."""
    model = Path(data["model"].get("path") or "")
    if data["model"].get("name") == EMBEDDED_MODEL_NAME and not (reuse_any and (model / "build.json").is_file()):
        # torch (7 s to import): only the first run of the embedded model builds it
        from training.base_model import BaseModelSpec, build_base_model

        tasks = demonstration_tasks(read_suite(data["curriculum"]["tasks"]))
        spec = BaseModelSpec(sft_steps=sft_steps) if sft_steps else BaseModelSpec()
        context.log.info(f"building (or reusing) the embedded base model at {model} from {len(tasks)} demonstrations")
        build_base_model(model, tasks, spec)
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"run file key model.path: {model} is not a Hugging Face model folder")
    return model


# the keys of a run file that name files the trainer reads (the eval's are read by the eval's own pod)
VOLUME_PATH_KEYS = (("model", "path"), ("curriculum", "tasks"), ("curriculum", "curriculum_file"),
                    ("eval", "dataset"), ("eval", "sources"))


def on_run_volume(data: dict[str, Any], storage: PosttrainStorage) -> list[Path]:
    """Name ``data``'s file paths as the pods of a Kubernetes run see them (in place), and return the
    files of this machine they name. The storage root is a mount of the run volume (on the test
    plane, the volume's own folder), and every pod's working directory is the volume's root, so a
    path under the storage root becomes relative to it. A relative path stays (already the
    volume's), and so does any other absolute one: it is the pods' own view (``/run-data/...``, or a
    folder of the image)."""
    root = storage.path
    named = []
    for section, key in VOLUME_PATH_KEYS:
        table = data.get(section)
        value = table.get(key) if isinstance(table, dict) else None
        if not isinstance(value, str) or not value or value == "bundled" or not Path(value).is_absolute():
            continue
        path = Path(value).resolve()
        if path.is_relative_to(root):
            table[key] = path.relative_to(root).as_posix()
            named.append(path)
    return named


def hand_to_workloads(*paths: Path) -> None:
    """Make ``paths`` (and what is in them) the workloads' own (uid and gid of
    :data:`training.planner.k8s.RUN_AS`) when this process is root: the pods of a run write their run
    folder and eval rows on the volume as that user, and what Dagster made there as root they could
    not. Not root: nothing to do (the files are already the user's who made them)."""

    if os.geteuid() != 0:
        return
    for top in paths:
        if not top.exists():  # a folder the pods are to write in (the run's, the eval rows')
            top.mkdir(parents=True)
        for path in [top, *(top.rglob("*") if top.is_dir() else ())]:
            os.lchown(path, RUN_AS, RUN_AS)
