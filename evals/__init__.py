"""posttrain evals: what a task is, the agent harness, grading, metrics and reports.

Modules, in the order data flows through them:

- :mod:`evals.tasks`: the one task schema (:class:`~evals.tasks.Task`) and the loaders (Harbor/DeepSWE
  folders, SWE-bench JSONL/Parquet, the bundled suite); ``posttrain tasks inspect``.
- :mod:`evals.bundled`: the bundled suite of small Python repos, generated reproducibly and validated
  by running their tests in sandboxes (``posttrain tasks build``; :func:`~evals.bundled.load_suite`).
- :mod:`evals.actions`: the compact and JSON tool-call action formats, prompts, and
  :func:`~evals.actions.demonstration` (a task's reference solution as prompt + action text).
- :mod:`evals.sandbox`: the narrow sandbox surface the harness and grader use, over ``sandboxes``.
- :mod:`evals.harness`: :func:`~evals.harness.run_episode`, one episode -> a graded trajectory.
- :mod:`evals.grading`: reports (JUnit XML, CTRF JSON) to DeepSWE-compatible scores; grading of
  committed work only (``posttrain grade``).
- :mod:`evals.attempts`: one attempt's row (:class:`~evals.attempts.AttemptRow`, every one made by
  :func:`~evals.attempts.attempt_row`), its statuses and scores, and
  :func:`~evals.attempts.run_attempts`: every attempt of every task through a
  :class:`~evals.attempts.Verifier`, one per task format:
- :mod:`evals.evaluate`: the bundled, SWE-bench and suite tasks' verifier (an episode of the harness,
  graded by :mod:`evals.grading`), :func:`~evals.evaluate.evaluate` with it, and
  :func:`~evals.evaluate.evaluate_checkpoint`: a checkpoint served for the length of an eval, for
  either format;
- :mod:`evals.harbor`: Harbor tasks' verifier (DeepSWE v1.1's verifier flow), their images, the
  environment check and the export of the bundled suite as Harbor tasks.
- :mod:`evals.metrics`, :mod:`evals.flawed`, :mod:`evals.report`: pass@k, bootstrap intervals,
  paired comparisons with the base model, flawed-task lists, tables and plots.
"""
