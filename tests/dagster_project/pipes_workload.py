"""A workload for launcher tests: reads its extras through Dagster Pipes and reports a materialization."""

import os
import sys

from dagster_pipes import open_dagster_pipes

if __name__ == "__main__":
    with open_dagster_pipes() as pipes:
        steps = int(pipes.get_extra("steps"))
        for step in range(steps):
            pipes.log.info(f"step {step + 1}/{steps}")
        pipes.report_asset_materialization(
            metadata={"steps": steps, "argv": " ".join(sys.argv[1:]), "env_flag": os.environ.get("WORKLOAD_FLAG", "")}
        )
