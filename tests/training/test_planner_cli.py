"""``posttrain plan | validate | run``: JSON on stdout, the tips box on stderr, exit codes, the run
directory, and the Kubernetes manifests validated against the real schemas (no API server is
contacted: ``--dry-run`` only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from training.planner import k8s, resolve, runner, write_resolved_plan
from training.planner.cli import EXIT_INVALID, EXIT_NOT_STARTED, EXIT_UNSOUND
from dagster_project.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

HYBRID_B300 = """
[run]
name = "Hybrid B300"
[model]
name = "hybrid"
family = "olmo35-hybrid"
path = "/run-data/models/hybrid"
weights_gib = 13.5
full_attention_layers = 8
kv_heads = 8
head_dim = 128
recurrent_layers = 24
recurrent_heads = 32
recurrent_state_dims = [128, 128]
[inference]
profile = "olmo35-b300-v1"
gpu = "b300"
gpus_per_engine = 8
engines = 2
max_context_length = 32768
[async]
collection_size = 1024
max_policy_lag = 1
[kubernetes]
namespace = "rl"
storage_class = "shared-rwx"
"""


@pytest.fixture
def hybrid_file(tmp_path: Path) -> Path:
    path = tmp_path / "hybrid.toml"
    path.write_text(HYBRID_B300)
    return path


def test_plan_prints_json_on_stdout_and_one_tips_box_on_stderr(hybrid_file: Path, capsys) -> None:
    assert main(["plan", str(hybrid_file)]) == 0
    out, err = capsys.readouterr()
    plan = json.loads(out)
    assert plan["inference"]["resolved"]["sglang_max_total_tokens"] == 17_825_792
    memory = plan["runtime"]["memory"]
    assert set(memory) >= {"weights_gib", "kv_bytes_per_token", "kv_pool_gib", "state_bytes_per_slot",
                           "state_pool_gib", "total_gib", "budget_gib", "fits"}  # fmt: skip
    assert set(plan["runtime"]["async_capacity"]) >= {"engines", "engine_slots", "http_permits", "producer_budget_samples"}
    assert "throughput" in plan["runtime"]
    profile = plan["inference_profile"]
    assert profile["name"] == "olmo35-b300-v1"
    assert all(set(a) >= {"code", "message"} for a in profile["tips"] + profile["warnings"])
    assert err.count("Configuration tips") == 1
    assert "[inference_gpu_memory_datasheet]" in err


def test_examples_plan(capsys) -> None:
    for example in sorted(EXAMPLES.glob("*.toml")):
        assert main(["plan", str(example)]) == 0, example
        assert json.loads(capsys.readouterr().out)["plan_format_version"] == 1


def test_validate_exit_codes(tmp_path: Path, hybrid_file: Path, capsys) -> None:
    assert main(["validate", str(hybrid_file)]) == 0
    bad = tmp_path / "bad.toml"
    bad.write_text('[inference]\nsglang_max_running_requests = 0\nprofle = "generic"\n')
    assert main(["validate", str(bad)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert f"{bad}: [inference] sglang_max_running_requests: expected a positive value, got 0" in err
    assert f"{bad}: [inference] profle: unknown key" in err
    # One B300 per engine cannot hold 544 GiB of KV cache: the plan is sound TOML but does not fit.
    small = tmp_path / "small.toml"
    small.write_text(HYBRID_B300.replace("gpus_per_engine = 8", "gpus_per_engine = 1"))
    assert main(["validate", str(small)]) == EXIT_UNSOUND
    assert "[inference_memory_overcommitted]" in capsys.readouterr().err


def test_conflicting_preset_prints_the_generic_block(tmp_path: Path, capsys) -> None:
    path = tmp_path / "conflict.toml"
    path.write_text(HYBRID_B300.replace("max_context_length = 32768", "max_context_length = 32768\nsglang_max_running_requests = 256"))
    assert main(["plan", str(path)]) == EXIT_INVALID
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{path}: [inference] sglang_max_running_requests: set, but profile 'olmo35-b300-v1' owns it" in err
    assert 'profile = "generic"' in err and "sglang_max_total_tokens = 17_825_792" in err


def test_k8s_dry_run_prints_every_manifest_valid_against_the_schemas(hybrid_file: Path, capsys) -> None:
    assert main(["run", str(hybrid_file), "--target", "k8s", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    manifests = list(yaml.safe_load_all(out))
    kinds = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    assert {
        ("Job", "hybrid-b300-trainer"),
        ("StatefulSet", "hybrid-b300-engine"),
        ("Deployment", "hybrid-b300-router"),
        ("Deployment", "hybrid-b300-sandbox-pool"),
        ("PersistentVolumeClaim", "hybrid-b300-data"),
        ("NetworkPolicy", "hybrid-b300-sandboxes-no-network"),
    } <= kinds
    assert "20 manifests valid against the Kubernetes" in err
    engine = next(m for m in manifests if m["kind"] == "StatefulSet")
    assert engine["spec"]["replicas"] == 2
    sglang, capture = engine["spec"]["template"]["spec"]["containers"]
    assert capture["name"] == "capture" and sglang["resources"]["limits"]["nvidia.com/gpu"] == "8"
    args = sglang["command"]
    for flag, value in [("--max-running-requests", "512"), ("--max-total-tokens", "17825792"),
                        ("--mem-fraction-static", "0.7"), ("--chunked-prefill-size", "8192"),
                        ("--cuda-graph-max-bs-decode", "512"), ("--max-mamba-cache-size", "3072"),
                        ("--mamba-radix-cache-strategy", "extra_buffer"), ("--tp-size", "8")]:  # fmt: skip
        assert args[args.index(flag) + 1] == value
    assert "--enable-lora" in args and "--disable-radix-cache" not in args
    router = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-router"))
    workers = [a for a in router["spec"]["template"]["spec"]["containers"][0]["command"] if a.startswith("http://")]
    assert workers == [f"http://hybrid-b300-engine-{i}.hybrid-b300-engine.rl.svc:30001@reserved:8" for i in (0, 1)]
    plan_map = next(m for m in manifests if m["kind"] == "ConfigMap")
    assert json.loads(plan_map["data"]["resolved-plan.json"])["run"]["name"] == "Hybrid B300"


def test_manifest_validation_catches_a_bad_object(hybrid_file: Path) -> None:
    manifests = k8s.build_manifests(resolve(hybrid_file))
    assert k8s.validate_manifests(manifests) == []
    manifests[-1]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = {"x": 1}
    manifests[0]["spec"]["acessModes"] = ["ReadWriteMany"]
    problems = k8s.validate_manifests(manifests)
    assert len(problems) == 2
    assert problems[0].startswith("PersistentVolumeClaim/hybrid-b300-data: spec: Additional properties")


def test_run_writes_the_plan_atomically_and_refuses_another_plan(tmp_path: Path, hybrid_file: Path) -> None:
    plan = resolve(hybrid_file)
    run_dir = tmp_path / "runs" / "r"
    path = write_resolved_plan(plan, run_dir)
    assert json.loads(path.read_text()) == plan.to_json()
    assert [p.name for p in run_dir.iterdir()] == ["resolved-plan.json"]  # no temporary file left
    assert write_resolved_plan(plan, run_dir) == path  # the same plan again: a resumed run
    other = resolve(_other(hybrid_file, tmp_path))
    with pytest.raises(runner.RunStartError, match="already holds a different plan"):
        write_resolved_plan(other, run_dir)
    write_resolved_plan(other, run_dir, replace=True)
    assert json.loads(path.read_text())["inference"]["engines"] == 3


def _other(hybrid_file: Path, tmp_path: Path) -> Path:
    other = tmp_path / "other.toml"
    other.write_text(hybrid_file.read_text().replace("engines = 2", "engines = 3"))
    return other


def test_local_run_without_a_trainer_says_so(tmp_path: Path, hybrid_file: Path, monkeypatch, capsys) -> None:
    """Whether training/__main__.py exists depends on the tree; the missing case is forced here."""
    monkeypatch.setattr(runner, "trainer_is_built", lambda: False)
    run_dir = tmp_path / "run"
    assert main(["run", str(hybrid_file), "--run-dir", str(run_dir)]) == EXIT_NOT_STARTED
    assert "the trainer is not built" in capsys.readouterr().err
    assert (run_dir / "resolved-plan.json").is_file()


def test_local_run_starts_the_trainer_entry_point(tmp_path: Path, hybrid_file: Path, monkeypatch) -> None:
    """The trainer itself is training's to test; here the command it is started with is checked."""
    seen = []
    monkeypatch.setattr(runner, "trainer_is_built", lambda: True)
    monkeypatch.setattr(runner.subprocess, "call", lambda cmd, env: seen.append((cmd, env)) or 0)
    run_dir = tmp_path / "run"
    assert main(["run", str(hybrid_file), "--run-dir", str(run_dir)]) == 0
    cmd, env = seen[0]
    assert cmd[1:] == ["-m", "training", "--config", str(run_dir / "resolved-plan.json"), "--run-dir", str(run_dir)]
    from sandboxes.httpserver.auth import CREDENTIAL_ENV, process_credential
    assert env[CREDENTIAL_ENV] == process_credential().value  # given explicitly, never on its command line
    assert process_credential().value not in cmd


def test_the_trainer_reads_the_plans_trainer_table(tmp_path: Path) -> None:
    """The resolved plan is what `python -m training --config` is given: its trainer table must load."""
    from training.config import TrainConfig

    for example in sorted(EXAMPLES.glob("*.toml")):
        plan = resolve(example)
        config = TrainConfig.load(write_resolved_plan(plan, tmp_path / plan.run_name))
        assert config.run_name == plan.run_name
        assert config.groups_per_step * config.group_size == plan.run_file.async_.collection_size
        assert config.max_policy_lag == plan.run_file.async_.max_policy_lag
        assert config.reward == (plan.run_file.trainer.reward or "reward")
    assert TrainConfig.load(write_resolved_plan(resolve(EXAMPLES / "embedded.toml"), tmp_path / "e")).reward == "strict_target_score"


def test_embedded_example_with_its_base_model_geometry(tmp_path: Path) -> None:
    """The embedded example, planned against a config.json in training.base_model's geometry."""
    import tomllib

    from training.base_model import BaseModelSpec

    spec = BaseModelSpec()
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "hidden_size": spec.hidden_size, "torch_dtype": "float32",
        "max_position_embeddings": spec.max_position_embeddings,
    }))  # fmt: skip
    (base / "model.safetensors").write_bytes(b"\0" * (4 * 2**20))
    data = tomllib.loads((EXAMPLES / "embedded.toml").read_text())
    data["model"]["path"] = str(base)
    plan = resolve(data, source="embedded.toml")
    # R = 32 (measured preset); tokens 32 x 2048 = 65,536 x 2,304 bytes (2 x 3 x 3 x 32 x 4)
    # = 150,994,944 bytes = 0.1406 GiB.
    assert (spec.num_layers, spec.num_kv_heads, spec.hidden_size // spec.num_heads) == (3, 3, 32)
    assert plan.resolved["sglang_max_total_tokens"] == 65_536
    assert plan.memory["kv_pool_gib"] == 0.1406
    assert plan.memory["fits"] is True
    assert plan.warning_codes() == []


def test_k8s_run_without_a_cluster_says_so(tmp_path: Path, hybrid_file: Path, monkeypatch, capsys) -> None:
    """No API server here: the run writes its plan, then reports that no cluster is configured."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    code = main(["run", str(hybrid_file), "--target", "k8s", "--run-dir", str(tmp_path / "run"),
                 "--kubeconfig", str(tmp_path / "no-kubeconfig")])  # fmt: skip
    assert code == EXIT_NOT_STARTED
    assert "no Kubernetes configuration" in capsys.readouterr().err
    assert (tmp_path / "run" / "resolved-plan.json").is_file()
