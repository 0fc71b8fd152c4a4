"""The posttrain code location: merges the ``defs`` each ``assets/*.py`` module declares.

Partitions and resources live beside the assets (``assets/partitions.py``, ``assets/resources.py``),
so every import points down the graph: ``dagster_project`` imports ``assets``, never the reverse.

Load it with ``dagster dev -w workspace.yaml`` or ``dagster asset list -m dagster_project.definitions``.
"""

from __future__ import annotations

import dagster as dg

from assets import checks, curriculum, evals, images, tasks, training
from assets.resources import PosttrainStorage, WorkloadLauncher
from dagster_project.jobs import jobs
from dagster_project.sensors import sensors

defs = dg.Definitions.merge(
    tasks.defs,
    images.defs,
    curriculum.defs,
    training.defs,
    evals.defs,
    checks.defs,
    dg.Definitions(
        jobs=jobs,
        sensors=sensors,
        # POSTTRAIN_HOME and POSTTRAIN_TARGET (with KUBECONFIG) choose where files live and where runs go
        resources={"storage": PosttrainStorage(), "launcher": WorkloadLauncher.from_env()},
    ),
)
