"""The ``posttrain`` command line.

Platform commands (``demo``, ``ui``, ``backfill``) live here; each domain package adds its own
commands through a ``register(subparsers)`` function in its ``cli`` module.

Dagster, the asset definitions and pandas take seconds to import, so the commands that need them
(``demo``, ``backfill``, ``eval --model``, ``score``) import them in their functions: ``posttrain
--help``, ``sandbox``, ``tasks`` and ``plan`` start without them. Everything else is imported here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Sequence

import evals.cli
import sandboxes.cli
import serving.cli
import training.audit
import training.planner.cli
from dagster_project.instance import ensure_dagster_home
from dagster_project.processes import Supervisor
from evals.flawed import FlawedListError, ensure_flawed_lists, flawed_views, load_flawed_lists, views_markdown
from evals.settings import EVAL_DEFAULTS as EVAL_SECTION_DEFAULTS, EvalSection, override_eval_section
from evals.tasks import TaskLoadError, load_harbor
from sandboxes.files import NotARegularFile, open_regular_file
from sandboxes.home import HOME_ENV, default_home
from training.planner.schema import PlanError, load_run_file
from viewer.links import DEFAULT_PORT as VIEWER_PORT, URL_ENV as VIEWER_URL_ENV

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DOMAIN_CLIS = (evals.cli, sandboxes.cli, serving.cli, training.planner.cli, training.audit)
EVAL_DEFAULTS = vars(EVAL_SECTION_DEFAULTS)  # the [eval] defaults (evals.settings), shown in the options' help


def _add_home(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--home",
        help="root folder for datasets, runs, evals and the Dagster instance "
        "(default: $POSTTRAIN_HOME, else ./posttrain-data)",
    )


def cmd_demo(args: argparse.Namespace) -> int:
    ensure_dagster_home(args.home)
    from dagster_project.demo import run_demo  # Dagster and every asset module: see the module docstring

    return run_demo(args.run_name, seed=args.seed)


def cmd_ui(args: argparse.Namespace) -> int:
    home = ensure_dagster_home(args.home)
    bin_dir = Path(sys.executable).parent
    supervisor = Supervisor(grace_s=args.grace)
    # rl_run links TensorBoard through the viewer, which redirects to the port it is served on
    tensorboard_url = f"http://127.0.0.1:{args.tensorboard_port}" if args.tensorboard else ""
    # asset metadata links each step, checkpoint and task to the viewer at the port it is served on
    os.environ[VIEWER_URL_ENV] = f"http://127.0.0.1:{args.viewer_port}"
    supervisor.start("dagster dev", [
        str(bin_dir / "dagster"), "dev",
        "-w", str(PROJECT_ROOT / "workspace.yaml"),
        "-h", "127.0.0.1", "-p", str(args.port),
    ])
    print(f"Dagster UI on http://127.0.0.1:{args.port} (instance {home}); Ctrl-C stops it", flush=True)
    supervisor.start("viewer", [
        sys.executable, "-m", "viewer", "--home", str(default_home()), "--port", str(args.viewer_port),
        "--tensorboard-url", tensorboard_url,
    ])
    print(f"trajectory viewer on http://127.0.0.1:{args.viewer_port} (rollouts and eval attempts)", flush=True)
    if args.tensorboard:
        logdir = default_home() / "runs"
        logdir.mkdir(parents=True, exist_ok=True)
        supervisor.start("tensorboard", [
            str(bin_dir / "tensorboard"), "--logdir", str(logdir), "--host", "127.0.0.1",
            "--port", str(args.tensorboard_port),
        ])
        print(f"TensorBoard on http://127.0.0.1:{args.tensorboard_port} (event files under {logdir})", flush=True)
    return supervisor.wait()


def cmd_backfill(args: argparse.Namespace) -> int:
    ensure_dagster_home(args.home)
    import dagster as dg  # Dagster and every asset module: see the module docstring

    # start light: `posttrain` loads Dagster and the code location only for the commands that use them
    from dagster_project.backfill import launch_backfill, select_partitions, wait_for_backfill
    from dagster_project.definitions import defs

    asset_key = dg.AssetKey(args.asset)
    try:
        asset = defs.resolve_assets_def(asset_key)
    except Exception:
        names = sorted(k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys())
        print(f"posttrain backfill: no asset {args.asset!r}; assets: {', '.join(names)}", file=sys.stderr)
        return 2
    partitions_def = asset.partitions_def
    if partitions_def is None:
        print(f"posttrain backfill: asset {args.asset!r} is not partitioned", file=sys.stderr)
        return 2
    with dg.DagsterInstance.get() as instance:
        available = partitions_def.get_partition_keys(dynamic_partitions_store=instance)
    keys = [k.strip() for k in args.partitions.split(",") if k.strip()] if args.partitions else None
    try:
        selected = select_partitions(available, keys, args.start, args.end, args.asset)
    except ValueError as exc:
        print(f"posttrain backfill: {exc}", file=sys.stderr)
        return 2
    try:
        run_config = backfill_run_config(args, selected)
    except ValueError as exc:  # PlanError too: it names the file or option and the key
        print(f"posttrain backfill: {exc}", file=sys.stderr)
        return 2
    backfill_id = launch_backfill(PROJECT_ROOT / "workspace.yaml", args.asset, selected, run_config)
    print(f"backfill {backfill_id}: {args.asset} over {len(selected)} partitions: {', '.join(selected)}", flush=True)
    if args.wait:
        counts = wait_for_backfill(backfill_id, timeout_s=args.timeout)
        return 0 if set(counts) <= {"SUCCESS"} else 1
    print("the Dagster daemon launches its runs (`posttrain ui` runs one); follow it in the UI under Overview > Backfills")
    return 0


def eval_section(args: argparse.Namespace, base: EvalSection | None, what: str) -> EvalSection:
    """The ``[eval]`` settings of a command: ``base`` (a run's section, or ``--run-file``'s: the whole
    file validated), overridden by the options given; the options are validated once, over the
    section (which is not turned back into a table), ``PlanError`` naming the key. Paths are made
    absolute: the daemon that retries an eval does not run in this folder."""
    source = what
    if getattr(args, "run_file", None):
        base = load_run_file(args.run_file).eval
        source = f"{what} over the [eval] of {args.run_file}"
    table = evals.cli.eval_table(args)
    if getattr(args, "dataset", None):
        table["dataset"] = args.dataset
    section = override_eval_section(base or EVAL_SECTION_DEFAULTS, table, source)
    paths = {key: str(Path(value).expanduser().resolve()) for key in ("dataset", "sources")
             if (value := getattr(section, key)) and value != "bundled" and Path(value).expanduser().exists()}
    return dataclasses.replace(section, **paths) if paths else section


def cmd_eval(args: argparse.Namespace) -> int:
    ensure_dagster_home(args.home)
    try:
        section = eval_section(args, None, "posttrain eval")
    except PlanError as exc:
        print(f"posttrain eval: {exc}", file=sys.stderr)
        return 2
    if not (args.model and args.agent == "model" and args.scaffold == "builtin"):
        if args.adapter:
            print("posttrain eval: --adapter goes with --model (the builtin scaffold)", file=sys.stderr)
            return 2
        return evals.cli.run_agents(args, section)
    return _eval_model(args, section)


def _eval_model(args: argparse.Namespace, section) -> int:
    """``posttrain eval --model``: checked here first (a bad folder, task id or dataset costs no run:
    every task named must load and every image must build, exit 2 naming the task and its file),
    then registered and evaluated in the instance (:mod:`dagster_project.model_eval`)."""
    # Dagster and the eval's own modules, loaded for this command only: see the module docstring
    from assets.resources import PosttrainStorage
    # start light: `posttrain eval` loads Dagster, the evals and serving (uvicorn) only when it runs
    from dagster_project.model_eval import DatasetError, RegistrationError, check_harbor_dataset, evaluate_model
    from evals.evaluate import eval_tasks, write_rows
    from evals.harbor import is_harbor_dataset

    model = Path(args.model).expanduser().resolve()
    adapter = Path(args.adapter).expanduser().resolve() if args.adapter else None
    if not (model / "config.json").is_file():
        print(f"posttrain eval: --model {args.model}: not a Hugging Face model folder (no config.json)", file=sys.stderr)
        return 2
    if adapter is not None and not (adapter / "adapter_config.json").is_file():
        print(f"posttrain eval: --adapter {args.adapter}: not a peft adapter folder (no adapter_config.json)",
              file=sys.stderr)
        return 2
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731 - the progress lines go to stderr
    if is_harbor_dataset(section.dataset):
        if not section.sources:
            print(f"posttrain eval: {args.dataset}: a Harbor dataset needs --sources (the folder of repository "
                  "sources its images are built from)", file=sys.stderr)
            return 2
        try:
            task_set = load_harbor(section.dataset, sources=section.sources)
        except TaskLoadError as exc:
            print(f"posttrain eval: {exc}", file=sys.stderr)
            return 2
        known = {t.id for t in task_set.tasks} | {t.id for t in task_set.incomplete}
        unknown = [i for i in section.task_ids if i not in known]
        if unknown:
            print(f"posttrain eval: --tasks: {', '.join(unknown)}: no such task in {args.dataset}", file=sys.stderr)
            return 2
        if not section.task_ids:
            evals.cli.print_left_out("eval", task_set, section.sources, args.verbose)
        try:
            check_harbor_dataset(section, PosttrainStorage(), task_set, log=log)
        except DatasetError as exc:
            print(f"posttrain eval: {args.dataset} cannot be evaluated as asked; nothing was run or recorded:",
                  file=sys.stderr)
            for line in exc.problems:
                print(f"  {line}", file=sys.stderr)
            print("posttrain eval: fix those tasks, or leave them out with --tasks", file=sys.stderr)
            return 2
    elif section.dataset != "bundled":  # a task source: its tasks load and the ids name them, before any run
        try:
            eval_tasks(section, bundled_dir="")
        except (TaskLoadError, ValueError, OSError) as exc:
            print(f"posttrain eval: {exc}", file=sys.stderr)
            return 2
    try:
        flawed_lists = load_flawed_lists(ensure_flawed_lists(os.environ[HOME_ENV]))
        done = evaluate_model(model, adapter, args.name, section, log=log,
                              log_level="DEBUG" if args.verbose else "INFO")
    except (RegistrationError, FlawedListError) as exc:
        print(f"posttrain eval: {exc}", file=sys.stderr)
        return 2
    rows = done.rows
    if args.out:
        write_rows(rows, args.out)
    views = flawed_views(rows, flawed_lists, k=section.attempts)
    path = str(done.path) if done.path.is_file() else None
    if args.json:
        print(json.dumps({"checkpoint": done.key, "run_id": done.run_id, "rows_path": path, "rows": rows,
                          "views": views}, default=str))
    else:
        print(views_markdown(views))
        print(f"checkpoint {done.key}, Dagster run {done.run_id}: `posttrain ui` shows it under deepswe_eval")
    print(f"posttrain eval: attempt rows: {path or 'none written'}"
          + (" (a failed run's, kept apart from the checkpoint's record)" if path and not done.success else ""),
          file=sys.stderr)
    if not done.success:
        print(f"posttrain eval: the eval of {done.key} failed: {done.error}", file=sys.stderr)
        return 1
    problems = evals.cli.closing_problems(rows, {})
    return evals.cli.print_closing_problems("eval", problems, len({r["task_id"] for r in rows}))


def backfill_run_config(args: argparse.Namespace, partitions: list[str]) -> dict | None:
    """The run config of a ``deepswe_eval`` backfill: the ``[eval]`` of the partitions' runs (their
    plans, or a registered model's ``eval.json``; they must agree unless ``--run-file`` gives one),
    with the eval options given over it. Other assets take no eval options."""
    from assets.evals import eval_run_config, run_eval_section  # see the module docstring
    # start light: Dagster and the asset modules load only for `posttrain backfill` (see the module docstring)
    from assets.partitions import parse_checkpoint_partition_key
    from assets.resources import PosttrainStorage

    given = bool(evals.cli.eval_table(args) or args.run_file or args.dataset)
    if args.asset != "deepswe_eval":
        if given:
            raise ValueError(f"the eval options (--dataset, --run-file, --attempts, ...) set deepswe_eval's config; "
                             f"asset {args.asset!r} takes none")
        return None
    storage = PosttrainStorage()
    base = None
    if not args.run_file:
        runs = sorted({parse_checkpoint_partition_key(key)[0] for key in partitions})
        sections = {run: run_eval_section(storage, run) for run in runs}
        if len(set(sections.values())) > 1:
            raise ValueError(f"the runs {', '.join(runs)} were planned with different [eval] tables; backfill "
                             "them apart, or give the eval with --run-file")
        base = next(iter(sections.values()))
    section = eval_section(args, base, "posttrain backfill")
    return eval_run_config(section)


def cmd_score(args: argparse.Namespace) -> int:
    import pandas as pd  # pandas and the report: see the module docstring

    # start light: pandas loads only for `posttrain score`
    from evals.report import checkpoint_summary, flagged_mask

    if args.k < 1:
        print(f"posttrain score: --k {args.k}: expected an integer >= 1", file=sys.stderr)
        return 2
    frames = []
    for path in args.rows:
        try:
            with open_regular_file(path) as fh:  # a FIFO or a device is refused at once, never waited on
                frame = pd.read_parquet(fh)
        except NotARegularFile as exc:
            print(f"posttrain score: {exc} (attempt rows in Parquet)", file=sys.stderr)
            return 2
        except Exception as exc:  # pyarrow raises several kinds for a missing or non-Parquet file
            print(f"posttrain score: {path}: not readable attempt rows (Parquet expected): {exc}", file=sys.stderr)
            return 2
        missing = sorted({"checkpoint", "task_id", "status", "reward", "target_score", "strict_target_score",
                          "partial"} - set(frame.columns))
        if missing:
            print(f"posttrain score: {path}: missing column(s) {', '.join(missing)} of attempt rows", file=sys.stderr)
            return 2
        frames.append(frame)
    rows = pd.concat(frames, ignore_index=True)
    if args.exclude_flagged:
        rows = rows[~flagged_mask(rows)]
    summary = checkpoint_summary(rows, args.k) if len(rows) else []
    if args.json:
        clean = [{key: (None if isinstance(v, float) and math.isnan(v) else v) for key, v in r.items()} for r in summary]
        print(json.dumps({"exclude_flagged": args.exclude_flagged, "k": args.k, "checkpoints": clean}, indent=2))
        return 0
    scores = list(dict.fromkeys(["pass@1", f"pass@{args.k}"])) + ["target_score", "strict_target_score", "partial"]
    header = ["checkpoint", "tasks", "attempts", "infra errors", "flagged", *scores]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in summary:
        cells = [r["checkpoint"], r["tasks"], r["attempts"], r["infra_errors"], r["flagged"], *(r[s] for s in scores)]
        print("| " + " | ".join("–" if isinstance(c, float) and math.isnan(c) else
                                f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells) + " |")
    if args.exclude_flagged:
        print("(attempts with a cheating signal left out)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="RL post-training of language models on agentic coding tasks, orchestrated by Dagster.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="run the whole asset graph on the embedded default",
        description="Build the bundled tasks, images and curriculum, train the embedded default model "
        "with asynchronous GRPO, evaluate every checkpoint and write the report, in the local Dagster instance.",
    )
    _add_home(demo)
    demo.add_argument("--run-name", default="demo", help="name of the RL run (default: demo)")
    demo.add_argument("--seed", type=int, default=0,
                      help="the trainer's seed, and so the RL task stream's (default: 0); the held-out tasks are "
                      "the same for every seed")
    demo.set_defaults(func=cmd_demo)

    ui = sub.add_parser("ui", help="start the Dagster UI and daemon on 127.0.0.1",
                        description="Start `dagster dev` (webserver and daemon) for the project's workspace on "
                        "127.0.0.1, the trajectory viewer beside it, and with --tensorboard TensorBoard over the runs' event files. Ctrl-C or SIGTERM "
                        "stops every process it started, their children included.")
    _add_home(ui)
    ui.add_argument("--port", type=int, default=3000, help="port of the UI (default: 3000)")
    ui.add_argument("--tensorboard", action="store_true",
                    help="also serve the runs' TensorBoard event files on 127.0.0.1")
    ui.add_argument("--tensorboard-port", type=int, default=6006, help="port of TensorBoard (default: 6006)")
    ui.add_argument("--viewer-port", type=int, default=VIEWER_PORT,
                    help=f"port of the trajectory viewer (rollouts, eval attempts; default: {VIEWER_PORT})")
    ui.add_argument("--grace", type=float, default=20.0,
                    help="seconds the processes get to stop on Ctrl-C or SIGTERM before they are killed (default: 20)")
    ui.set_defaults(func=cmd_ui)

    backfill = sub.add_parser(
        "backfill",
        help="re-run partitions of an asset as a Dagster backfill",
        description="Launch a partition backfill through the local Dagster instance; the daemon runs it.",
    )
    _add_home(backfill)
    backfill.add_argument("asset", help="asset key, e.g. deepswe_eval")
    which = backfill.add_mutually_exclusive_group(required=True)
    which.add_argument("--partitions", help="comma-separated partition keys, e.g. demo-step_000004,demo-step_000008")
    which.add_argument("--from", dest="start", help="first partition key of an inclusive range (needs --to)")
    backfill.add_argument("--to", dest="end", help="last partition key of the range")
    backfill.add_argument("--wait", action="store_true", help="wait until every run of the backfill has finished")
    backfill.add_argument("--timeout", type=float, default=3600.0, help="seconds --wait waits (default: 3600)")
    backfill.add_argument("--dataset", help="deepswe_eval: bundled, a task source or a Harbor dataset folder "
                          "(default: the runs' [eval] dataset)")
    backfill.add_argument("--run-file", help="deepswe_eval: a run file whose [eval] table the runs are evaluated "
                          "with (default: each run's own, as planned)")
    evals.cli.eval_options(backfill, EVAL_DEFAULTS)
    backfill.set_defaults(func=cmd_backfill)

    score = sub.add_parser(
        "score",
        help="pass@1, pass@k, target scores and partial per checkpoint from attempt rows",
        description="Score the attempt rows of deepswe_eval (Parquet files) per checkpoint: plain means over "
        "tasks of pass@1, pass@k (one column when k is 1), the target score (share of target tests passed), "
        "the strict target score (0 for an attempt that breaks an existing test) and the partial score; infra "
        "errors are left out, flagged attempts (a cheating signal) are counted and, with --exclude-flagged, "
        "left out too.",
    )
    score.add_argument("rows", nargs="+", help="attempt-row Parquet files, e.g. evals/deepswe/demo-step_000004/*.parquet (one file per eval run)")
    score.add_argument("--exclude-flagged", action="store_true", help="leave out attempts with a cheating signal")
    score.add_argument("--k", type=int, default=8, help="the k of pass@k (default: 8)")
    score.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    score.set_defaults(func=cmd_score)

    ev = sub.add_parser(
        "eval", help="evaluate a model (or the oracle/nop agents) on DeepSWE, a Harbor dataset or the bundled suite",
        description="With --model: register the model folder (and --adapter) as the checkpoint NAME-step_000000 "
        "of the local Dagster instance and run its deepswe_eval there, as the checkpoint sensor runs a run's "
        "(the UI shows it beside the runs' checkpoints; eval_report includes it). With --agent oracle or nop "
        "(or another --scaffold): run the agent on a Harbor dataset directly. Either way each attempt runs "
        "the task's verifier (DeepSWE v1.1's flow on a Harbor dataset), the scores are printed with and "
        "without each flawed list, and the exit status is 1 when any task asked for could not be built, run "
        "or graded (listed at the end with why), 2 on bad input.")
    ev.add_argument("dataset", help="a Harbor dataset folder (DeepSWE's tasks/, an export) or one task folder; "
                    "with --model also 'bundled' or another task source")
    evals.cli.eval_options(ev, EVAL_DEFAULTS)
    ev.add_argument("--verbose", action="store_true", help="list each task left out, with the reason; with --model, "
                    "Dagster's every event too (default: the eval's own progress lines)")
    ev.add_argument("--agent", default="model", choices=("oracle", "nop", "model"), help="who attempts the tasks")
    ev.add_argument("--model", help="a Hugging Face model folder to evaluate")
    ev.add_argument("--adapter", help="a peft adapter folder to load on --model")
    ev.add_argument("--name", help="the registered model's name, its checkpoint NAME-step_000000 "
                    "(default: the model folder's name, with the adapter folder's)")
    ev.add_argument("--run-file", help="a run file whose [eval] table gives the settings the options do not")
    _add_home(ev)
    ev.add_argument("--scaffold", default="builtin", help="the model's agent scaffold (default: builtin); another "
                    "runs directly, without registering the model")
    ev.add_argument("--checkpoint", help="name of the evaluated checkpoint in the rows (direct runs)")
    ev.add_argument("--action-format", default="json", choices=("json", "compact"),
                    help="the builtin scaffold's tool-call format in direct runs (default: json; compact is the "
                    "bundled suite's)")
    ev.add_argument("--out", help="write the attempt rows to this Parquet file")
    ev.add_argument("--record", help="folder for each attempt's posttrain-grade.json beside the task's reward.json "
                    "(direct runs; a registered model's are under evals/harbor/)")
    ev.add_argument("--json", action="store_true", help="print rows and views as one JSON object")
    ev.set_defaults(func=cmd_eval)

    for module in DOMAIN_CLIS:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
