"""Adapter versions: the shared volume, and sharded HTTP publication to live replicas.

After each step the trainer publishes the new LoRA version two ways
(:class:`training.publish.AdapterPublisher`, versions named by step, ``step_000012``):

    from serving.adapters import publish_to_volume, push_adapter
    publish_to_volume(adapter_dir, run_dir / "adapters", "step_000012")   # for replicas that join later
    push_adapter(replica_url, "step_000012", adapter_dir, num_shards=4)    # to a live replica, in parallel

``push_adapter`` splits the adapter's tensors into shards, sends each as a safetensors body with
``PUT /lora_shards/{lora_name}/{shard_index}?num_shards=N`` (in parallel threads), then
``POST /commit_lora_adapter {"lora_name", "num_shards", "adapter_config"}``: the replica checks every
shard arrived, writes the adapter under its staging folder and loads it under that name, exactly as
``POST /load_lora_adapter`` would. A replica that joins later loads the newest complete version on
the volume (:func:`newest_adapter`; ``python -m serving.local_engine --adapters-dir``, and
:meth:`serving.router.core.Router.add_replica` before the replica takes traffic), and
:meth:`~serving.router.core.Router.publish_adapter` loads an announced version on every live replica
that lacks it.

Version names sort by their last integer (``step_000012`` after ``step_000009``); zero-pad them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from serving.protocol import BadRequest

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def version_sort_key(name: str) -> tuple[int, str]:
    numbers = re.findall(r"\d+", name)
    return (int(numbers[-1]) if numbers else -1, name)


def newest_version(names) -> str | None:
    names = list(names)
    return max(names, key=version_sort_key) if names else None


def newest_adapter(volume: str | Path) -> tuple[str, str] | None:
    """(version, path) of the newest complete adapter under ``volume`` (``<volume>/<version>/``).
    Dot folders are copies still being written (``publish_to_volume``'s, the trainer's): never a version."""
    root = Path(volume)
    if not root.is_dir():
        return None
    complete = [p.name for p in root.iterdir() if not p.name.startswith(".")
                and (p / ADAPTER_CONFIG).is_file() and (p / ADAPTER_WEIGHTS).is_file()]
    version = newest_version(complete)
    return (version, str(root / version)) if version else None


def publish_to_volume(adapter_dir: str | Path, volume: str | Path, version: str) -> Path:
    """Copy an adapter to ``<volume>/<version>/`` atomically (a half-copied version is never seen)."""
    src = Path(adapter_dir)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (src / name).is_file():
            raise FileNotFoundError(f"{src} has no {name}: not a peft adapter saved with safetensors")
    root = Path(volume)
    root.mkdir(parents=True, exist_ok=True)
    final = root / version
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=root))
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copy2(src / name, tmp / name)
    if final.exists():
        shutil.rmtree(tmp)
        raise FileExistsError(f"adapter version {version} already exists in {root}")
    os.rename(tmp, final)
    return final


def merge_adapter(base_model: str | Path, adapter_dir: str | Path, out: str | Path) -> Path:
    """Write ``out``: the Hugging Face model folder ``base_model`` with the peft adapter ``adapter_dir``
    merged into its weights (each targeted weight plus the adapter's scaled product), in the base's
    own dtype, with the base's tokenizer and other files. An engine serves it with no LoRA layers
    (``max_loras=0``), which is cheaper per token than the base with the adapter applied at run time;
    the outputs are the same up to the dtype's rounding of one sum (exact enough in float32; in bf16
    the merged weights are rounded once more than the unmerged path's products). Written in a
    temporary sibling and renamed: a crash never leaves a half-written ``out``, and an existing
    ``out`` is refused."""
    # heavy: torch, peft and transformers; only merging an adapter needs them
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, src, final = Path(base_model), Path(adapter_dir), Path(out)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (src / name).is_file():
            raise FileNotFoundError(f"{src} has no {name}: not a peft adapter saved with safetensors")
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{base} has no config.json: not a Hugging Face model folder")
    if final.exists():
        raise FileExistsError(f"{final} exists: merged models are written once")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        with torch.no_grad():
            model = AutoModelForCausalLM.from_pretrained(str(base), dtype="auto")
            merged = PeftModel.from_pretrained(model, str(src)).merge_and_unload()
            merged.save_pretrained(str(tmp), safe_serialization=True)
        for item in base.iterdir():  # the tokenizer, chat template and anything else the base carries
            if item.is_file() and not (tmp / item.name).exists() and not item.name.endswith((".safetensors", ".bin", ".index.json")):
                shutil.copy2(item, tmp / item.name)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# --- sharded upload --------------------------------------------------------------------------------


def shard_adapter(adapter_dir: str | Path, num_shards: int) -> tuple[dict[str, Any], list[bytes]]:
    """The adapter config and ``num_shards`` safetensors blobs holding its tensors, balanced by size."""
    # heavy: torch (safetensors.torch); only sharding an adapter needs it
    from safetensors.torch import load_file, save

    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    src = Path(adapter_dir)
    config = json.loads((src / ADAPTER_CONFIG).read_text())
    tensors = load_file(str(src / ADAPTER_WEIGHTS))
    groups: list[dict[str, Any]] = [{} for _ in range(num_shards)]
    sizes = [0] * num_shards
    for name in sorted(tensors, key=lambda n: -tensors[n].numel()):
        i = sizes.index(min(sizes))
        groups[i][name] = tensors[name].contiguous()
        sizes[i] += tensors[name].numel()
    return config, [save(g) for g in groups]


def push_adapter(url: str, lora_name: str, adapter_dir: str | Path, *, num_shards: int = 4, pool=None,
                 credential: str | None = None) -> dict[str, Any]:
    """Send an adapter to one replica (or the capture sidecar) in parallel shards, then commit, with
    the trainer ``credential`` (this process's unless given), which the replica's adapter routes need."""
    # heavy: the HTTP layer (uvicorn, through serving.capture_store); only pushing an adapter needs it, and evals.evaluate imports this module for merge_adapter
    from serving.capture_store import trainer_headers
    from serving.client import HttpPool

    pool = pool or HttpPool()
    auth = trainer_headers(credential)
    config, blobs = shard_adapter(adapter_dir, num_shards)
    base = url.rstrip("/")

    def put(i: int) -> None:
        status, data, _ = pool.request(
            "PUT", f"{base}/lora_shards/{lora_name}/{i}?num_shards={len(blobs)}", blobs[i],
            headers={"Content-Type": "application/octet-stream", **auth})
        if status >= 300:
            raise RuntimeError(f"{base}: shard {i} of {lora_name}: HTTP {status}: {data.decode(errors='replace')}")

    with ThreadPoolExecutor(max_workers=len(blobs)) as ex:
        list(ex.map(put, range(len(blobs))))
    return pool.json("POST", f"{base}/commit_lora_adapter",
                     {"lora_name": lora_name, "num_shards": len(blobs), "adapter_config": config}, auth)


class ShardAssembler:
    """The receiving side of ``push_adapter``, kept by each replica's HTTP layer."""

    def __init__(self, staging_dir: str | Path | None = None):
        self._dir = Path(staging_dir) if staging_dir else None
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
        self._parts: dict[str, dict[int, bytes]] = {}
        self._expected: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def staging_dir(self) -> Path:
        """The folder given, or else one of the assembler's own, made at the first use (a replica
        that is never published to, or is killed before, leaves nothing behind) and removed with
        the assembler or when the process exits."""
        with self._lock:
            if self._dir is None:
                self._dir = Path(tempfile.mkdtemp(prefix="posttrain-adapters-"))
                weakref.finalize(self, shutil.rmtree, str(self._dir), ignore_errors=True)
            return self._dir

    def put(self, lora_name: str, index: int, num_shards: int, body: bytes) -> None:
        if num_shards < 1 or not 0 <= index < num_shards:
            raise BadRequest(f"shard_index {index} is outside 0..num_shards-1 (num_shards={num_shards})")
        if not body:
            raise BadRequest("shard body is empty: send the shard's tensors as safetensors bytes")
        with self._lock:
            expected = self._expected.setdefault(lora_name, num_shards)
            if expected != num_shards:
                raise BadRequest(f"num_shards {num_shards} differs from {expected} given by earlier shards of {lora_name!r}")
            self._parts.setdefault(lora_name, {})[index] = body

    def commit(self, lora_name: str, num_shards: Any, adapter_config: Any) -> Path:
        # heavy: torch (safetensors.torch); only committing an uploaded adapter needs it
        from safetensors.torch import load, save_file

        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise BadRequest(f"num_shards must be a positive integer, got {num_shards!r}")
        if not isinstance(adapter_config, dict) or "peft_type" not in adapter_config:
            raise BadRequest("adapter_config must be the adapter's adapter_config.json object (with peft_type)")
        with self._lock:
            parts = self._parts.get(lora_name, {})
            missing = [i for i in range(num_shards) if i not in parts]
            if missing or self._expected.get(lora_name) != num_shards:
                raise BadRequest(f"lora_name {lora_name!r}: shards {missing} of {num_shards} have not arrived")
            parts = self._parts.pop(lora_name)
            self._expected.pop(lora_name)
        tensors: dict[str, Any] = {}
        for i in range(num_shards):
            try:
                shard = load(parts[i])
            except Exception as exc:
                raise BadRequest(f"shard {i} of {lora_name!r} is not valid safetensors: {exc}") from exc
            overlap = set(shard) & set(tensors)
            if overlap:
                raise BadRequest(f"shard {i} of {lora_name!r} repeats tensors {sorted(overlap)[:3]}")
            tensors.update(shard)
        final = self.staging_dir / lora_name
        tmp = Path(tempfile.mkdtemp(prefix=f".{lora_name}.", dir=self.staging_dir))
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS))
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        return final
