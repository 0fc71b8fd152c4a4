"""A CPU fleet on Kubernetes: ``[inference] engine = "vllm"`` (one ``python -m serving.replica
--engine vllm`` pod per replica) and requests sized from ``[kubernetes] node_cpus``/``node_memory_gib``
so that every pod of ``examples/embedded-k8s.toml``, sandboxes included, fits a 2-core, 24 GiB node.
The manifests are read as a scheduler and the entry points would read them: requests summed, the
replica's command line parsed by the replica's own parser, validated against the 1.37 schemas (the
test plane's 1.20 server checks them in tests/kube/).
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from sandboxes import k8s as sandbox_k8s
from serving import replica
from tests.training.test_pod_security import restricted_violations
from training.planner import k8s, resolve
from dagster_project.cli import main
from training.planner.schema import PlanError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "embedded-k8s.toml"


def quantity(text: str) -> float:
    """A Kubernetes quantity (CPU cores or bytes) as a number: "400m" -> 0.4, "7Gi" -> 7 * 2**30."""
    match = re.fullmatch(r"([0-9.]+)(m|Ki|Mi|Gi|Ti)?", text)
    assert match, text
    scale = {None: 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[match.group(2)]
    return float(match.group(1)) * scale


def pod_templates(manifests: list[dict]) -> dict[str, tuple[dict, int]]:
    """Each workload's pod template and how many pods of it run."""
    out = {}
    for m in manifests:
        if m["kind"] in ("Job", "Deployment", "StatefulSet"):
            out[m["metadata"]["labels"]["app.kubernetes.io/component"]] = (m["spec"]["template"]["spec"], m["spec"].get("replicas", 1))
    return out


def requests_of(spec: dict) -> tuple[float, float]:
    cpu = sum(quantity(c["resources"]["requests"]["cpu"]) for c in spec["containers"])
    memory = sum(quantity(c["resources"]["requests"]["memory"]) for c in spec["containers"])
    return cpu, memory


def sandbox_requests(pool_command: list[str]) -> tuple[float, float]:
    """What the pool's sandboxes ask together at most: ``--max-sandboxes`` pods of
    :func:`sandboxes.k8s.pod_spec` with the limits the pool is started with."""
    arg = lambda flag: pool_command[pool_command.index(flag) + 1]
    limits = sandbox_k8s.Limits(cpus=float(arg("--cpus")), memory_mib=int(float(arg("--memory-gib")) * 1024))
    spec = sandbox_k8s.pod_spec(run="r", task_id="t", episode="e", image="img", limits=limits)["spec"]
    # the scheduler's rule: the containers' sum, or the largest init container's if that is more
    cpu, memory = requests_of(spec)
    for init in spec.get("initContainers", []):
        cpu, memory = max(cpu, *requests_of({"containers": [init]})[:1]), max(memory, requests_of({"containers": [init]})[1])
    return int(arg("--max-sandboxes")) * cpu, int(arg("--max-sandboxes")) * memory


@pytest.fixture(scope="module")
def manifests():
    return k8s.build_manifests(resolve(EXAMPLE))


def test_every_pod_of_the_embedded_k8s_run_fits_a_2_core_24_gib_node_together(manifests):
    pods = pod_templates(manifests)
    assert set(pods) == {"trainer", "engine", "router", "sandbox-pool"}
    cpu = memory = 0.0
    for component, (spec, replicas) in pods.items():
        c, m = requests_of(spec)
        assert c > 0 and m > 0, component
        cpu, memory = cpu + replicas * c, memory + replicas * m
        for container in spec["containers"]:  # a CPU node: no pod asks for a GPU or tolerates GPU nodes
            assert not any("gpu" in k for k in container["resources"].get("limits", {})), component
        assert "tolerations" not in spec
    pool_command = pods["sandbox-pool"][0]["containers"][0]["command"]
    sandbox_cpu, sandbox_memory = sandbox_requests(pool_command)
    assert sandbox_cpu > 0
    node = tomllib.loads(EXAMPLE.read_text())["kubernetes"]
    total_cpu, total_memory = cpu + sandbox_cpu, memory + sandbox_memory
    assert total_cpu <= node["node_cpus"] <= 2
    assert total_memory <= node["node_memory_gib"] * 2**30 <= 24 * 2**30
    # the node is used: what is left after the services and the sandboxes goes to the trainer and engine
    assert total_cpu > 0.95 * node["node_cpus"] and total_memory > 0.95 * node["node_memory_gib"] * 2**30


def test_each_engine_pod_is_one_vllm_replica_as_the_local_path_runs_it(manifests):
    plan = resolve(EXAMPLE)
    engine = next(m for m in manifests if m["kind"] == "StatefulSet")
    assert engine["spec"]["replicas"] == 1 and engine["spec"]["serviceName"] == "embedded-k8s-engine"
    (container,) = engine["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "posttrain.local/posttrain:local"
    command = container["command"]
    assert command[:3] == ["python", "-m", "serving.replica"]
    parser = argparse.ArgumentParser()
    replica.add_arguments(parser)
    args = parser.parse_args(command[3:])  # the replica's own parser: every flag is one it takes
    assert args.engine == "vllm" and args.host == "0.0.0.0" and args.port == k8s.CAPTURE_PORT
    # the run file's relative path, under the run volume (the engine server runs in a folder of its own)
    assert args.model == f"{k8s.DATA_MOUNT}/posttrain-data/models/base" and container["workingDir"] == k8s.DATA_MOUNT
    assert args.adapters_dir == f"{k8s.DATA_MOUNT}/runs/embedded-k8s/adapters"
    assert args.max_running_requests == 32  # the local-cpu-tiny-v1 admission, as --max-num-seqs
    assert args.max_model_len == 2048 and args.kv_cache_gib == plan.pods["engine"]["kv_cache_gib"] >= 1
    assert args.max_loras == plan.resolved["sglang_max_loras_per_batch"] and args.max_lora_rank == 16
    # the capture front (the replica's --port) is what the probes, the router and the NetworkPolicy name
    assert {p["containerPort"] for p in container["ports"]} == {k8s.CAPTURE_PORT}
    assert container["readinessProbe"]["httpGet"]["port"] == k8s.CAPTURE_PORT
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 600
    env = {e["name"]: e for e in container["env"]}
    assert env["POSTTRAIN_TRAINER_CREDENTIAL"]["valueFrom"]["secretKeyRef"]["name"] == "embedded-k8s-credential"
    router = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-router"))
    workers = [a for a in router["spec"]["template"]["spec"]["containers"][0]["command"] if a.startswith("http://")]
    assert workers == [f"http://embedded-k8s-engine-{i}.embedded-k8s-engine.posttrain.svc:30001@reserved:1"
                       for i in range(2)]  # max_engines = 2: the second joins when the StatefulSet is scaled


def test_the_cpu_fleet_is_locked_down_and_valid_against_the_1_37_schemas(manifests):
    for spec, _ in pod_templates(manifests).values():
        assert restricted_violations(spec) == []
        assert all(c["workingDir"] == k8s.DATA_MOUNT for c in spec["containers"])
    assert k8s.validate_manifests(manifests, "1.37.0") == []


def test_the_plan_tells_the_engine_and_each_pods_requests():
    table = resolve(EXAMPLE).to_json()
    assert table["inference"]["engine"] == "vllm"
    pods = table["kubernetes"]["pods"]
    assert pods["node"] == {"cpus": 1.5, "memory_gib": 15.0}
    assert pods["router"] == {"cpu": "100m", "memory": "1Gi"} and pods["sandbox_pool"] == {"cpu": "100m", "memory": "1Gi"}
    # the sandboxes' share first (3 x 1 CPU x 25 %), the router's and the pool's, then the rest split
    assert pods["sandboxes"] == {"count": 3, "cpu": "750m", "memory_gib": 1.2}
    assert pods["trainer"]["cpu"] == pods["engine"]["cpu"] == "275m"
    assert pods["engine"]["memory"] == "5Gi"  # gpu_memory_gib 2 + vLLM's runtime allowance 3
    assert pods["trainer"]["memory"] == f"{int((15 - 1.2 - 1 - 1 - 5) * 1024)}Mi"
    json.dumps(table)


def _example(**changes) -> dict:
    data = tomllib.loads(EXAMPLE.read_text())
    for key, value in changes.items():
        section, name = key.split("__")
        if value is None:
            data[section].pop(name, None)
        else:
            data[section][name] = value
    return data


def test_the_default_engine_follows_the_hardware_and_a_gpu_run_keeps_its_fixed_requests():
    cpu = resolve(_example(inference__engine=None), source="cpu.toml")
    assert cpu.engine == "vllm"
    gpu = resolve(_example(inference__engine=None, inference__gpu="h100", inference__profile="generic",
                           kubernetes__node_cpus=None, kubernetes__node_memory_gib=None), source="gpu.toml")
    assert gpu.engine == "sglang"
    assert gpu.pods["trainer"] == {"cpu": "4", "memory": "32Gi"} and gpu.pods["router"] == {"cpu": "2", "memory": "4Gi"}
    engine = next(m for m in k8s.build_manifests(gpu) if m["kind"] == "StatefulSet")
    sglang, capture = engine["spec"]["template"]["spec"]["containers"]
    assert sglang["resources"]["requests"]["cpu"] == "4" and sglang["resources"]["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("changes, message", [
    ({"kubernetes__node_cpus": 1}, "embedded-k8s.toml: [kubernetes] node_cpus: 1 CPUs leave 0.02 each to the trainer"),
    ({"sandbox__max_sandboxes": 5}, "[kubernetes] node_cpus: 1.5 CPUs leave 0.02 each"),
    ({"kubernetes__node_memory_gib": 12}, "[kubernetes] node_memory_gib: 12 GiB leave 3.80 GiB to the trainer"),
    ({"kubernetes__node_memory_gib": None}, "[kubernetes] node_memory_gib: required with node_cpus"),
    ({"inference__engine": "sgl"}, "[inference] engine: expected one of 'sglang', 'vllm', got 'sgl' (str)"),
])
def test_a_node_too_small_or_a_bad_engine_names_the_key(changes, message):
    with pytest.raises(PlanError) as err:
        resolve(_example(**changes), source=str(EXAMPLE))
    assert message in str(err.value)


def test_an_engine_the_hardware_cannot_run_on_kubernetes_says_which_to_use():
    sglang_on_cpu = resolve(_example(inference__engine="sglang", kubernetes__node_cpus=None, kubernetes__node_memory_gib=None),
                            source="x.toml")
    with pytest.raises(ValueError, match=r'engine = "sglang" on Kubernetes needs GPUs .* engine = "vllm"'):
        k8s.build_manifests(sglang_on_cpu)
    vllm_on_gpu = resolve(_example(inference__gpu="h100", inference__profile="generic", kubernetes__node_cpus=None,
                                   kubernetes__node_memory_gib=None), source="x.toml")
    with pytest.raises(ValueError, match=r"vLLM's CPU build .* gpu = 'h100' needs engine = \"sglang\""):
        k8s.build_manifests(vllm_on_gpu)


def test_k8s_dry_run_of_the_example_prints_valid_manifests(capsys):
    assert main(["run", str(EXAMPLE), "--target", "k8s", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    manifests = list(yaml.safe_load_all(out))
    assert {m["kind"] for m in manifests} >= {"Job", "StatefulSet", "Deployment"}  # the volume is the shared claim
    assert "manifests valid against the Kubernetes" in err


def test_a_shared_volume_claim_is_mounted_by_every_pod_and_not_made_by_the_run():
    shared = k8s.build_manifests(resolve(_example(kubernetes__volume_claim="posttrain-data"), source="shared.toml"))
    assert "PersistentVolumeClaim" not in {m["kind"] for m in shared}
    claims = set()
    for m in shared:
        template = (m.get("spec") or {}).get("template")
        for volume in ((template or {}).get("spec") or {}).get("volumes", []):
            if "persistentVolumeClaim" in volume:
                claims.add(volume["persistentVolumeClaim"]["claimName"])
    assert claims == {"posttrain-data"}
    assert k8s.eval_pod(resolve(_example(kubernetes__volume_claim="posttrain-data"), source="shared.toml"))["spec"][
        "volumes"][0]["persistentVolumeClaim"]["claimName"] == "posttrain-data"
    own = k8s.build_manifests(resolve(_example(kubernetes__volume_claim=None), source="own.toml"))
    assert [m["metadata"]["name"] for m in own if m["kind"] == "PersistentVolumeClaim"] == ["embedded-k8s-data"]


def test_the_router_knows_every_replica_the_engines_may_be_scaled_to():
    plan = resolve(_example(inference__max_engines=3), source="elastic.toml")
    router = next(m for m in k8s.build_manifests(plan) if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-router"))
    args = router["spec"]["template"]["spec"]["containers"][0]["args"] if "args" in router["spec"]["template"]["spec"]["containers"][0] \
        else router["spec"]["template"]["spec"]["containers"][0]["command"]
    workers = [args[i + 1] for i, a in enumerate(args) if a == "--worker"]
    assert workers == [f"http://embedded-k8s-engine-{i}.embedded-k8s-engine.posttrain.svc:30001@reserved:1" for i in range(3)]
    engines = next(m for m in k8s.build_manifests(plan) if m["kind"] == "StatefulSet")
    assert engines["spec"]["replicas"] == 1  # what runs at first; the rest join when scaled
