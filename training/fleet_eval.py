"""A checkpoint's evaluation on the fleet of its own run: the eval pod of a Kubernetes run.

``deepswe_eval`` of a run that ``rl_run`` launched on Kubernetes starts ``python -m
training.fleet_eval`` in a pod of the run (:func:`training.planner.k8s.eval_pod`: the run's image,
volume, credential, router and sandbox pool; Dagster Pipes in its environment) instead of serving
the checkpoint with an engine of its own: the model calls go through the run's router to its
engine pods, the episodes and their gradings run in sandbox pods of the run's pool, as the
trainer's episodes do. The checkpoint's adapter is announced to the router first (``POST
/publish_adapter``: every replica that lacks the version loads it from the run volume), and each
call names that version, so the engines may go on serving the trainer's newer versions beside it.
The attempt rows are written to ``--rows`` on the run volume, where the asset reads them. It sits
in ``training`` (above ``evals``) because the run's fleet and checkpoints are training's.

The method is :func:`evals.evaluate.evaluate`'s, unchanged, handed the ``[eval]`` section that
``--settings`` carries (``evals.settings.POD_KEYS``) whole: the same tasks, attempts, turns, seed
and grading (only committed work graded; hidden inputs answered in sandboxes of the grader's own).
What differs from a local evaluation is the engine: LoRA applied at run time on a shared replica
rather than merged weights on a replica of its own (the same outputs up to floating-point order).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dagster_pipes import DAGSTER_PIPES_CONTEXT_ENV_VAR, open_dagster_pipes

from evals.attempts import write_rows
from evals.evaluate import eval_tasks, evaluate, model_tokens
from evals.harness import HttpClient, episode_context
from evals.sandbox import platform_sandbox_factory
from evals.settings import parse_eval_table
from training.checkpoint import checkpoint_policy
from training.loop import AdapterRef
from training.remote_fleet import ROUTER_URL_VARIABLE, RemoteFleet


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m training.fleet_eval",
        description="Evaluate a checkpoint of a Kubernetes run on the run's own engines (through its router, "
                    f"${ROUTER_URL_VARIABLE}) and sandbox pool; deepswe_eval launches it in the run's eval pod.")
    parser.add_argument("--checkpoint", required=True, help="the checkpoint's partition key, RUN-step_NNNNNN")
    parser.add_argument("--checkpoint-dir", required=True, help="the checkpoint's folder on the run volume")
    parser.add_argument("--rows", required=True, help="where the attempt rows go (Parquet, on the run volume)")
    parser.add_argument("--settings", required=True,
                        help="the eval settings as JSON: dataset, split, task_ids, attempts, max_turns, ... "
                             "(deepswe_eval's config)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, log=print) -> Path:
    """Evaluate and write the rows; returns their path."""
    try:
        # the run's [eval] section, its defaults and checks as everywhere else (evals.settings)
        section = parse_eval_table(json.loads(args.settings), "--settings")
    except ValueError as exc:  # not JSON, or a key that does not validate (SettingsError is a ValueError)
        raise SystemExit(f"--settings: {exc}") from None
    router = os.environ.get(ROUTER_URL_VARIABLE)
    if not router:
        raise SystemExit(f"${ROUTER_URL_VARIABLE} is not set: the run's eval pod sets it to the run's router")
    policy = checkpoint_policy(args.checkpoint_dir, name=args.checkpoint)
    tasks = eval_tasks(section, bundled_dir=Path(os.environ.get("POSTTRAIN_HOME", ".")) / "datasets" / "bundled")
    fleet = RemoteFleet(router, log=log)
    version = None
    if policy.adapter is not None:
        version = policy.adapter_version
        step = int(args.checkpoint.rsplit("step_", 1)[-1])
        fleet.announce(AdapterRef(step=step, name=version, path=policy.adapter))
        log(f"announced adapter {version} ({policy.adapter}) to the router {router}")
    tokenizer, eos_ids = model_tokens(policy.base_model, what=f"checkpoint {args.checkpoint}")
    log(f"evaluating {args.checkpoint} (adapter {version or 'none: the base model'}) on {len(tasks)} tasks x "
        f"{section.attempts} attempts through {router}")
    rows = evaluate(tasks, HttpClient(router), tokenizer, platform_sandbox_factory("k8s"), section,
                    checkpoint=args.checkpoint, adapter_version=version, stop_token_ids=eos_ids,
                    **episode_context(policy.base_model))
    path = write_rows(rows, Path(args.rows))
    log(f"{len(rows)} attempt rows written to {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.environ.get(DAGSTER_PIPES_CONTEXT_ENV_VAR):
        run(args)
        return 0
    with open_dagster_pipes() as pipes:
        def log(message: str) -> None:
            pipes.log.info(message)
            print(message, flush=True)

        path = run(args, log=log)
        pipes.report_custom_message({"rows": str(path)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
