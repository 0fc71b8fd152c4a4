"""Capture inside the replica, replay through the model, the SGLang capture sidecar, sharded adapter upload."""

from pathlib import Path

import pytest
import torch

from serving.adapters import newest_adapter, publish_to_volume, push_adapter
from serving.capture_store import trainer_headers
from serving.client import EngineClient, EngineError
from serving.local_engine import LocalEngine
from serving.capture import serve_sidecar
from serving.http import serve

PROMPT = list(range(20, 70))


def _replay_logprobs(model_dir, adapter_dir, call, temperature=1.0):
    """Teacher-force the captured tokens through a freshly loaded model; logprob of each output token."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    ids = call["input_ids"] + call["output_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    n = len(call["input_ids"])
    return [logprobs[n - 1 + i, tok].item() for i, tok in enumerate(call["output_ids"])]


def test_captured_calls_replay_to_the_same_logprobs(tiny_model, adapters):
    server = serve(LocalEngine(tiny_model, torch_threads=1), port=0)
    try:
        client = EngineClient(server.url)
        client.load_lora_adapter("v000001", str(adapters["v000001"]))
        params = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
        first = client.generate(PROMPT, params, lora_path="v000001", rid="rollout-1")  # no logprobs asked
        second_prompt = PROMPT + first["output_ids"] + [5, 6, 7]
        client.generate(second_prompt, params, lora_path="v000001", rid="rollout-1")
        client.generate(PROMPT, params, rid="rollout-2")
        calls = client.session("rollout-1")
        assert [c["call_index"] for c in calls] == [0, 1]
        assert calls[0]["output_ids"] == first["output_ids"]
        assert calls[1]["input_ids"] == second_prompt
        assert calls[1]["cached_tokens"] >= 64  # the second turn reused the first turn's KV
        assert {c["lora_path"] for c in calls} == {"v000001"} and calls[0]["weight_version"] == "v000001"
        for call in calls:
            replayed = _replay_logprobs(tiny_model, adapters["v000001"], call)
            assert len(replayed) == len(call["output_logprobs"]) == 24
            assert max(abs(a - b) for a, b in zip(replayed, call["output_logprobs"])) < 1e-4
        base_call = client.session("rollout-2")[0]
        replayed = _replay_logprobs(tiny_model, None, base_call)
        assert max(abs(a - b) for a, b in zip(replayed, base_call["output_logprobs"])) < 1e-4
        client.drop_session("rollout-1")
        assert client.session("rollout-1") == []
    finally:
        server.shutdown()


def test_capture_front_in_front_of_an_engine_server(tiny_model):
    """The capture front over the local engine's server (through its protocol client): logprobs
    recorded though not asked for, metrics in the front's vocabulary, a request id per call."""
    upstream = serve(LocalEngine(tiny_model, torch_threads=1), port=0)
    sidecar = serve_sidecar(upstream.url, port=0)
    try:
        client = EngineClient(sidecar.url)
        out = client.generate(PROMPT, {"max_new_tokens": 6, "ignore_eos": True}, rid="r9")
        assert "output_token_logprobs" not in out["meta_info"]
        client.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True}, session_id="r9")
        calls = client.session("r9")
        assert calls[0]["output_ids"] == out["output_ids"] and len(calls[0]["output_logprobs"]) == 6
        assert len({c["request_id"] for c in calls}) == 2 and all(c["request_id"].startswith("r9#") for c in calls)
        assert client.metrics()["generation_tokens_total"] == 8  # the engine's counters, normalized
        assert client.health()
    finally:
        sidecar.shutdown()
        upstream.shutdown()


def test_sharded_upload_loads_the_same_adapter(tiny_model, adapters, tmp_path):
    server = serve(LocalEngine(tiny_model, torch_threads=1), port=0, staging_dir=tmp_path / "staging")
    try:
        client = EngineClient(server.url)
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        client.load_lora_adapter("from-dir", str(adapters["v000002"]))
        result = push_adapter(server.url, "v000002", adapters["v000002"], num_shards=3)
        assert result["success"] and "v000002" in result["loaded_adapters"]
        a = client.generate(PROMPT, params, lora_path="from-dir")["output_ids"]
        b = client.generate(PROMPT, params, lora_path="v000002")["output_ids"]
        assert a == b
        # A commit before every shard arrived is refused, naming what is missing.
        client.pool.request("PUT", f"{server.url}/lora_shards/v9/0?num_shards=2", b"x", trainer_headers())
        try:
            client.pool.json("POST", f"{server.url}/commit_lora_adapter", {"lora_name": "v9", "num_shards": 2, "adapter_config": {"peft_type": "LORA"}},
                             trainer_headers())
            raise AssertionError("commit with a missing shard was accepted")
        except EngineError as exc:
            assert exc.status == 400 and "shards [1]" in exc.message
    finally:
        server.shutdown()


def test_adapter_routes_need_the_trainer_credential(tiny_model, adapters):
    """A version loaded is what later calls may sample, and ``lora_path`` names a folder the replica
    reads: the engine server's and the capture front's adapter routes answer 403 to a caller without
    the trainer credential or with another one, and load, unload and stage nothing; the trainer's
    ``push_adapter`` and ``EngineClient`` carry the credential and are served."""
    import json

    from serving.adapters import shard_adapter
    from serving.client import HttpPool

    config, blobs = shard_adapter(adapters["v000002"], 1)
    engine = serve(LocalEngine(tiny_model, max_total_tokens=4096, torch_threads=1), port=0)
    front = serve_sidecar(engine.url, port=0)
    try:
        for url in (engine.url, front.url):
            EngineClient(url).load_lora_adapter("v000001", str(adapters["v000001"]))
            calls = [("POST", "/load_lora_adapter", {"lora_name": "v000002", "lora_path": str(adapters["v000002"])}),
                     ("POST", "/unload_lora_adapter", {"lora_name": "v000001"}),
                     ("PUT", "/lora_shards/v000002/0?num_shards=1", blobs[0]),
                     ("POST", "/commit_lora_adapter", {"lora_name": "v000002", "num_shards": 1, "adapter_config": config})]
            for headers in ({}, trainer_headers("another-credential-" + "x" * 40)):
                pool = HttpPool(timeout_s=60, headers=headers)
                for method, path, body in calls:
                    data = body if isinstance(body, bytes) else json.dumps(body).encode()
                    status, answer, _ = pool.request(method, url + path, data)
                    assert status == 403 and b"trainer credential" in answer, (url, path, status, answer[:200])
            assert EngineClient(url).server_info()["loaded_adapters"] == ["v000001"], url
            # the shard a stranger sent was never staged: a commit with the credential finds nothing
            with pytest.raises(EngineError) as err:
                EngineClient(url).pool.json("POST", url + "/commit_lora_adapter",
                                            {"lora_name": "v000002", "num_shards": 1, "adapter_config": config}, trainer_headers())
            assert err.value.status == 400 and "shards [0]" in err.value.message
            assert push_adapter(url, "v000002", adapters["v000002"], num_shards=2)["success"]
            EngineClient(url).unload_lora_adapter("v000001")
            assert EngineClient(url).server_info()["loaded_adapters"] == ["v000002"], url
    finally:
        front.shutdown()
        engine.shutdown()


def test_a_merged_adapter_is_the_adapter_and_the_front_serves_it_under_its_name(tiny_model, adapters, tmp_path):
    """merge_adapter's model computes what the base with the adapter computes; a front told the
    version it holds merged answers to that name from the engine's base weights and records it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from serving.adapters import merge_adapter
    from serving.capture import serve_front, upstream_engine

    merged = merge_adapter(tiny_model, adapters["v000001"], tmp_path / "merged")
    assert (merged / "tokenizer.json").is_file() or (merged / "tokenizer_config.json").is_file()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(adapters["v000001"]))(ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged)(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model)(ids).logits
    assert (got - want).abs().max() < 1e-3 < (base - want).abs().max()  # float32 rounding of one sum

    lora_side = serve(LocalEngine(tiny_model, torch_threads=1), port=0)
    merged_side = serve(LocalEngine(merged, torch_threads=1), port=0)
    front = serve_front(upstream_engine("local", merged_side.url), port=0, merged_version="step_000001")
    try:
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        EngineClient(lora_side.url).load_lora_adapter("v1", str(adapters["v000001"]))
        a = EngineClient(lora_side.url).generate(PROMPT, params, lora_path="v1")["output_ids"]
        out = EngineClient(front.url).generate(PROMPT, params, lora_path="step_000001", session_id="m1")
        assert out["output_ids"] == a and out["meta_info"]["weight_version"] == "step_000001"
        assert [c["weight_version"] for c in EngineClient(front.url).session("m1")] == ["step_000001"]
        assert EngineClient(front.url).server_info()["weight_version"] == "step_000001"
        # The base model is not what this replica serves: a call for it is refused, not mislabelled.
        with pytest.raises(EngineError) as err:
            EngineClient(front.url).generate(PROMPT, params, session_id="m2")
        assert err.value.status == 400 and "step_000001" in err.value.message
    finally:
        front.shutdown()
        merged_side.shutdown()
        lora_side.shutdown()


def test_merge_adapter_refuses_bad_input_and_leaves_nothing_half_written(tiny_model, adapters, tmp_path):
    from serving.adapters import merge_adapter

    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        merge_adapter(tiny_model, tmp_path, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="config.json"):
        merge_adapter(tmp_path, adapters["v000001"], tmp_path / "out")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="taken"):
        merge_adapter(tiny_model, adapters["v000001"], tmp_path / "taken")
    # A failure while writing removes the temporary copy: no out, no dot-folder beside it.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((Path(adapters["v000001"]) / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Exception):
        merge_adapter(tiny_model, broken, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "taken"]


def test_volume_publication_and_newest_version(adapters, tmp_path):
    volume = tmp_path / "adapters"
    assert newest_adapter(volume) is None
    publish_to_volume(adapters["v000002"], volume, "v000010")
    publish_to_volume(adapters["v000001"], volume, "v000009")
    (volume / "v000011").mkdir()  # an incomplete version is not picked
    assert newest_adapter(volume) == ("v000010", str(volume / "v000010"))


def test_a_replicas_shard_staging_folder_goes_with_it(tmp_path):
    """The folder an assembler makes for itself (every replica's capture front has one) is removed
    when the process exits; a folder it was given is the caller's and stays."""
    import subprocess
    import sys

    given = tmp_path / "given"
    code = ("from serving.adapters import ShardAssembler\n"
            f"own = ShardAssembler(); given = ShardAssembler({str(given)!r})\n"
            "(own.staging_dir / 'v1').mkdir(); print(own.staging_dir)\n")
    own = Path(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip())
    assert own.name.startswith("posttrain-adapters-") and not own.exists()
    assert given.is_dir()


def test_an_assembler_never_published_to_makes_no_folder(tmp_path, monkeypatch):
    """A replica killed before any publication (a crash, a SIGKILL in a fault test) has nothing to
    clean: its assembler makes its own staging folder only when the first adapter is assembled."""
    import tempfile

    from serving.adapters import ShardAssembler

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assembler = ShardAssembler()
    assert list(tmp_path.iterdir()) == []
    staged = assembler.staging_dir
    assert staged.parent == tmp_path and staged.name.startswith("posttrain-adapters-") and staged.is_dir()
    assert assembler.staging_dir == staged  # made once
