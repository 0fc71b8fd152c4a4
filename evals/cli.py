"""``posttrain`` commands of the evals package.

- ``posttrain tasks inspect PATH [--json]``: load a task source (a Harbor/DeepSWE folder, a SWE-bench
  ``.jsonl``/``.parquet``, a built suite folder, or the word ``bundled``) and print its summary.
- ``posttrain tasks build OUT [--workers N]``: generate the bundled suite into ``OUT`` and validate
  every task by running its tests.
- ``posttrain tasks export-harbor bundled OUT [--tasks ID,...]``: write the bundled suite (or a built
  suite folder) as Harbor tasks under ``OUT/tasks/`` with their repositories as ``OUT/repos/*.bundle``.
- ``posttrain tasks envcheck DATASET --sources DIR``: oracle and nop on every buildable Harbor task;
  writes the environment-flawed list to ``$POSTTRAIN_HOME/datasets/environment-flawed/`` (the entries
  of the tasks checked are replaced, the others kept: checks task by task add up).
- ``posttrain tasks sources DATASET --sources DIR``: the repositories (and submodules) each Harbor
  task's image is built from, at their commits, and which the sources folder lacks: what to fetch.
- ``posttrain tasks flawed-lists LISTS_JSON``: install published flawed lists into
  ``$POSTTRAIN_HOME/datasets/flawed/``.
- ``posttrain grade --config tests/config.json --report R1 [--report R2 ...] [--json]``: score test
  reports against a Harbor task config with DeepSWE v1.1's semantics (a missing or malformed report
  counts its tests as failed, with a warning).
- ``posttrain eval DATASET --sources DIR --agent oracle|nop`` (or ``--model HF_DIR --scaffold NAME``):
  :func:`run_agents`, an agent on a Harbor dataset through DeepSWE v1.1's verifier flow, scores with
  and without each flawed list of ``$POSTTRAIN_HOME/datasets/flawed/``. The command itself, and its
  ``--model`` form that registers the model in the Dagster instance, is the platform's
  (``dagster_project/cli.py``); the options that set ``[eval]`` keys are :func:`eval_options`.

Bad input exits with status 2 and a message naming the file or key; a task asked for that could not
be built, run or graded makes the status 1, and the closing list names each with why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from evals.flawed import FlawedListError, flawed_views, install_published_lists, load_flawed_lists, views_markdown
from evals.tasks import TaskLoadError, harbor_build_problem, load_bundled, load_harbor, load_tasks, summarize
from sandboxes.harbor import RecipeError, needed_sources, parse_dockerfile
from sandboxes.home import default_home
from sandboxes.runtimes import default_store


def cmd_tasks_inspect(args: argparse.Namespace) -> int:
    try:
        if args.path == "bundled":  # the generated suite, built on first use
            from evals.bundled import ensure_suite  # heavy: numpy; only the generated suite needs it

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
    from evals.bundled import SuiteBuildError, build_suite  # heavy: numpy; only this command needs it

    try:
        summary = build_suite(args.out, workers=args.workers)
    except SuiteBuildError as exc:
        print(f"posttrain tasks build: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


def cmd_grade(args: argparse.Namespace) -> int:
    from evals.grading import ReportError, grade_reports  # heavy: numpy; only this command needs it

    notes: list[str] = []
    try:
        scores = grade_reports(args.config, args.report, notes)
    except ReportError as exc:
        print(f"posttrain grade: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"posttrain grade: warning: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(scores.to_dict()))
    else:
        for key, value in scores.to_dict().items():
            print(f"{key:20s} {value}")
    return 0


def _selected(tasks, wanted: str | None):
    if not wanted:
        return list(tasks)
    ids = [w.strip() for w in wanted.split(",") if w.strip()]
    by_id = {t.id: t for t in tasks}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise ValueError(f"--tasks: no task {unknown[0]!r} in the dataset (or it cannot be built)")
    return [by_id[i] for i in ids]


def cmd_tasks_export_harbor(args: argparse.Namespace) -> int:
    from evals.harbor import export_harbor  # heavy: numpy and the HTTP layer (uvicorn); only this command needs them

    try:
        if args.source == "bundled":
            from evals.bundled import ensure_suite  # heavy: numpy; only the generated suite needs it

            task_set = load_bundled(ensure_suite())
        else:
            task_set = load_bundled(args.source)
        tasks = _selected(task_set.tasks, args.tasks)
        summary = export_harbor(tasks, args.out)
    except (TaskLoadError, ValueError, OSError) as exc:
        print(f"posttrain tasks export-harbor: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def _harbor_tasks(command: str, dataset: str, sources: str, wanted: list[str], *, network: bool, verbose: bool):
    """The Harbor tasks of the command, their images built (or found), and what could not be had:
    ``(tasks, store, builds, problems)`` with ``problems`` a ``{task id: why}`` of the tasks asked
    for (``wanted``) that cannot be loaded or built. Without ``wanted`` the dataset's tasks that
    cannot be built from the sources are summed up in one line (``verbose``: one line each)."""
    from evals.harbor import build_task_image  # heavy: numpy and the HTTP layer (uvicorn); only the Harbor commands need them

    task_set = load_harbor(dataset, sources=sources)
    incomplete = {item.id: item.reason for item in task_set.incomplete}
    problems: dict[str, str] = {}
    if wanted:
        known = {t.id for t in task_set.tasks} | set(incomplete)
        unknown = [i for i in wanted if i not in known]
        if unknown:
            raise ValueError(f"--tasks: {', '.join(unknown)}: no such task in {dataset}")
        problems = {i: incomplete[i] for i in wanted if i in incomplete}
        by_id = {t.id: t for t in task_set.tasks}
        tasks = [by_id[i] for i in wanted if i in by_id]
        for task_id, why in problems.items():
            print(f"posttrain {command}: cannot build {task_id}: {why}", file=sys.stderr)
    else:
        tasks = list(task_set.tasks)
        print_left_out(command, task_set, sources, verbose)
    store = default_store()
    built, builds = [], {}
    for task in tasks:
        try:
            b = build_task_image(task, sources, store, network=network)
        except Exception as exc:  # noqa: BLE001 - any build failure is that task's problem, with its reason
            problems[task.id] = f"its image was not built: {exc}"  # whole; it names the Dockerfile and step
            print(f"posttrain {command}: cannot build {task.id}: {exc}", file=sys.stderr)
            continue
        print(f"posttrain {command}: image of {task.id}: {b.image.size_bytes / 1e6:.1f} MB, "
              f"{'cached' if b.cached else f'built in {b.build_s:.1f} s'}", file=sys.stderr)
        built.append(task)
        builds[task.id] = b
    return built, store, builds, problems


def print_left_out(command: str, task_set, sources: str, verbose: bool) -> None:
    """One line for the tasks of a dataset that cannot be built from ``sources`` (``verbose``: one
    line each, with why): a dataset evaluated whole leaves them out, the command does not fail."""
    if not task_set.incomplete:
        return
    total = len(task_set.tasks) + len(task_set.incomplete)
    print(f"posttrain {command}: {len(task_set.incomplete)} of {total} tasks cannot be built from {sources} and are "
          "left out" + ("" if verbose else " (--verbose lists them)"), file=sys.stderr)
    if verbose:
        for item in task_set.incomplete:
            print(f"posttrain {command}: left out {item.id}: {item.reason}", file=sys.stderr)


def closing_problems(rows, problems: dict[str, str]) -> dict[str, str]:
    """Every task of a command that could not be built, run or graded, with why: ``problems`` (not
    loaded or built) and each task with an ``infra_error`` attempt (its first detail)."""
    out = dict(problems)
    for row in rows:
        if row["status"] == "infra_error" and row["task_id"] not in out:
            lost = sum(r["task_id"] == row["task_id"] and r["status"] == "infra_error" for r in rows)
            tried = sum(r["task_id"] == row["task_id"] for r in rows)
            out[row["task_id"]] = f"{lost} of {tried} attempts not run or graded: {row.get('detail') or 'no detail'}"
    return out


def print_closing_problems(command: str, problems: dict[str, str], tasks: int) -> int:
    """Print the closing list of :func:`closing_problems`; the exit status: 1 when there is any, else 0."""
    if not problems:
        return 0
    print(f"posttrain {command}: {len(problems)} of {tasks} tasks could not be built, run or graded:", file=sys.stderr)
    for task_id, why in problems.items():
        print(f"  {task_id}: {why}", file=sys.stderr)  # whole: a cut message loses the line that says why
    return 1


def cmd_tasks_envcheck(args: argparse.Namespace) -> int:
    # heavy: numpy and the HTTP layer (uvicorn); only the Harbor commands need them
    from evals.harbor import environment_check, harbor_sandbox_factory, write_environment_flawed

    try:
        wanted = [w.strip() for w in (args.tasks or "").split(",") if w.strip()]
        tasks, store, builds, problems = _harbor_tasks("tasks envcheck", args.dataset, args.sources, wanted,
                                                       network=not args.offline, verbose=args.verbose)
    except (TaskLoadError, ValueError, OSError) as exc:
        print(f"posttrain tasks envcheck: {exc}", file=sys.stderr)
        return 2
    flaws, rows = environment_check(tasks, harbor_sandbox_factory(store, runtime=args.runtime), workers=args.workers,
                                    log=lambda m: print(m, file=sys.stderr), home=default_home(),
                                    image_keys={i: b.key for i, b in builds.items()})
    try:
        path = write_environment_flawed(flaws, default_home(), args.name or Path(args.dataset).resolve().name,
                                        checked=[t.id for t in tasks])
    except ValueError as exc:
        print(f"posttrain tasks envcheck: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"tasks": len(rows), "flawed": sorted({f.id for f in flaws}), "list": str(path), "rows": rows}))
    lost = {r["task_id"]: "the oracle's or the nop's verification was lost to the infrastructure"
            for r in rows if r["oracle_reward"] is None or r["nop_reward"] is None}
    return print_closing_problems("tasks envcheck", {**problems, **lost}, len(tasks) + len(problems))


def cmd_tasks_sources(args: argparse.Namespace) -> int:
    """What to fetch before a Harbor dataset's images can be built: each task's repository and its
    submodules' at the commits the base records, and what ``--sources`` holds of them. A task whose
    sources are all there but whose build is refused anyway (no verifier files, a recipe the builder
    does not take, a task folder that does not load) is listed with why, never as ready. The closing
    line counts repositories (a repository several tasks share once) and tasks."""
    try:
        task_set = load_harbor(args.dataset)
        wanted = [w.strip() for w in (args.tasks or "").split(",") if w.strip()]
        if wanted:
            incomplete = {t.id: t for t in task_set.incomplete}
            tasks = _selected(task_set.tasks, ",".join(w for w in wanted if w not in incomplete))
            broken = [incomplete[w] for w in wanted if w in incomplete]
        else:
            tasks, broken = list(task_set.tasks), list(task_set.incomplete)
    except (TaskLoadError, ValueError, OSError) as exc:
        print(f"posttrain tasks sources: {exc}", file=sys.stderr)
        return 2
    rows = [{"task_id": t.id, "repository": "", "path": "", "commit": "", "source": "",
             "status": f"not loadable: {t.reason} ({t.path})"} for t in broken]
    for task in tasks:
        if not task.metadata.get("environment"):
            rows.append({"task_id": task.id, "repository": "", "path": "", "commit": "", "source": "",
                         "status": f"no recipe to read: no environment/Dockerfile in {task.metadata.get('task_dir')}"})
            continue
        try:
            recipe = parse_dockerfile(task.metadata["environment"])
            needed = needed_sources(recipe.clone_url, task.base_commit or recipe.args.get("BASE_SHA", ""), args.sources)
        except (RecipeError, KeyError) as exc:
            rows.append({"task_id": task.id, "repository": "", "path": "", "commit": "", "source": "",
                         "status": f"no recipe to read: {exc}"})
            continue
        refused = harbor_build_problem(task, args.sources) if all(n.ready for n in needed) else ""
        for n in needed:
            status = ("ready" if not refused else f"fetched, but the build refuses the task: {refused}") if n.ready \
                else "commit missing from the source" if n.source else "not fetched"
            rows.append({"task_id": task.id, "repository": n.url, "path": n.path or ".", "commit": n.commit,
                         "source": n.source, "status": status})
    repositories = {r["repository"] for r in rows if r["repository"]}
    missing_repos = {r["repository"] for r in rows if r["repository"] and r["status"] not in ("ready",)
                     and not r["status"].startswith("fetched, ")}
    task_ids = {r["task_id"] for r in rows}
    not_ready = {r["task_id"] for r in rows if r["status"] != "ready"}
    if args.json:
        print(json.dumps({"rows": rows, "missing": len(missing_repos), "repositories": len(repositories),
                          "tasks": len(task_ids), "tasks_not_ready": sorted(not_ready)}))
    else:
        print("| task | repository | path | commit | status |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['task_id']} | {r['repository']} | {r['path']} | {r['commit'][:12]} | {r['status']} |")
    print(f"posttrain tasks sources: {len(missing_repos)} of {len(repositories)} repositories not ready under "
          f"{args.sources}; {len(not_ready)} of {len(task_ids)} tasks cannot be built yet", file=sys.stderr)
    return 1 if not_ready else 0


def cmd_tasks_flawed_lists(args: argparse.Namespace) -> int:
    try:
        written = install_published_lists(args.lists, default_home())
    except FlawedListError as exc:
        print(f"posttrain tasks flawed-lists: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"lists": [str(p) for p in written]}))
    return 0


def run_agents(args: argparse.Namespace, settings) -> int:
    """``posttrain eval`` without registering a model: ``--agent oracle`` or ``nop``, or a model
    under another ``--scaffold``, on a Harbor dataset, each attempt through the task's verifier.
    ``settings`` is the validated ``[eval]`` table (``evals.settings.EvalSection``); the
    oracle and nop agents make 1 attempt unless ``--attempts`` says otherwise. Returns the exit
    status: 1 when a task asked for could not be built, run or graded (listed with why), 2 on bad input."""
    # heavy: numpy and the HTTP layer (uvicorn); only this command needs them
    from evals.evaluate import served_model, write_rows
    from evals.harbor import check_environments, evaluate_harbor, harbor_sandbox_factory, with_environment_records
    from evals.harness import HttpClient, episode_context

    if args.agent == "model" and not args.model:
        print("posttrain eval: --agent model needs --model (a Hugging Face model folder)", file=sys.stderr)
        return 2
    if not settings.sources:
        print(f"posttrain eval: {args.dataset}: a Harbor dataset needs --sources (the folder of repository sources "
              "its images are built from)", file=sys.stderr)
        return 2
    attempts = settings.attempts if args.attempts is not None or args.agent == "model" else 1
    try:  # read before the attempts run, so that a bad list file stops the command at once
        flawed_lists = load_flawed_lists(default_home() / "datasets" / "flawed")
    except (FlawedListError, OSError, ValueError) as exc:
        print(f"posttrain eval: {exc}", file=sys.stderr)
        return 2
    try:
        tasks, store, builds, problems = _harbor_tasks("eval", args.dataset, settings.sources, list(settings.task_ids),
                                                       network=settings.network, verbose=args.verbose)
        factory = harbor_sandbox_factory(store, runtime=settings.sandbox_runtime)
        # strict credit spares the existing tests the reference solution fails here, where recorded
        records = check_environments(tasks, factory, default_home(), {i: b.key for i, b in builds.items()},
                                     run_missing=False)
    except (TaskLoadError, ValueError, OSError) as exc:
        print(f"posttrain eval: {exc}", file=sys.stderr)
        return 2
    tasks = with_environment_records(tasks, records)
    log = (lambda m: print(m, file=sys.stderr))
    served = contextlib.nullcontext(None)
    if args.agent == "model":
        # A replica process (vLLM unless POSTTRAIN_ENGINE says otherwise); a chat scaffold's tool
        # calls are parsed by the engine.
        parser_settings = {"tool_call_parser": "hermes"} if args.scaffold != "builtin" else {}
        served = served_model(args.model, what="posttrain eval", **parser_settings)
    with served as model:
        kwargs = {}
        if model is not None:
            url, tokenizer, eos_ids = model
            log(f"posttrain eval: {args.model} served on {url}")
            kwargs = dict(model=HttpClient(url), tokenizer=tokenizer, model_url=url, max_turns=settings.max_turns,
                          max_new_tokens=settings.max_new_tokens)
            if args.scaffold == "builtin":  # the built-in loop's own settings
                kwargs.update(stop_token_ids=eos_ids, action_format=args.action_format, temperature=settings.temperature,
                              seed=settings.seed, **episode_context(args.model))
        rows = evaluate_harbor(tasks, factory, agent=args.agent, attempts=attempts, workers=settings.workers,
                               scaffold=args.scaffold, record_dir=args.record, checkpoint=args.checkpoint or args.agent,
                               log=log, **kwargs) if tasks else []
    if args.out:
        write_rows(rows, args.out)
    views = flawed_views(rows, flawed_lists, k=attempts)
    if args.json:
        print(json.dumps({"rows": rows, "views": views}, default=str))
    else:
        print(views_markdown(views))
    return print_closing_problems("eval", closing_problems(rows, problems), len(tasks) + len(problems))


# command-line option -> the [eval] key it sets (evals.settings.EvalSection); every default
# is the [eval] table's (a run file's with --run-file, else the schema's)
EVAL_OPTIONS = {"sources": "sources", "tasks": "task_ids", "split": "split", "attempts": "attempts",
                "max_turns": "max_turns", "max_new_tokens": "max_new_tokens", "temperature": "temperature",
                "seed": "seed", "workers": "workers", "runtime": "sandbox_runtime"}


def eval_options(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """The options that set keys of an ``[eval]`` table (``posttrain eval``, ``posttrain backfill``);
    one left out keeps the table's value. ``defaults``: the ``[eval]`` defaults, for the help."""
    def default(option: str) -> str:
        return f" (default: {defaults[EVAL_OPTIONS[option]]!r})"

    parser.add_argument("--sources", help="folder of repository sources a Harbor dataset is built from "
                        "(git folders or bundles, e.g. fetched mirrors)")
    parser.add_argument("--tasks", help="comma-separated task ids (default: every buildable task of the split)")
    parser.add_argument("--split", help="eval (held out), train, or all" + default("split"))
    parser.add_argument("--attempts", type=int, help="attempts per task" + default("attempts")
                        + "; the oracle and nop agents make 1")
    parser.add_argument("--max-turns", type=int, help="model turns per attempt" + default("max_turns"))
    parser.add_argument("--max-new-tokens", type=int, help="tokens per model turn" + default("max_new_tokens"))
    parser.add_argument("--temperature", type=float, help="sampling temperature" + default("temperature"))
    parser.add_argument("--seed", type=int, help="sampling seed" + default("seed"))
    parser.add_argument("--workers", type=int, help="attempts run at once" + default("workers"))
    parser.add_argument("--runtime", choices=("bwrap", "gvisor"), help="sandbox runtime" + default("runtime"))
    parser.add_argument("--offline", action="store_true", help="build images without network (no dependency installs)")
    parser.add_argument("--no-environment-check", action="store_true",
                        help="do not run a Harbor task's reference solution first (strict credit then counts "
                        "every existing test, also those the environment breaks)")


def eval_table(args: argparse.Namespace) -> dict:
    """The ``[eval]`` keys the options of :func:`eval_options` set (those given only)."""
    table: dict = {}
    for option, key in EVAL_OPTIONS.items():
        value = getattr(args, option, None)
        if value is not None:
            table[key] = [t.strip() for t in value.split(",") if t.strip()] if option == "tasks" else value
    if getattr(args, "offline", False):
        table["network"] = False
    if getattr(args, "no_environment_check", False):
        table["environment_check"] = False
    return table


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
    build.add_argument("--workers", type=int, default=0,
                       help="tasks written and validated at once (default: 0, four per core, at most 32)")
    build.set_defaults(func=cmd_tasks_build)

    export = tasks_sub.add_parser("export-harbor", help="write the bundled suite as Harbor tasks",
                                  description="Write the bundled suite (or a built suite folder) as Harbor tasks "
                                  "(task.toml, environment/Dockerfile, tests/test.sh, tests/test.patch, "
                                  "tests/config.json, solution/) with their repositories as OUT/repos/*.bundle.")
    export.add_argument("source", help="'bundled' or a built suite folder")
    export.add_argument("out", help="output folder")
    export.add_argument("--tasks", help="comma-separated task ids (default: all)")
    export.set_defaults(func=cmd_tasks_export_harbor)

    def harbor_args(p):
        p.add_argument("dataset", help="a Harbor dataset folder (with tasks/) or one task folder")
        p.add_argument("--sources", required=True, help="folder of repository sources (git folders or bundles)")
        p.add_argument("--tasks", help="comma-separated task ids (default: every buildable task)")
        p.add_argument("--runtime", default="bwrap", choices=("bwrap", "gvisor"), help="sandbox runtime")
        p.add_argument("--workers", type=int, default=1, help="attempts run at once (default: 1)")
        p.add_argument("--offline", action="store_true", help="build images without network (no dependency installs)")
        p.add_argument("--verbose", action="store_true", help="list each task left out, with the reason")

    envcheck = tasks_sub.add_parser("envcheck", help="run oracle and nop on a Harbor dataset",
                                    description="Oracle and nop agents on every buildable task: list the tasks "
                                    "whose oracle fails or whose nop passes, with the tests that show it.")
    harbor_args(envcheck)
    envcheck.add_argument("--name", help="name of the environment-flawed list (default: the dataset folder's name)")
    envcheck.set_defaults(func=cmd_tasks_envcheck)
    sources = tasks_sub.add_parser("sources", help="list the repositories a Harbor dataset's images are built from",
                                   description="For each task, its repository and every submodule's at the commit "
                                   "the base records, and whether the --sources folder holds it: what to fetch "
                                   "before the images can be built. Exit 1 when anything is missing.")
    sources.add_argument("dataset", help="a Harbor dataset folder (with tasks/) or one task folder")
    sources.add_argument("--sources", required=True, help="folder of repository sources (git folders or bundles)")
    sources.add_argument("--tasks", help="comma-separated task ids (default: every task)")
    sources.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    sources.set_defaults(func=cmd_tasks_sources)
    flawed = tasks_sub.add_parser("flawed-lists", help="install published flawed-task lists",
                                  description="Install the lists of a published lists.json into $POSTTRAIN_HOME/datasets/flawed/.")
    flawed.add_argument("lists", help="the lists.json file")
    flawed.set_defaults(func=cmd_tasks_flawed_lists)

    grade = sub.add_parser("grade", help="score test reports against a Harbor task config",
                           description="Score JUnit XML or CTRF JSON reports against tests/config.json "
                           "(DeepSWE v1.1 semantics: worst status across reports; missing or skipped counts failed).")
    grade.add_argument("--config", required=True, help="the task's tests/config.json")
    grade.add_argument("--report", action="append", required=True, help="a report file; repeat for several, in order")
    grade.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    grade.set_defaults(func=cmd_grade)
