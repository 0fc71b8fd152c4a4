"""SGLang launch spec from plan knobs. SGLang needs CUDA and a cluster, neither of which is here: the
spec is checked up to that boundary (arguments, and the Deployment against the Kubernetes schema)."""

import pytest

from serving.sglang import sglang_launch_spec, sglang_server_args

KNOBS = {
    "model_path": "/data/model", "tp_size": 8, "context_length": 65536,
    "sglang_max_running_requests": 256, "sglang_max_total_tokens": 16_777_216,
    "sglang_mem_fraction_static": 0.85, "sglang_chunked_prefill_size": 8192,
    "sglang_max_loras_per_batch": 4, "max_lora_rank": 32, "sglang_disable_radix_cache": False,
    "sglang_max_mamba_cache_size": None,
}


def test_server_args_carry_admission_memory_and_lora():
    args = sglang_server_args(KNOBS)
    flag = lambda name: args[args.index(name) + 1]  # noqa: E731
    assert flag("--model-path") == "/data/model" and flag("--tp-size") == "8"
    assert flag("--max-running-requests") == "256" and flag("--max-total-tokens") == "16777216"
    assert flag("--mem-fraction-static") == "0.85" and flag("--max-loras-per-batch") == "4"
    assert "--enable-lora" in args and "--enable-metrics" in args
    assert "--disable-radix-cache" not in args and "--max-mamba-cache-size" not in args
    assert "--disable-radix-cache" in sglang_server_args({**KNOBS, "sglang_disable_radix_cache": True})


@pytest.mark.parametrize("knobs, key", [
    ({**KNOBS, "sglang_max_total_tokens": -1}, "sglang_max_total_tokens"),
    ({**KNOBS, "sglang_mem_fraction_static": 1.5}, "sglang_mem_fraction_static"),
    ({**KNOBS, "sglang_max_totl_tokens": 5}, "sglang_max_totl_tokens"),
    ({k: v for k, v in KNOBS.items() if k != "model_path"}, "model_path"),
])
def test_bad_knobs_name_the_key(knobs, key):
    with pytest.raises(ValueError, match=key):
        sglang_server_args(knobs)


def test_launch_spec_is_a_valid_deployment_with_the_capture_sidecar():
    import kubernetes_validate

    spec = sglang_launch_spec(KNOBS, image="lmsysorg/sglang:latest", sidecar_image="posttrain:dev", replicas=2,
                              adapters_volume_claim="run-data")
    kubernetes_validate.validate(spec, "1.30.0", strict=True)
    sglang, capture = spec["spec"]["template"]["spec"]["containers"]
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert capture["command"][:3] == ["python", "-m", "serving.capture"]
    assert "http://127.0.0.1:30000" in capture["command"]
