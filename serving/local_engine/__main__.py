"""The local engine as a process, listening on 127.0.0.1 unless told otherwise:

    python -m serving.local_engine --model PATH --host 127.0.0.1 --port 30000 \\
        [--max-total-tokens 65536] [--max-running-requests 64] [--lora NAME=DIR ...] \\
        [--adapters-dir DIR] [--exit-with-parent]

loads the model (and the adapters named, and the newest of ``--adapters-dir``), then serves SGLang's
native API (``/generate``, ``/load_lora_adapter``, ``/server_info``, ``/metrics``) until interrupted.
A replica (``python -m serving.replica --engine local``) starts it as its child.
"""

from __future__ import annotations

import argparse

from serving.adapters import newest_adapter
from serving.http import HttpLimits, serve
from serving.local_engine.engine import LocalEngine
from serving.replica import exit_with_parent


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a transformers model directory (save_pretrained)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--max-total-tokens", type=int, default=65536, help="KV token budget (SGLang's max_total_num_tokens)")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16, help="prefix cache block (page) size in tokens")
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=DIR", help="load an adapter at start")
    parser.add_argument("--adapters-dir", default=None,
                        help="shared volume of published adapters (<dir>/<version>/); the newest is loaded before serving")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="shut down when the process that started this one dies (local replicas of a trainer)")
    parser.add_argument("--http-idle-timeout-s", type=float, default=None,
                        help="close a kept-alive client connection after this long without a request (default: 60)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.local_engine", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if args.exit_with_parent:
        exit_with_parent()
    engine = LocalEngine(args.model, max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running_requests,
                         block_size=args.block_size, torch_threads=args.torch_threads)
    for spec in args.lora:
        name, _, path = spec.partition("=")
        engine.load_lora_adapter(name, path)
    if args.adapters_dir:
        newest = newest_adapter(args.adapters_dir)
        if newest is not None and newest[0] not in engine.adapters():
            engine.load_lora_adapter(*newest)
    limits = HttpLimits() if args.http_idle_timeout_s is None else HttpLimits(idle_timeout_s=args.http_idle_timeout_s)
    server = serve(engine, host=args.host, port=args.port, limits=limits)
    return server.run_in_foreground(f"engine serving {args.model} on {server.url}")


if __name__ == "__main__":
    raise SystemExit(main())
