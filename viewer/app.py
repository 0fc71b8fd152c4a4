"""The viewer's web app: server-rendered pages over one posttrain home, on Starlette.

``create_app(home)`` gives the ASGI app; ``python -m viewer`` serves it with uvicorn (``posttrain ui``
starts it beside the Dagster UI). Pages, each one request with its charts inline:

- ``/``: runs and evaluated checkpoints; ``/evals``: the checkpoints alone
- ``/runs/<run>``: curves by step, time per phase, ETA, the steps
- ``/runs/<run>/steps/<step>`` (or ``ready``): distributions, groups and rollouts; filters
  ``min_reward``, ``max_reward``, ``signal``, ``task``, ``status``
- ``/runs/<run>/rollouts/<id>``: each turn (prompt, actions, observations), the tokens with their
  mask and serving logprobs, reward, advantage, signals, stop reason, adapter step
- ``/evals/<checkpoint>``: the per-task table against the base model; filters ``task``, ``level``,
  ``flip`` (gained, lost, flipped), ``flawed``; ``run`` picks an eval run
- ``/evals/<checkpoint>/tasks/<task>`` and ``.../attempts/<n>``: attempts; one attempt's tests with
  their outcomes, committed diff, transcript, scores, signals and flawed marks
- ``/tensorboard``: a redirect to the TensorBoard that ``posttrain ui --tensorboard`` serves

Every route is a GET (and so HEAD): the viewer changes nothing, so there is no request whose Origin
would need checking. What it guards is who may read: a page the researcher visits on another site
can point its own name at 127.0.0.1 once loaded (DNS rebinding) and then read the viewer as its
own origin. The browser still sends that site's name in the Host header, so a request whose Host is
not one of the viewer's own names (``LOOPBACK_NAMES``, and the ``--host`` it serves on) is refused
(Starlette's ``TrustedHostMiddleware``: 400, "Invalid host header"). The port is not compared: a
rebinding page cannot send a loopback name whatever the port, and an SSH tunnel to another local
port (``ssh -L 8001:127.0.0.1:3001``) keeps working.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
from pathlib import Path
from typing import Any, Iterator, Sequence

import jinja2
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from viewer import charts, data, links
from viewer.templates import TEMPLATES

CURVES = (  # title -> step-row series drawn in it
    ("reward and solve rate", ("reward_mean", "solve_rate")),
    ("loss", ("loss",)),
    ("policy age (steps)", ("policy_age_mean", "policy_age_max")),
    ("zero-variance groups", ("zero_variance_groups",)),
    ("discarded samples", ("discarded_samples",)),
    ("tokens/s used", ("useful_tokens_per_s",)),
    ("canaries passed (the measured cheating rate)", ("canary_pass_rate",)),
)


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")  # the Host names a browser on this machine sends


def host_name(address: str) -> str:
    """``address`` (a name or an IP, as ``--host`` takes it) as it appears in a Host header: an IPv6
    address in brackets."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


class BadQuery(ValueError):
    """A query parameter that does not parse; the message names it and what was expected."""


def _date(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return dt.datetime.fromtimestamp(float(seconds)).strftime("%Y-%m-%d %H:%M:%S")


def _num(value: Any, fmt: str = "%.3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return fmt % value


def _float(request: Request, name: str) -> float | None:
    raw = request.query_params.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise BadQuery(f"query parameter {name!r}: expected a number, got {raw!r}") from None


def create_app(home: str | Path, *, tensorboard_url: str = "",
               allowed_hosts: Sequence[str] = LOOPBACK_NAMES) -> Starlette:
    """The viewer over the posttrain home ``home`` (its ``runs/``, ``evals/`` and ``datasets/``).

    It answers only requests whose Host header names one of ``allowed_hosts`` (any port); others get
    400 (see the module docstring: DNS rebinding)."""
    home = Path(home)
    env = jinja2.Environment(loader=jinja2.DictLoader(TEMPLATES), autoescape=True, undefined=jinja2.StrictUndefined)
    env.globals.update(num=_num, tensorboard=bool(tensorboard_url), home=str(home))

    def page(name: str, title: str, status: int = 200, **context: Any) -> HTMLResponse:
        return HTMLResponse(env.get_template(name).render(title=title, **context), status_code=status)

    def checkpoints_context() -> list[dict[str, Any]]:
        return [{"checkpoint": c, "runs": len(runs), "run_id": runs[0][0], "written": _date(runs[0][2]),
                 "link": links.checkpoint_path(c)} for c, runs in data.eval_runs(home).items()]

    async def index(request: Request) -> Response:
        runs = [{**r, "link": links.run_path(r["run"])} for r in data.list_runs(home)]
        return page("index", "runs", runs=runs, checkpoints=checkpoints_context())

    async def evals(request: Request) -> Response:
        return page("evals", "evals", checkpoints=checkpoints_context())

    async def run(request: Request) -> Response:
        name = request.path_params["run"]
        path = data.run_dir(home, name)
        steps = data.read_steps(path)
        of_steps = data.planned_steps(path)
        curves = [charts.lines({s: [(r["step"], float(r[s])) for r in steps if r.get(s) is not None] for s in series},
                               title) for title, series in CURVES]
        audit = data.read_audit(path)
        if audit:  # `posttrain audit RUN` wrote it: rewarded rollouts that a fresh draw of hidden inputs fails
            curves.append(charts.lines(
                {"wrong fixes that earned reward": [(r["step"], float(r["wrong_fixes"])) for r in audit["steps"]
                                                    if r["step"] is not None],
                 "rewarded rollouts graded again": [(r["step"], float(r["regraded"])) for r in audit["steps"]
                                                    if r["step"] is not None]},
                f"reward audit (hidden inputs of seed {audit.get('seed')})"))
        phases = data.run_phases(path)
        phase_chart = charts.stacked_bars([(f"step {s}", p) for s, p in phases.items()], "seconds per phase, by step")
        store_steps = [{**s, "link": links.step_path(name, s["step"]) if s["step"] != data.READY
                        else f"{links.run_path(name)}/steps/ready"} for s in data.store_steps(home, name)]
        eta = data.eta_s(steps, of_steps)
        checkpoints = [{"step": c.step, "link": links.checkpoint_path(f"{name}-{c.path.name}")}
                       for c in data.list_checkpoints(path)]
        return page("run", f"run {name}", run=name, steps=steps, of_steps=of_steps, curves=curves,
                    phases=phase_chart, store_steps=store_steps, eta=charts.duration(eta) if eta is not None else "",
                    checkpoints=checkpoints)

    async def step(request: Request) -> Response:
        name, raw = request.path_params["run"], request.path_params["step"]
        if raw != data.READY and not raw.isdigit():
            raise BadQuery(f"step {raw!r}: expected a step number or 'ready'")
        which: int | str = raw if raw == data.READY else int(raw)
        groups = data.step_groups(home, name, which)
        q = request.query_params
        shown = data.filter_rollouts(groups, min_reward=_float(request, "min_reward"),
                                     max_reward=_float(request, "max_reward"), signal=q.get("signal", ""),
                                     task=q.get("task", ""), status=q.get("status", ""))
        signals = sorted({s for g in groups for r in g.rollouts for s in r.signals})
        dists = data.distributions(shown)
        row = next((r for r in data.read_steps(data.run_dir(home, name)) if r["step"] == which), None)
        return page("step", f"{name} step {raw}", run=name, run_link=links.run_path(name), step=raw, groups=shown,
                    n_groups=len(shown), n_rollouts=sum(len(g.rollouts) for g in shown),
                    filtered=any(q.get(k) for k in ("min_reward", "max_reward", "signal", "task", "status")),
                    charts=[charts.histogram(v, t) for t, v in dists.items()], signals=signals, row=row,
                    q={k: q.get(k, "") for k in ("min_reward", "max_reward", "signal", "task", "status")},
                    link=lambda rid: links.rollout_path(name, rid))

    async def rollout(request: Request) -> Response:
        name, rid = request.path_params["run"], request.path_params["rollout"]
        detail = data.rollout_detail(home, name, rid)
        r = detail["rollout"]
        segments = [{"kind": s.kind, "turn": s.turn, "text": s.text, "tokens": s.tokens,
                     "mean_logprob": sum(t[2] for t in s.tokens) / max(len(s.tokens), 1)} for s in detail["segments"]]
        shown = {"turns", "stop_reason", "signals"}
        info = [(k, round(v, 3) if isinstance(v, float) else v) for k, v in sorted(r.info.items()) if k not in shown]
        return page("rollout", f"rollout {rid}", run=name, run_link=links.run_path(name), r=r,
                    step_link=links.step_path(name, r.status_step) if r.status_step is not None else "",
                    group_rewards=", ".join(f"{x:g}" for x in detail["group"].rewards), segments=segments,
                    tokens=detail["tokens"], trained=detail["trained_tokens"], created=_date(detail["created_s"]),
                    info=info)

    async def checkpoint(request: Request) -> Response:
        key = request.path_params["checkpoint"]
        q = request.query_params
        table = data.checkpoint_tasks(home, key, q.get("run", ""))
        rows = table["rows"]
        gained = sum(r["flip"] == "gained" for r in rows)
        lost = sum(r["flip"] == "lost" for r in rows)
        levels = sorted({r["level"] for r in rows})
        pass1 = sum(r["passes"] for r in rows) / max(sum(r["attempts"] for r in rows), 1)
        with_base = [r for r in rows if r["base_attempts"]]
        base_pass1 = sum(r["base_passes"] for r in with_base) / max(sum(r["base_attempts"] for r in with_base), 1)
        if q.get("task"):
            rows = [r for r in rows if q["task"] in r["task_id"]]
        if q.get("level"):
            rows = [r for r in rows if str(r["level"]) == q["level"]]
        if q.get("flip"):
            rows = [r for r in rows if (r["flip"] != "") if q["flip"] == "flipped" or r["flip"] == q["flip"]]
        if q.get("flawed"):
            rows = [r for r in rows if r["flawed"]]
        suffix = f"?run={q['run']}" if q.get("run") else ""
        rows = [{**r, "link": links.task_path(key, r["task_id"]) + suffix} for r in rows]
        return page("checkpoint", f"checkpoint {key}", checkpoint=key, run_id=table["run_id"], runs=table["runs"],
                    base=table["base"], base_run_id=table["base_run_id"],
                    base_link=links.checkpoint_path(table["base"]) if table["base"] else "", rows=rows,
                    q={k: q.get(k, "") for k in ("run", "task", "level", "flip", "flawed")},
                    levels=levels, gained=gained, lost=lost, pass1=pass1, base_pass1=base_pass1)

    async def task(request: Request) -> Response:
        key, task_id = request.path_params["checkpoint"], request.path_params["task"]
        run_id = request.query_params.get("run", "")
        detail = data.task_attempts(home, key, task_id, run_id)
        suffix = f"?run={run_id}" if run_id else ""
        base = detail["base"]
        return page("task", f"{task_id} at {key}", checkpoint=key, ckpt_link=links.checkpoint_path(key),
                    task_id=task_id, run_id=detail["run_id"], flawed=detail["flawed"], attempts=detail["attempts"],
                    base=base if detail["base_attempts"] else None, base_attempts=detail["base_attempts"],
                    link=lambda n: links.attempt_path(key, task_id, n) + suffix,
                    base_link=(lambda n: links.attempt_path(base, task_id, n)) if base else None)

    async def attempt(request: Request) -> Response:
        key, task_id, raw = (request.path_params[k] for k in ("checkpoint", "task", "attempt"))
        if not raw.isdigit():
            raise BadQuery(f"attempt {raw!r}: expected an attempt number")
        run_id = request.query_params.get("run", "")
        detail = data.attempt_detail(home, key, task_id, int(raw), run_id)
        return page("attempt", f"{task_id} attempt {raw}", ckpt_link=links.checkpoint_path(key),
                    task_link=links.task_path(key, task_id), **detail)

    async def tensorboard(request: Request) -> Response:
        if not tensorboard_url:
            return page("not_found", "no TensorBoard", status=404,
                        message="no TensorBoard is served: start it with `posttrain ui --tensorboard`")
        return RedirectResponse(tensorboard_url, status_code=307)

    async def not_found(request: Request, exc: Exception) -> Response:
        return page("not_found", "not found", status=404, message=str(exc))

    async def bad_query(request: Request, exc: Exception) -> Response:
        return page("not_found", "bad request", status=400, message=str(exc))

    run_part = "{run:str}"
    routes = [
        Route("/", index), Route("/evals", evals),
        Route(f"/runs/{run_part}", run), Route(f"/runs/{run_part}/steps/{{step:str}}", step),
        Route(f"/runs/{run_part}/rollouts/{{rollout:str}}", rollout),
        Route("/evals/{checkpoint:str}", checkpoint), Route("/evals/{checkpoint:str}/tasks/{task:str}", task),
        Route("/evals/{checkpoint:str}/tasks/{task:str}/attempts/{attempt:str}", attempt),
        Route("/tensorboard", tensorboard),
    ]
    hosts = [host_name(h) for h in allowed_hosts]
    return Starlette(routes=routes, exception_handlers={data.NotFound: not_found, BadQuery: bad_query},
                     middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts, www_redirect=False)])


@contextlib.contextmanager
def serve_in_thread(home: str | Path, *, port: int = 0, tensorboard_url: str = "") -> Iterator[str]:
    """The viewer over ``home`` served by uvicorn on 127.0.0.1 (``port`` 0: a free one) in a thread of
    this process, for the length of the block; yields its base URL. Tests and benches use it."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(create_app(home, tensorboard_url=tensorboard_url), log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="viewer", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the viewer's server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
