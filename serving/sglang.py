"""SGLang on a cluster: server arguments and the pod spec of one replica, from resolved plan knobs.

The run planner (``training.planner``) resolves a run file into knobs named ``sglang_*``; this module
consumes them as a plain mapping, so anything that has the numbers (the planner, a test, a script)
can produce a replica spec:

    knobs = {"model_path": "/data/model", "tp_size": 8, "context_length": 65536,
             "sglang_max_running_requests": 256, "sglang_max_total_tokens": 16_777_216,
             "sglang_mem_fraction_static": 0.85, "sglang_chunked_prefill_size": 8192,
             "sglang_max_loras_per_batch": 4, "max_lora_rank": 32}
    sglang_server_args(knobs)                 # ["--model-path", "/data/model", "--tp-size", "8", ...]
    sglang_launch_spec(knobs, image=..., sidecar_image=...)   # a Kubernetes Deployment (dict)

Each replica pod runs SGLang and the capture sidecar (``python -m serving.capture``) on localhost;
the router talks to the sidecar's port, which speaks the same API. The client is
``serving.client.EngineClient``: SGLang's native API is the engine protocol here.
"""

from __future__ import annotations

from typing import Any, Mapping

SGLANG_PORT = 30000
CAPTURE_PORT = 30001

# knob -> (flag, kind). kind "bool" adds the bare flag when true.
_FLAGS: dict[str, tuple[str, str]] = {
    "tp_size": ("--tp-size", "int"),
    "context_length": ("--context-length", "int"),
    "sglang_max_running_requests": ("--max-running-requests", "int"),
    "sglang_max_total_tokens": ("--max-total-tokens", "int"),
    "sglang_mem_fraction_static": ("--mem-fraction-static", "float"),
    "sglang_chunked_prefill_size": ("--chunked-prefill-size", "int"),
    "sglang_cuda_graph_max_bs_decode": ("--cuda-graph-max-bs", "int"),
    "sglang_disable_radix_cache": ("--disable-radix-cache", "bool"),
    "sglang_max_mamba_cache_size": ("--max-mamba-cache-size", "int"),
    "sglang_mamba_scheduler_strategy": ("--mamba-scheduler-strategy", "str"),
    "sglang_max_loras_per_batch": ("--max-loras-per-batch", "int"),
    "max_lora_rank": ("--max-lora-rank", "int"),
    "sglang_page_size": ("--page-size", "int"),
    "sglang_schedule_policy": ("--schedule-policy", "str"),
}
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _check(knobs: Mapping[str, Any], key: str, kind: str) -> Any:
    value = knobs[key]
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool) and value > 0,
        "float": isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1,
        "bool": isinstance(value, bool),
        "str": isinstance(value, str) and bool(value),
    }[kind]
    if not ok:
        expected = {"int": "a positive integer", "float": "a number in (0, 1]", "bool": "true or false", "str": "a string"}[kind]
        raise ValueError(f"plan knob {key} must be {expected}, got {value!r}")
    return value


def sglang_server_args(knobs: Mapping[str, Any], *, host: str = "127.0.0.1", port: int = SGLANG_PORT) -> list[str]:
    """``python -m sglang.launch_server`` arguments. ``model_path`` is required; every other knob
    is passed when present (None means absent). LoRA is always on: RL serves adapter versions."""
    if not isinstance(knobs.get("model_path"), str) or not knobs["model_path"]:
        raise ValueError("plan knob model_path is required (the model directory or hub name)")
    unknown = sorted(k for k in knobs if k not in _FLAGS and k not in ("model_path", "lora_target_modules"))
    if unknown:
        raise ValueError(f"plan knob {unknown[0]} is not a known SGLang knob (known: {', '.join(sorted(_FLAGS))})")
    args = ["--model-path", knobs["model_path"], "--host", host, "--port", str(port)]
    for key, (flag, kind) in _FLAGS.items():
        if knobs.get(key) is None:
            continue
        value = _check(knobs, key, kind)
        if kind == "bool":
            if value:
                args.append(flag)
        else:
            args += [flag, str(value)]
    targets = knobs.get("lora_target_modules") or DEFAULT_LORA_TARGETS
    args += ["--enable-lora", "--lora-target-modules", *targets, "--enable-metrics"]
    return args


def sglang_launch_spec(knobs: Mapping[str, Any], *, name: str = "engine", image: str, sidecar_image: str,
                       replicas: int = 1, namespace: str = "default", gpus: int | None = None,
                       adapters_volume_claim: str | None = None, pool: str = "reserved") -> dict[str, Any]:
    """A Kubernetes Deployment of SGLang replicas, each pod with the capture sidecar on localhost."""
    gpus = gpus or int(knobs.get("tp_size") or 1)
    labels = {"app.kubernetes.io/name": "posttrain", "app.kubernetes.io/component": name, "posttrain/pool": pool}
    # Sharded adapter uploads are assembled by the sidecar in a folder SGLang can read.
    staging = {"name": "adapter-staging", "mountPath": "/adapter-staging"}
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, staging]
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, {"name": "adapter-staging", "emptyDir": {}}]
    if adapters_volume_claim:
        mounts.append({"name": "run", "mountPath": "/run-data"})
        volumes.append({"name": "run", "persistentVolumeClaim": {"claimName": adapters_volume_claim}})
    sglang = {
        "name": "sglang",
        "image": image,
        "command": ["python3", "-m", "sglang.launch_server", *sglang_server_args(knobs, host="127.0.0.1", port=SGLANG_PORT)],
        "resources": {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}},
        "readinessProbe": {"httpGet": {"path": "/health", "port": SGLANG_PORT}, "periodSeconds": 10, "failureThreshold": 90},
        "volumeMounts": mounts,
    }
    sidecar = {
        "name": "capture",
        "image": sidecar_image,
        "command": ["python", "-m", "serving.capture", "--upstream", f"http://127.0.0.1:{SGLANG_PORT}",
                    "--host", "0.0.0.0", "--port", str(CAPTURE_PORT), "--staging-dir", staging["mountPath"]],
        "ports": [{"name": "engine-api", "containerPort": CAPTURE_PORT}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": CAPTURE_PORT}, "periodSeconds": 5},
        "volumeMounts": mounts[1:],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [sglang, sidecar], "volumes": volumes},
            },
        },
    }
