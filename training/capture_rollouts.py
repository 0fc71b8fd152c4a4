"""An episode's rollout from what the replicas captured, not from the scaffold's own copy.

Every model call of an episode goes through a replica that records the exact prompt ids the engine
saw, the ids it produced and their log-probabilities (:mod:`serving.capture_store`; chat calls:
:mod:`serving.chat`). The trainer reads a session's calls back (``GET /sessions/{id}`` on the router
or the replica, :func:`fetch_session`) and builds the rollout from them (:func:`rollout_from_capture`),
so a scaffold that re-tokenizes text, drops a turn or rewrites history cannot make the trainer learn
from tokens the model never produced.

**Re-tokenization drift.** A multi-turn chat sends the whole history every turn and the engine renders
and tokenizes it again. Turn ``t+1``'s prompt ids should start with turn ``t``'s prompt and output
ids; they do not when the re-rendered history differs from what was sampled (a tool call's JSON
written back with other spacing, an answer cut at a stop string, a byte-level BPE merging across the
boundary, a scaffold that edits or summarizes history). Such a turn *drifts*.

**Policy** (``drift_policy``):

- ``"mask"`` (the default): the rollout is the last call's prompt and output, the context the model
  last saw. A turn is trained (loss mask 1, its logprobs kept) when its prompt and output are exactly
  a prefix of that sequence: its tokens are there, conditioned on exactly what the model saw. A
  drifted turn's tokens stay in the sequence as context with mask 0: the tokens there are the
  re-rendered ones, not the sampled ones, and their sampled logprobs do not belong to them. The
  reward still applies to every trained turn. ``info["drift_turns"]`` counts turns whose prompt did
  not extend the turn before, ``info["untrained_turns"]`` turns left out of the loss, and
  ``info["drift"]`` flags the rollout.
- ``"drop"``: a rollout with any drift raises :class:`CaptureDrift`: no data beats skewed data when
  a run must be exactly on-policy.

The run's metric is the sum of ``drift_turns`` over rollouts (:func:`drift_metrics`).

Calls that are not complete (a stream the client cut short), whose logprobs do not name their
tokens (``consistent`` false), or whose adapter version differs from the session's first call are
never trained.
"""

from __future__ import annotations

import json
from typing import Any, Iterable
from urllib.parse import quote

from training.rollout import Rollout

DRIFT_POLICIES = ("mask", "drop")


class CaptureDrift(ValueError):
    """A session whose turns do not extend each other, under ``drift_policy = "drop"``."""


class CaptureMissing(ValueError):
    """A session with no trainable captured call."""


def fetch_session(url: str, session_id: str, *, timeout_s: float = 60.0,
                  credential: str | None = None) -> list[dict[str, Any]]:
    """A session's captured calls, in order, from a router or a replica (``GET /sessions/{id}``),
    read with the trainer ``credential`` (this process's unless given: the one its replicas got)."""
    # heavy: the HTTP layer (uvicorn, through serving.capture_store); only fetching a session needs it
    from serving.capture_store import trainer_headers
    from serving.client import HttpPool

    status, data, _ = HttpPool(timeout_s).request("GET", f"{url.rstrip('/')}/sessions/{quote(session_id, safe='')}",
                                                  headers=trainer_headers(credential))
    if status == 404:
        return []
    if status != 200:
        raise CaptureMissing(f"session {session_id!r}: {url} answered HTTP {status}: {data[:200].decode(errors='replace')}")
    calls = json.loads(data).get("calls", [])
    calls.sort(key=lambda c: (c.get("started_at", 0.0), c.get("call_index", 0)))
    return calls


def _usable(call: dict[str, Any]) -> bool:
    return (call.get("complete", True) and call.get("consistent", True) and bool(call.get("input_ids"))
            and len(call.get("output_logprobs") or []) == len(call.get("output_ids") or []))


def rollout_from_capture(calls: Iterable[dict[str, Any]], *, rollout_id: str, group_id: str, task_id: str,
                         adapter_step: int, reward: float, drift_policy: str = "mask",
                         info: dict[str, Any] | None = None) -> Rollout:
    """The rollout of one session's captured calls (see the module docstring for the drift policy)."""
    if drift_policy not in DRIFT_POLICIES:
        raise ValueError(f"drift_policy must be one of {DRIFT_POLICIES}, got {drift_policy!r}")
    calls = list(calls)
    usable = [c for c in calls if _usable(c)]
    if usable:
        version = usable[0].get("lora_path")
        usable = [c for c in usable if c.get("lora_path") == version]
    if not usable:
        raise CaptureMissing(f"rollout {rollout_id}: no complete captured call to train on ({len(calls)} captured)")
    last = usable[-1]
    ids = list(last["input_ids"]) + list(last["output_ids"])
    mask = [0] * len(ids)
    logprobs = [0.0] * len(ids)
    drift_turns = 0
    untrained = 0
    previous: list[int] | None = None
    for call in usable:
        prompt, output = list(call["input_ids"]), list(call["output_ids"])
        if previous is not None and prompt[:len(previous)] != previous:
            drift_turns += 1
        previous = prompt + output
        start = len(prompt)
        if ids[:start + len(output)] != previous:
            untrained += 1
            continue
        for j, lp in enumerate(call["output_logprobs"]):
            mask[start + j] = 1
            logprobs[start + j] = float(lp)
    if drift_turns and drift_policy == "drop":
        raise CaptureDrift(f"rollout {rollout_id}: {drift_turns} of {len(usable)} turns do not extend the turn "
                           "before (re-tokenization drift); dropped under drift_policy 'drop'")
    return Rollout(
        rollout_id=rollout_id, group_id=group_id, task_id=task_id, adapter_step=adapter_step, input_ids=ids,
        loss_mask=mask, serving_logprobs=logprobs, reward=reward,
        info={**(info or {}), "source": "capture", "turns": len(usable), "captured_calls": len(calls),
              "drift": bool(drift_turns), "drift_turns": drift_turns, "untrained_turns": untrained,
              "drift_policy": drift_policy},
    )


def drift_metrics(rollouts: Iterable[Rollout]) -> dict[str, float]:
    """The run's drift figures over ``rollouts``: turns that drifted, rollouts flagged, turns untrained."""
    rows = [r.info for r in rollouts if r.info.get("source") == "capture"]
    return {
        "capture_drift_turns": float(sum(int(i.get("drift_turns", 0)) for i in rows)),
        "capture_drift_rollouts": float(sum(1 for i in rows if i.get("drift"))),
        "capture_untrained_turns": float(sum(int(i.get("untrained_turns", 0)) for i in rows)),
        "capture_rollouts": float(len(rows)),
    }
