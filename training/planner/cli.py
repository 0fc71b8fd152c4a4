"""``posttrain plan | validate | run``: the run planner's commands.

    posttrain plan examples/embedded.toml            # plan JSON on stdout, tips box on stderr
    posttrain validate examples/olmo35-b300.toml     # exit 0 if it plans and fits, 1 if not
    posttrain run examples/embedded.toml             # write resolved-plan.json, start the trainer here
    posttrain run RUN.toml --target k8s --dry-run    # print every manifest, validated offline
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from training.planner import k8s
from training.planner.resolve import Plan, resolve
from training.planner.runner import (
    RunStartError, apply_k8s, default_run_dir, is_plan, kube_api_client, start_local, wait_fleet, write_resolved_plan,
)
from training.planner.schema import PlanError, run_file_reference

BOX_WIDTH = 96

# Exit statuses: 1 the plan is unsound (does not fit, invalid manifests), 2 the file is invalid,
# 3 the run cannot start.
EXIT_UNSOUND, EXIT_INVALID, EXIT_NOT_STARTED = 1, 2, 3


def tips_box(plan: Plan) -> str:
    """The "Configuration tips" box: warnings first, then tips, each with its code."""
    inner = BOX_WIDTH - 4
    lines: list[str] = []
    entries = [("warning", w) for w in plan.warnings] + [("tip", t) for t in plan.tips]
    if not entries:
        entries_text = ["no advice: every knob is set or sized, and nothing looks off"]
    else:
        entries_text = [f"{kind} [{a.code}] {a.message}" for kind, a in entries]
    for text in entries_text:
        wrapped = textwrap.wrap(text, inner, subsequent_indent="  ")
        lines.extend(wrapped)
    title = " Configuration tips "
    top = "┌─" + title + "─" * (BOX_WIDTH - 3 - len(title)) + "┐"
    body = [f"│ {line.ljust(inner)} │" for line in lines]
    bottom = "└" + "─" * (BOX_WIDTH - 2) + "┘"
    return "\n".join([top, *body, bottom])


def _summary(plan: Plan) -> str:
    m, c = plan.memory, plan.async_capacity
    fit = {True: "fits", False: "DOES NOT FIT", None: "fit not computed"}[m["fits"]]
    total = "?" if m["total_gib"] is None else f"{m['total_gib']:.2f}"
    budget = "?" if m["budget_gib"] is None else f"{m['budget_gib']:.2f}"
    return (
        f"{plan.run_file.source}: profile {plan.profile}; R = {plan.admission} per engine x "
        f"{c['engines']} engines; {total} GiB of {budget} GiB per engine ({fit}, lower bound); "
        f"producer budget {c['producer_budget_samples']} samples"
    )


def _load(path: str) -> Plan | None:
    try:
        return resolve(path)
    except PlanError as exc:
        print(str(exc), file=sys.stderr)
        return None


def cmd_plan(args: argparse.Namespace) -> int:
    plan = _load(args.run_file)
    if plan is None:
        return EXIT_INVALID
    sys.stdout.write(plan.to_json_text())
    sys.stdout.flush()
    print(tips_box(plan), file=sys.stderr)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    plan = _load(args.run_file)
    if plan is None:
        return EXIT_INVALID
    print(tips_box(plan), file=sys.stderr)
    print(_summary(plan))
    if plan.memory["fits"] is False:
        print(f"{args.run_file}: invalid: the engine's memory pools do not fit (see the warning above)", file=sys.stderr)
        return EXIT_UNSOUND
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    plan = _load(args.run_file)
    if plan is None:
        return EXIT_INVALID
    print(tips_box(plan), file=sys.stderr)
    if plan.memory["fits"] is False:
        print(f"{args.run_file}: not started: the engine's memory pools do not fit", file=sys.stderr)
        return EXIT_UNSOUND
    if args.target == "k8s":
        return _run_k8s(plan, args)
    if args.dry_run:
        print(_summary(plan))
        print(f"dry run: would write {default_run_dir(plan, args.home) if not args.run_dir else args.run_dir}"
              "/resolved-plan.json and start the trainer here")
        return 0
    run_dir = Path(args.run_dir).resolve() if args.run_dir else default_run_dir(plan, args.home)
    try:
        plan_path = write_resolved_plan(plan, run_dir, replace=args.replace_plan)
        print(f"wrote {plan_path}", flush=True)
        return start_local(plan_path, run_dir, plan.run_file.trainer.gpus)
    except RunStartError as exc:
        print(f"posttrain run: {exc}", file=sys.stderr)
        return EXIT_NOT_STARTED


def _run_k8s(plan: Plan, args: argparse.Namespace) -> int:
    manifests = k8s.build_manifests(plan)
    version = k8s.kubernetes_schema_version(args.kubernetes_version)
    problems = k8s.validate_manifests(manifests, version)
    if args.dry_run:
        import yaml  # PyYAML comes with dagster; only the dry run's printing needs it

        sys.stdout.write(yaml.safe_dump_all(manifests, sort_keys=False))
    for problem in problems:
        print(f"invalid manifest: {problem}", file=sys.stderr)
    if problems:
        return EXIT_UNSOUND
    missing = k8s.missing_entry_points()
    if missing:
        print("note: this checkout has no entry point for " + ", ".join(f"python -m {m}" for m in missing)
              + "; the image must provide it before these pods can run", file=sys.stderr)  # fmt: skip
    print(f"{len(manifests)} manifests valid against the Kubernetes {version} schemas (strict): "
          + ", ".join(f"{m['kind']}/{m['metadata']['name']}" for m in manifests), file=sys.stderr)  # fmt: skip
    if args.dry_run:
        _print_server_side_dry_run(manifests, args.kubeconfig)
        return 0
    run_dir = Path(args.run_dir).resolve() if args.run_dir else default_run_dir(plan, args.home)
    try:
        plan_path = write_resolved_plan(plan, run_dir, replace=args.replace_plan)
    except RunStartError as exc:
        print(f"posttrain run: {exc}", file=sys.stderr)
        return EXIT_NOT_STARTED
    print(f"wrote {plan_path} (the pods read the same plan from ConfigMap {next(m for m in manifests if is_plan(m))['metadata']['name']})")
    # the fleet first, the trainer Job once the engines, router and pool are ready (as rl_run does)
    fleet, job = manifests[:-1], manifests[-1]
    try:
        for what in apply_k8s(fleet, args.kubeconfig):
            print(what, flush=True)
        if args.no_wait:
            print("not waiting for the fleet (--no-wait): the trainer starts now", file=sys.stderr)
        else:
            wait_fleet(fleet, kube_api_client(args.kubeconfig), timeout_s=args.fleet_timeout,
                       log=lambda line: print(line, file=sys.stderr, flush=True))
        for what in apply_k8s([next(m for m in fleet if is_plan(m)), job], args.kubeconfig)[1:]:
            print(what)
    except RunStartError as exc:
        print(f"posttrain run: {exc}", file=sys.stderr)
        return EXIT_NOT_STARTED
    return 0


def _print_server_side_dry_run(manifests: list[dict], kubeconfig: str | None) -> None:
    """Where a cluster is reachable, ask its API server what applying the manifests would change
    (a server-side dry run, nothing kept); offline, say so: the manifests above are all there is."""
    try:
        results = apply_k8s(manifests, kubeconfig, dry_run=True)
    except RunStartError as exc:
        print(f"no cluster to compare with ({exc}); the manifests above are what a run would apply", file=sys.stderr)
        return
    except Exception as exc:  # an unreachable API server surfaces as the client library's own errors
        print(f"the cluster could not be asked what would change ({type(exc).__name__}: {exc}); "
              "the manifests above are what a run would apply", file=sys.stderr)
        return
    print("server-side dry run against the cluster:", file=sys.stderr)
    for what in results:
        print(f"  {what}", file=sys.stderr)


def cmd_keys(args: argparse.Namespace) -> int:
    """Print the run file's key reference (``docs/run-file.md``), written from the sections' declarations."""
    print(run_file_reference(), end="")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``plan``, ``validate``, ``run`` and ``keys`` to the ``posttrain`` parser."""
    plan = sub.add_parser(
        "plan",
        help="resolve a run file to a plan (JSON on stdout, tips on stderr)",
        description="Resolve RUN.toml: every inference knob, the memory fit, the async capacity, with "
        "advice in a 'Configuration tips' box on stderr. Exit 2 when the file is invalid.",
    )
    plan.add_argument("run_file", metavar="RUN.toml")
    plan.set_defaults(func=cmd_plan)

    validate = sub.add_parser(
        "validate",
        help="check a run file: exit 0 if it plans and fits",
        description="Validate RUN.toml: exit 2 naming the keys when the file is invalid (unknown key, "
        "wrong type, non-positive limit, conflicting or foreign preset), 1 when the engine's memory "
        "pools do not fit, 0 otherwise.",
    )
    validate.add_argument("run_file", metavar="RUN.toml")
    validate.set_defaults(func=cmd_validate)

    run = sub.add_parser(
        "run",
        help="write resolved-plan.json and start the run, locally or on Kubernetes",
        description="Plan RUN.toml, write resolved-plan.json into the run directory and start the run: "
        "the trainer here (local), or every workload as Kubernetes objects (--target k8s).",
    )
    run.add_argument("run_file", metavar="RUN.toml")
    run.add_argument("--target", choices=("local", "k8s"), default="local", help="where to run (default: local)")
    run.add_argument("--dry-run", action="store_true",
                     help="start nothing; with --target k8s print every manifest, validated against the schemas")
    run.add_argument("--home", help="root of runs (default: $POSTTRAIN_HOME, else ./posttrain-data)")
    run.add_argument("--run-dir", help="run directory (default: [run] dir, else HOME/runs/NAME)")
    run.add_argument("--replace-plan", action="store_true",
                     help="overwrite a different resolved-plan.json already in the run directory")
    run.add_argument("--kubernetes-version", help="schema version to validate against (default: the newest bundled)")
    run.add_argument("--kubeconfig", help="kubeconfig file for --target k8s (default: in-cluster, else ~/.kube/config)")
    run.add_argument("--no-wait", action="store_true",
                     help="with --target k8s, apply the trainer Job at once instead of after the fleet is ready")
    run.add_argument("--fleet-timeout", type=float, default=3600.0, metavar="SECONDS",
                     help="with --target k8s, how long to wait for the engines, router and pool (default: 3600)")
    run.set_defaults(func=cmd_run)

    keys = sub.add_parser(
        "keys", help="print every run-file key: its type, default, allowed values and meaning (Markdown)",
        description="Print the run file's key reference, every section, from the declarations the planner "
        "validates with (what docs/run-file.md holds).")
    keys.set_defaults(func=cmd_keys)
