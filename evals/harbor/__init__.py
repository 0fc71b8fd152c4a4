"""Harbor tasks end to end: images, agents, DeepSWE v1.1's verifier flow, the environment check, export.

The flow of one attempt, as DeepSWE v1.1 runs it::

    agent sandbox (the task's image, /app)  ->  model.patch = committed work (evals.grading.committed_patch)
      -> a fresh verifier sandbox of the same image, with /tests (the task's tests/ folder),
         /logs/artifacts/model.patch, /logs/verifier
      -> bash /tests/test.sh  (the task's verifier: applies model.patch and test.patch, runs the suites,
         writes the reports its tests/config.json names; DeepSWE's also writes reward.json)
      -> posttrain's grade of the same reports (evals.grading: parse, worst status, score), recorded
         beside the task's own reward.json when there is one (``task_reward``, ``agrees``)

One module per concern:

- :mod:`evals.harbor.build`: which datasets are Harbor's, each task's image, the sandboxes of an attempt;
- :mod:`evals.harbor.verify`: the agents (``oracle``, ``nop``, ``model``), the verifier run and its
  grade (:class:`Verification`), and :class:`HarborVerifier`, the :class:`~evals.attempts.Verifier`
  that :func:`evaluate_harbor` runs every attempt through (a checkpoint served for it by
  :func:`evals.evaluate.evaluate_checkpoint`, as the ``deepswe_eval`` asset does on a Harbor dataset);
  its rows are :class:`~evals.attempts.AttemptRow`, made by :func:`evals.attempts.attempt_row`;
- :mod:`evals.harbor.envcheck`: what the reference solution does in each image (strict credit spares
  the existing tests it fails there), and the environment-flawed list;
- :mod:`evals.harbor.export`: the bundled suite written as Harbor tasks.

What grading withstands here: the reports are read after every process of the verifier sandbox has
been killed (nothing the tests left behind can rewrite them later), a report that is missing or
malformed counts its tests as failed, the verifier's timeout fails what did not finish, and the
patch's static cheating signals (:func:`evals.signals.patch_signals`, with the paths test.patch
writes as protected) are recorded. The verifier sandbox does not set
``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` (real tasks need ``pytest -n 4`` and reporter plugins), so the
results stream of :mod:`evals.pytest_results`, which the bundled path grades from, is not used: code
running inside the pytest process can still rewrite a report before it exits, as under DeepSWE's own
verifier.
"""

from evals.attempts import AGENT_FAULT, APPLY_FAILED, GRADED, INFRA_ERROR, AgentRun
from evals.evaluate import eval_split, select_tasks
from evals.harbor.build import build_task_image, harbor_image_name, harbor_sandbox_factory, is_harbor_dataset
from evals.harbor.envcheck import (
    ENVIRONMENT_RECORDS, EnvironmentFlaw, EnvironmentRecord, check_environments, environment_check,
    environment_record, environment_record_path, flaws_of, read_environment_record, with_environment_records,
    write_environment_flawed, write_environment_record,
)
from evals.harbor.export import EXPORT_URL, REPORTS, export_harbor, export_task, verifier_script
from evals.harbor.verify import (
    AGENTS, ENVIRONMENT_BROKEN, HarborVerifier, Verification, compare_reward, evaluate_harbor, grade_harbor_reports,
    oracle_patch, record_verification, run_agent, run_attempt, verify,
)

__all__ = [
    "AGENTS", "AGENT_FAULT", "APPLY_FAILED", "ENVIRONMENT_BROKEN", "ENVIRONMENT_RECORDS", "EXPORT_URL", "GRADED",
    "INFRA_ERROR", "REPORTS", "AgentRun", "EnvironmentFlaw", "EnvironmentRecord", "HarborVerifier", "Verification",
    "build_task_image", "check_environments", "compare_reward", "environment_check",
    "environment_record", "environment_record_path", "eval_split", "evaluate_harbor",
    "export_harbor", "export_task", "flaws_of", "grade_harbor_reports", "harbor_image_name",
    "harbor_sandbox_factory", "is_harbor_dataset", "oracle_patch", "read_environment_record",
    "record_verification", "run_agent", "run_attempt", "select_tasks", "verifier_script", "verify",
    "with_environment_records", "write_environment_flawed", "write_environment_record",
]
