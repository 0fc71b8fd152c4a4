"""Declarative automation: the daemon's sensor that evaluates the assets' ``AutomationCondition``s.

``eval_report`` carries its condition (refresh after every ``deepswe_eval`` materialization newer than
the report's last request, once no report run is in progress, whether or not other evals still run;
``assets/evals.py`` says why it is not ``since_last_handled``); this sensor, running by default,
evaluates it every 30 s and launches the report runs, tagged ``posttrain/workload=report``.
"""

from __future__ import annotations

import dagster as dg

from dagster_project.jobs import REPORT_TAGS

report_automation_sensor = dg.AutomationConditionSensorDefinition(
    "report_automation_sensor",
    target=dg.AssetSelection.assets("eval_report"),
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=30,
    run_tags=REPORT_TAGS,
    description="Refreshes eval_report after every deepswe_eval materialization.",
)

automation_sensors = [report_automation_sensor]
