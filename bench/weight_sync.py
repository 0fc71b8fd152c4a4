"""Weight publication: how long one adapter version takes to reach a live replica over sharded HTTP,
compared, in the same run, with writing it to the shared volume and reading it back, and with the raw
loopback bandwidth of one TCP stream.

Adapters are LoRA on every projection (q, k, v, o, gate, up, down) of a realistic model shape
(default: Qwen2.5-1.5B, 28 layers, hidden 1536, MLP 8960, 2 KV heads of 128; ``--shape 7b`` for
Qwen2.5-7B), in bf16, ranks 8 to 64. Publication is :class:`training.publish.AdapterPublisher` with
``--streams`` parallel shards to a receiver on loopback that runs the replica's own receiving code
(:class:`serving.adapters.ShardAssembler`: shards checked, assembled, written as a peft folder); the
model load into the engine is left out because the base weights of this shape are not on this machine.
Volume: the same adapter copied to a volume folder with fsync (``publish_to_volume``) then read back
and parsed (what a replica joining late does). Loopback: the same bytes over one socket.

    .venv/bin/python bench/weight_sync.py [--ranks 8,16,32,64] [--streams 4] [--shape 1.5b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from serving.adapters import ShardAssembler, publish_to_volume
from serving.http import JsonServer
from training.publish import AdapterPublisher

SHAPES = {
    "1.5b": {"layers": 28, "hidden": 1536, "mlp": 8960, "kv": 256},
    "7b": {"layers": 28, "hidden": 3584, "mlp": 18944, "kv": 512},
}


def write_adapter(path: Path, shape: dict, rank: int) -> int:
    h, m, kv = shape["hidden"], shape["mlp"], shape["kv"]
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)}
    tensors = {}
    for layer in range(shape["layers"]):
        for name, (din, dout) in dims.items():
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, din, dtype=torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(dout, rank, dtype=torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "task_type": "CAUSAL_LM",
        "target_modules": sorted(dims)}))
    return (path / "adapter_model.safetensors").stat().st_size


def receiver(staging: Path):
    shards = ShardAssembler(staging)

    def put(req):
        shards.put(req.params[0], int(req.params[1]), int(req.query["num_shards"][0]), req.body)
        return {"success": True}

    def commit(req):
        body = req.json()
        return {"success": True, "lora_path": str(shards.commit(body["lora_name"], body["num_shards"], body["adapter_config"]))}

    return JsonServer({("PUT", "/lora_shards/"): put, ("POST", "/commit_lora_adapter"): commit}).start()


def loopback_s(data: bytes) -> float:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    got = []

    def sink() -> None:
        conn, _ = listener.accept()
        n = 0
        while n < len(data):
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            n += len(chunk)
        conn.sendall(b"k")
        conn.close()
        got.append(n)

    t = threading.Thread(target=sink)
    t.start()
    client = socket.create_connection(listener.getsockname())
    started = time.perf_counter()
    client.sendall(data)
    client.recv(1)
    elapsed = time.perf_counter() - started
    client.close()
    t.join()
    listener.close()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,16,32,64")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"shape {args.shape} {SHAPES[args.shape]}, LoRA on 7 projections, bf16, {args.streams} streams, "
          f"median of {args.repeats}")
    print(f"{'rank':>4} {'MiB':>8} {'publish_s':>10} {'volume_w+r_s':>13} {'loopback_s':>11} "
          f"{'publish/volume':>15} {'publish/loopback':>17} {'publish_MiB/s':>14}")
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        tmp = Path(tmp)
        server = receiver(tmp / "replica")
        publisher = AdapterPublisher(None, [server.url], streams=args.streams, keep_versions=1 << 30)
        step = 0
        for rank in [int(r) for r in args.ranks.split(",")]:
            src = tmp / f"r{rank}"
            size = write_adapter(src, SHAPES[args.shape], rank)
            data = (src / "adapter_model.safetensors").read_bytes()
            pub, vol, loop = [], [], []
            for _ in range(args.repeats):
                step += 1
                pub.append(publisher.publish(step, src).http_s)
                started = time.perf_counter()
                dest = publish_to_volume(src, tmp / "volume", f"step_{step:06d}")
                with open(dest / "adapter_model.safetensors", "rb") as fh:
                    os.fsync(fh.fileno())
                load_file(str(dest / "adapter_model.safetensors"))
                vol.append(time.perf_counter() - started)
                loop.append(loopback_s(data))
            p, v, lb = statistics.median(pub), statistics.median(vol), statistics.median(loop)
            mib = size / 2**20
            print(f"{rank:>4} {mib:>8.1f} {p:>10.3f} {v:>13.3f} {lb:>11.3f} {p / v:>15.2f} {p / lb:>17.2f} {mib / p:>14.1f}",
                  flush=True)
        server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
