"""bench/router.py's workload shapes: the agentic-coding ``long`` shape builds what it says."""

import importlib.util
import statistics
from argparse import Namespace
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "bench" / "router.py"
_spec = importlib.util.spec_from_file_location("bench_router", _PATH)
bench_router = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_router)


def _args(shape: str) -> Namespace:
    return Namespace(**{**bench_router.DEFAULTS, **bench_router.SHAPES[shape]}, group_size=8, seed=0, shape=shape)


def test_long_shape_shares_a_long_prompt_per_group_and_stays_under_the_ceiling():
    args = _args("long")
    assert args.tokens_per_gpu >= 100_000 and args.prompt_tokens == 4096
    assert any(spec.endswith("x8") for spec in args.replicas) and any(spec.endswith("x1") for spec in args.replicas)
    sessions = bench_router.make_workload(args)
    assert len(sessions) == args.sessions
    groups = {}
    for s in sessions:
        groups.setdefault(s["rid"].split("-")[0], []).append(s)
    assert all(len(g) == 8 and all(s["prompt"] is g[0]["prompt"] for s in g) for g in groups.values())
    assert all(len(s["prompt"]) == 4096 for s in sessions)
    assert 80 <= statistics.mean(len(s["obs"]) for s in sessions) <= 120
    obs = [len(o) for s in sessions for o in s["obs"]]
    assert min(obs) >= 75 and max(obs) <= 225 and 140 <= statistics.mean(obs) <= 160
    total, cacheable = bench_router.workload_ceiling(sessions, args.output_tokens)
    assert 0.98 < cacheable / total < 0.996  # the new tokens per call bound any router below 99.6%


def test_shapes_leave_the_existing_defaults_alone():
    for shape in ("agent", "short"):
        args = _args(shape)
        assert args.prompt_tokens == 512 and args.output_tokens == 16 and args.obs_tokens == 48
        assert args.replicas == ["56x1", "8x8"] and args.live_sessions == 128 and args.think_ms == 500.0
