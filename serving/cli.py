"""``posttrain`` commands of the serving package.

    posttrain serving replica --model DIR [--engine vllm|local] [--port 30000]   # a replica (python -m serving.replica)
    posttrain serving engine --model DIR [--port 30000]       # the local CPU engine (python -m serving.local_engine)
    posttrain serving router --worker URL[@POOL:GPUS] ...     # the router (python -m serving.router)
    posttrain serving sidecar --upstream URL --engine sglang  # the capture front of an engine (python -m serving.capture)
    posttrain serving tiny-model OUT [--adapter OUT2]         # a tiny random Qwen2 + tokenizer (+ LoRA adapter)
    posttrain serving sglang-args KNOBS.json                  # SGLang server arguments from resolved plan knobs
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from sandboxes.files import read_regular_bytes
from serving import capture, replica
from serving.local_engine import __main__ as local_engine_main
from serving.router import __main__ as router_main
from serving.sglang import sglang_server_args
from serving.tiny import build_tiny_lora_adapter, build_tiny_model


def _tiny(args: argparse.Namespace) -> int:
    path = build_tiny_model(args.out, hidden_size=args.hidden_size, num_layers=args.layers, vocab_size=args.vocab_size,
                            num_heads=args.heads, num_kv_heads=1)
    print(f"tiny model: {path}")
    if args.adapter:
        print(f"tiny LoRA adapter: {build_tiny_lora_adapter(path, args.adapter)}")
    return 0


def _sglang_args(args: argparse.Namespace) -> int:
    try:
        knobs = json.loads(read_regular_bytes(args.knobs))  # a FIFO is refused, never waited on
        print(shlex.join(["python3", "-m", "sglang.launch_server", *sglang_server_args(knobs, host=args.host, port=args.port)]))
    except (OSError, ValueError) as exc:
        print(f"posttrain serving sglang-args: {args.knobs}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 2
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this package's commands to the ``posttrain`` parser."""
    serving = sub.add_parser("serving", help="inference engines, the router, capture, tiny models")
    cmds = serving.add_subparsers(dest="serving_command", required=True)

    for name, module, text in (("replica", replica, "run a replica: vLLM (or the local engine) behind the capture front "
                                                            "(as python -m serving.replica)"),
                               ("engine", local_engine_main, "run the local CPU engine (as python -m serving.local_engine)"),
                               ("router", router_main, "run the router (as python -m serving.router)"),
                               ("sidecar", capture, "run the capture front of an engine server (as python -m serving.capture)")):
        p = cmds.add_parser(name, help=text)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    tiny = cmds.add_parser("tiny-model", help="build a tiny random Qwen2 model and tokenizer (no download)")
    tiny.add_argument("out")
    tiny.add_argument("--adapter", help="also build a random LoRA adapter here")
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--heads", type=int, default=2, help="attention heads; hidden / heads must be 32, 64, ... for vLLM on CPU")
    tiny.add_argument("--vocab-size", type=int, default=512)
    tiny.set_defaults(func=_tiny)
    sg = cmds.add_parser("sglang-args", help="print the SGLang launch command for resolved plan knobs (JSON)")
    sg.add_argument("knobs")
    sg.add_argument("--host", default="0.0.0.0")
    sg.add_argument("--port", type=int, default=30000)
    sg.set_defaults(func=_sglang_args)
