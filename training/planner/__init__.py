"""The run planner: a run TOML file resolved to a plan before any GPU hour is spent.

One TOML file describes a run (``[run]``, ``[model]``, ``[inference]``, ``[trainer]``, ``[async]``,
``[sandbox]``, ``[curriculum]``, ``[kubernetes]``; docs/planner.md lists every key). The planner
validates it once, sizes the engines' admission and memory pools from the model's geometry, applies
a measured preset or the generic defaults, and gives advice with stable codes.

Use it from Python; the ``rl_run`` asset is meant to plan exactly so, so that the CLI and Dagster
resolve a run file alike::

    from training.planner import TRAINER_MODULE, PlanError, resolve, trainer_args, write_resolved_plan

    plan = resolve("examples/embedded.toml")   # or a dict shaped like the TOML
    plan.to_json()                             # the JSON that `posttrain plan` prints
    plan.sglang_server_args()                  # `python -m sglang.launch_server` arguments
    run_dir = storage.run_dir(plan.run_name)
    plan_path = write_resolved_plan(plan, run_dir)   # run_dir/resolved-plan.json, written atomically
    launcher.run(context, TRAINER_MODULE, trainer_args(plan_path, run_dir))   # python -m training ...

``resolve`` raises ``PlanError``; its ``problems`` name the file, the section and the key.

From the shell::

    posttrain plan RUN.toml        # the plan as JSON on stdout, a "Configuration tips" box on stderr
    posttrain validate RUN.toml    # exit 0 when the file plans and fits, non-zero with the keys otherwise
    posttrain run RUN.toml [--target local|k8s] [--dry-run]
"""

from serving.admission import Geometry
from training.planner.presets import PRESETS, Preset
from training.planner.resolve import Advice, Plan, resolve
from training.planner.runner import TRAINER_MODULE, trainer_args, write_resolved_plan
from training.planner.schema import PlanError, RunFile, load_run_file, parse_run_dict

__all__ = [
    "PRESETS",
    "TRAINER_MODULE",
    "Advice",
    "Geometry",
    "Plan",
    "PlanError",
    "Preset",
    "RunFile",
    "load_run_file",
    "parse_run_dict",
    "resolve",
    "trainer_args",
    "write_resolved_plan",
]
