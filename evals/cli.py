"""``posttrain`` commands of the evals package.

- ``posttrain tasks inspect PATH [--json]``: load a task source (a Harbor/DeepSWE folder, a SWE-bench
  ``.jsonl``/``.parquet``, a built suite folder, or the word ``bundled``) and print its summary.
- ``posttrain tasks build OUT [--workers N]``: generate the bundled suite into ``OUT`` and validate
  every task by running its tests.
- ``posttrain grade --config tests/config.json --report R1 [--report R2 ...] [--json]``: score test
  reports against a Harbor task config with DeepSWE v1.1's semantics.

Bad input exits with status 2 and a message naming the file or key.
"""

from __future__ import annotations

import argparse
import json
import sys


def cmd_tasks_inspect(args: argparse.Namespace) -> int:
    from evals.tasks import TaskLoadError, load_bundled, load_tasks, summarize

    try:
        if args.path == "bundled":  # the generated suite, built on first use
            from evals.bundled import ensure_suite

            task_set = load_bundled(ensure_suite())
        else:
            task_set = load_tasks(args.path)
        summary = summarize(task_set)
    except (TaskLoadError, OSError) as exc:
        print(f"posttrain tasks inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{summary['tasks']} tasks, {len(summary['incomplete'])} incomplete")
    for lang, n in summary["by_language"].items():
        print(f"  {lang:12s} {n}")
    print(f"median target tests {summary['median_target_tests']:g}, existing tests {summary['median_existing_tests']:g}")
    for task in task_set.incomplete:
        print(f"  incomplete: {task.id}: {task.reason}")
    return 0


def cmd_tasks_build(args: argparse.Namespace) -> int:
    from evals.bundled import SuiteBuildError, build_suite

    try:
        summary = build_suite(args.out, workers=args.workers)
    except SuiteBuildError as exc:
        print(f"posttrain tasks build: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


def cmd_grade(args: argparse.Namespace) -> int:
    from evals.grading import ReportError, grade_reports

    try:
        scores = grade_reports(args.config, args.report)
    except ReportError as exc:
        print(f"posttrain grade: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(scores.to_dict()))
    else:
        for key, value in scores.to_dict().items():
            print(f"{key:20s} {value}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this package's commands to the ``posttrain`` parser."""
    tasks = sub.add_parser("tasks", help="inspect and build task datasets",
                           description="Load task sources into one schema, or build the bundled suite.")
    tasks_sub = tasks.add_subparsers(dest="tasks_command", required=True, metavar="ACTION")
    inspect = tasks_sub.add_parser("inspect", help="print a summary of a task source",
                                   description="Summarize a Harbor/DeepSWE folder, a SWE-bench .jsonl/.parquet, "
                                   "a built suite folder, or 'bundled'.")
    inspect.add_argument("path", help="folder, file, or the word 'bundled'")
    inspect.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    inspect.set_defaults(func=cmd_tasks_inspect)
    build = tasks_sub.add_parser("build", help="generate and validate the bundled suite",
                                 description="Generate the bundled suite into OUT and validate every task by running its tests.")
    build.add_argument("out", help="output folder")
    build.add_argument("--workers", type=int, default=2, help="tasks validated in parallel (default: 2)")
    build.set_defaults(func=cmd_tasks_build)

    grade = sub.add_parser("grade", help="score test reports against a Harbor task config",
                           description="Score JUnit XML or CTRF JSON reports against tests/config.json "
                           "(DeepSWE v1.1 semantics: worst status across reports; missing or skipped counts failed).")
    grade.add_argument("--config", required=True, help="the task's tests/config.json")
    grade.add_argument("--report", action="append", required=True, help="a report file; repeat for several, in order")
    grade.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    grade.set_defaults(func=cmd_grade)
