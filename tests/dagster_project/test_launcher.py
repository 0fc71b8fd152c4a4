"""The workload launcher: a local subprocess through Dagster Pipes, or a Kubernetes pod."""

import dagster as dg
import pytest

from assets.resources import WorkloadLauncher


@dg.asset
def launched(context: dg.AssetExecutionContext, launcher: WorkloadLauncher):
    return launcher.run(
        context, "tests.dagster_project.pipes_workload", ["--fast"], env={"WORKLOAD_FLAG": "on"}, extras={"steps": 3}
    ).get_materialize_result()


def test_local_launch_reports_through_pipes():
    with dg.instance_for_test() as instance:
        result = dg.materialize([launched], instance=instance, resources={"launcher": WorkloadLauncher()})
        assert result.success
        [mat] = result.asset_materializations_for_node("launched")
        assert mat.metadata["steps"].value == 3
        assert mat.metadata["argv"].value == "--fast"
        assert mat.metadata["env_flag"].value == "on"


def test_k8s_launch_waits_without_deadline(monkeypatch):
    """No Kubernetes API server runs here: PipesK8sClient.run is replaced to capture its arguments.
    On a cluster the same call creates the pod and streams its logs and Pipes messages."""
    from dagster_k8s import PipesK8sClient

    seen = {}

    def fake_run(self, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(PipesK8sClient, "run", fake_run)
    launcher = WorkloadLauncher(target="k8s", image="registry.local/posttrain:1", namespace="rl", service_account="trainer")

    @dg.asset
    def on_cluster(context: dg.AssetExecutionContext, launcher: WorkloadLauncher):
        launcher.run(context, "training", ["--run-file", "/data/run.toml"], extras={"run": "r1"})

    with dg.instance_for_test() as instance, pytest.raises(RuntimeError, match="stop here"):
        dg.materialize([on_cluster], instance=instance, resources={"launcher": launcher})
    assert seen["image"] == "registry.local/posttrain:1"
    assert seen["namespace"] == "rl"
    assert seen["command"] == ["python", "-m", "training", "--run-file", "/data/run.toml"]
    assert seen["pod_wait_timeout"] == 0  # 0 disables the wait deadline in dagster-k8s
    assert seen["base_pod_spec"] == {"serviceAccountName": "trainer"}
    assert seen["extras"] == {"run": "r1"}
