"""Where posttrain keeps its data: ``$POSTTRAIN_HOME``.

Datasets, image stores, runs, eval results and the Dagster instance all live under this one root.
Its default is computed here, once: ``sandboxes`` imports nothing else of the project, so every
package may import this module.
"""

import os
from pathlib import Path

HOME_ENV = "POSTTRAIN_HOME"


def default_home() -> Path:
    """``$POSTTRAIN_HOME``, else ``./posttrain-data`` in the current directory; absolute, ``~`` expanded.

    Read on every call, so a process that sets the variable later (the CLI, a test) is seen.
    """
    return Path(os.environ.get(HOME_ENV) or "posttrain-data").expanduser().resolve()


def default_suite_dir() -> Path:
    """``$POSTTRAIN_HOME/datasets/bundled``: where ``posttrain tasks build`` and the ``task_dataset``
    asset write the bundled suite, and where sandbox commands look for it."""
    return default_home() / "datasets" / "bundled"
