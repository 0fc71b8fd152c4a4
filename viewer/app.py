"""The viewer's web app: server-rendered pages over one posttrain home, on Starlette.

``create_app(home)`` gives the ASGI app; ``python -m viewer`` serves it with uvicorn (``posttrain ui``
starts it beside the Dagster UI). Pages, each one request with its charts inline:

- ``/``: runs and evaluated checkpoints; ``/evals``: the checkpoints alone
- ``/runs/<run>``: curves by step (trainer, per level, per integrity signal, reward against response
  length), time per phase, ETA, the steps (rollouts consumed and discarded apart)
- ``/runs/<run>/steps/<step>`` (or ``ready``): distributions, groups and rollouts; filters
  ``min_reward``, ``max_reward``, ``signal``, ``task``, ``status``
- ``/runs/<run>/rollouts/<id>``: each turn (prompt, actions, observations), the tokens with their
  mask and serving logprobs, reward, advantage, signals, stop reason, adapter step
- ``/evals/<checkpoint>``: pass@1 with 95% intervals, overall and per level, and the per-task table
  against the run's base model or ``against`` any other checkpoint (paired change, flips); filters
  ``task``, ``level``, ``flip`` (gained, lost, flipped), ``flawed``; ``run`` picks an eval run
- ``/evals/<checkpoint>/tasks/<task>`` and ``.../attempts/<n>``: attempts; one attempt's tests with
  their outcomes, committed diff, transcript, scores, signals and flawed marks
- ``/compare?runs=a,b``: the step curves of several runs overlaid; ``/compare/evals?a=..&b=..``: the
  checkpoint page of ``a`` against ``b``
- ``/find``: rollouts of a run (``run``) or eval attempts (``checkpoint``, or every checkpoint) whose
  text matches ``q`` (``regex=1``: a regular expression), with filters
- ``/tensorboard``: a redirect to the TensorBoard that ``posttrain ui --tensorboard`` serves

Take away: every page with a table answers ``?format=json`` (and ``?format=csv`` for its table), a
rollout and an attempt ``?format=json``: the JSON API of docs/viewer.md. Live: the run, step and
checkpoint-list pages of a run still training poll ``/runs/<run>/version`` and reload when it moves.

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
import csv
import datetime as dt
import io
import json
import math
from pathlib import Path
from typing import Any, Iterator, Sequence
from urllib.parse import urlencode

import jinja2
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from viewer import charts, data, links
from viewer.templates import TEMPLATES

CURVES = (  # title -> step-row series drawn in it
    ("reward and solve rate (rollouts trained on)", ("reward_mean", "solve_rate")),
    ("loss", ("loss",)),
    ("policy age (steps)", ("policy_age_mean", "policy_age_max")),
    ("zero-variance groups", ("zero_variance_groups",)),
    ("discarded samples", ("discarded_samples",)),
    ("tokens/s used", ("useful_tokens_per_s",)),
    ("canaries passed (the measured cheating rate)", ("canary_pass_rate",)),
)
COMPARED = ("reward_mean", "solve_rate", "loss", "policy_age_mean", "discarded_samples", "useful_tokens_per_s",
            "canary_pass_rate")  # the step series /compare overlays
VENDOR = Path(__file__).resolve().parent / "vendor"
FORMATS = ("html", "json", "csv")


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


def _format(request: Request) -> str:
    fmt = request.query_params.get("format", "html") or "html"
    if fmt not in FORMATS:
        raise BadQuery(f"query parameter 'format': expected one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def plain(value: Any) -> Any:
    """``value`` as JSON takes it: NaN as null, dataclasses (an interval) as dicts, tuples as lists."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return plain(dict(vars(value)))
    if hasattr(value, "item"):
        return plain(value.item())
    return value


def json_response(payload: Any) -> Response:
    return JSONResponse(plain(payload))


def csv_response(rows: Sequence[dict[str, Any]], filename: str) -> Response:
    """``rows`` as CSV (the union of their keys, in order of appearance; lists joined by commas)."""
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ",".join(map(str, v)) if isinstance(v, (list, tuple)) else plain(v) for k, v in r.items()})
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in filename)
    return Response(out.getvalue(), media_type="text/csv; charset=utf-8",
                    headers={"Content-Disposition": f'attachment; filename="{safe}.csv"'})


def pretty_json(value: Any) -> str:
    """JSON as a reader wants it: indented, characters as they are (no ``\u003e`` escapes; the
    page's autoescape makes it safe in HTML)."""
    return json.dumps(value, indent=1, ensure_ascii=False, default=str)


def create_app(home: str | Path, *, tensorboard_url: str = "",
               allowed_hosts: Sequence[str] = LOOPBACK_NAMES) -> Starlette:
    """The viewer over the posttrain home ``home`` (its ``runs/``, ``evals/`` and ``datasets/``).

    It answers only requests whose Host header names one of ``allowed_hosts`` (any port); others get
    400 (see the module docstring: DNS rebinding)."""
    home = Path(home)
    env = jinja2.Environment(loader=jinja2.DictLoader(TEMPLATES), autoescape=True, undefined=jinja2.StrictUndefined)
    env.globals.update(num=_num, tensorboard=bool(tensorboard_url), home=str(home), duration=charts.duration)
    env.filters["pretty_json"] = pretty_json

    def page(name: str, title: str, status: int = 200, **context: Any) -> HTMLResponse:
        context.setdefault("live", "")
        context.setdefault("exports", [])
        return HTMLResponse(env.get_template(name).render(title=title, **context), status_code=status)

    def exports(request: Request, *formats: str) -> list[tuple[str, str]]:
        """Links to this page's data in each of ``formats``, with its filters."""
        query = {k: v for k, v in request.query_params.items() if k != "format"}
        return [(f, f"{request.url.path}?{urlencode({**query, 'format': f})}") for f in formats]

    def checkpoints_context() -> list[dict[str, Any]]:
        return [{"checkpoint": c, "runs": len(runs), "run_id": runs[0][0], "written": _date(runs[0][2]),
                 "link": links.checkpoint_path(c)} for c, runs in data.eval_runs(home).items()]

    def runs_context() -> list[dict[str, Any]]:
        out = []
        for r in data.list_runs(home):
            finished = data.run_finished([{"step": r["last_step"]}] if r["steps"] else [], r["of_steps"])
            out.append({**r, "link": links.run_path(r["run"]), "finished": finished})
        return out

    async def index(request: Request) -> Response:
        runs, checkpoints = runs_context(), checkpoints_context()
        if _format(request) == "json":
            return json_response({"runs": runs, "checkpoints": checkpoints})
        return page("index", "runs", runs=runs, checkpoints=checkpoints, exports=exports(request, "json"))

    async def evals(request: Request) -> Response:
        checkpoints = checkpoints_context()
        fmt = _format(request)
        if fmt == "json":
            return json_response({"checkpoints": checkpoints})
        if fmt == "csv":
            return csv_response(checkpoints, "checkpoints")
        return page("evals", "evals", checkpoints=checkpoints, exports=exports(request, "json", "csv"))

    def live_script(name: str, finished: bool) -> str:
        return "" if finished else links.run_path(name) + "/version"

    async def run(request: Request) -> Response:
        name = request.path_params["run"]
        path = data.run_dir(home, name)
        steps = data.read_steps(path)
        of_steps = data.planned_steps(path)
        finished = data.run_finished(steps, of_steps)
        store_steps = [{**s, "link": links.step_path(name, s["step"]) if s["step"] != data.READY
                        else f"{links.run_path(name)}/steps/ready"} for s in data.store_steps(home, name)]
        eta = None if finished else data.eta_s(steps, of_steps)
        checkpoints = [{"step": c.step, "link": links.checkpoint_path(f"{name}-{c.path.name}")}
                       for c in data.list_checkpoints(path)]
        fmt = _format(request)
        if fmt == "json":
            return json_response({"run": name, "of_steps": of_steps, "finished": finished, "eta_s": eta,
                                  "steps": steps, "store_steps": store_steps, "checkpoints": checkpoints,
                                  "version": data.run_version(home, name)})
        if fmt == "csv":
            table = request.query_params.get("table", "steps")
            if table not in ("steps", "store_steps"):
                raise BadQuery(f"query parameter 'table': expected steps or store_steps, got {table!r}")
            return csv_response(steps if table == "steps" else store_steps, f"{name}-{table}")
        curves = [charts.plot({s: [(r["step"], float(r[s])) for r in steps if r.get(s) is not None] for s in series},
                              title) for title, series in CURVES]
        rollout_curves = data.rollout_curves(home, name)
        if rollout_curves["levels"]:
            curves.append(charts.plot({f"level {lv}": pts for lv, pts in rollout_curves["levels"].items()},
                                      "solve rate per level (rollouts trained on)"))
        integrity = sorted({k for r in steps for k in r if k.startswith("integrity_")})
        if integrity:
            curves.append(charts.plot({k.removeprefix("integrity_"): [(r["step"], float(r[k])) for r in steps
                                                                      if r.get(k) is not None] for k in integrity},
                                      "integrity gate: attempts caught, in all and per signal"))
        if rollout_curves["length_reward"]:
            curves.append(charts.plot({"rollouts trained on": [(t, r) for t, r in rollout_curves["length_reward"]]},
                                      "reward against response length", x_label="response tokens", scatter=True))
        audit = data.read_audit(path)
        if audit:  # `posttrain audit RUN` wrote it: rewarded rollouts that a fresh draw of hidden inputs fails
            curves.append(charts.plot(
                {"wrong fixes that earned reward": [(r["step"], float(r["wrong_fixes"])) for r in audit["steps"]
                                                    if r["step"] is not None],
                 "rewarded rollouts graded again": [(r["step"], float(r["regraded"])) for r in audit["steps"]
                                                    if r["step"] is not None]},
                f"reward audit (hidden inputs of seed {audit.get('seed')})"))
        phases = data.run_phases(path)
        phase_chart = charts.stacked_bars([(f"step {s}", p) for s, p in phases.items()], "seconds per phase, by step")
        return page("run", f"run {name}", run=name, steps=steps, of_steps=of_steps, curves=curves, finished=finished,
                    phases=phase_chart, store_steps=store_steps, eta=charts.duration(eta) if eta is not None else "",
                    checkpoints=checkpoints, live=live_script(name, finished),
                    version=data.run_version(home, name), compare_link=f"/compare?runs={name}",
                    exports=exports(request, "json", "csv") + [("csv of the store's steps",
                                                                f"{request.url.path}?format=csv&table=store_steps")])

    async def version(request: Request) -> Response:
        name = request.path_params["run"]
        path = data.run_dir(home, name)
        return json_response({"run": name, "version": data.run_version(home, name),
                              "finished": data.run_finished(data.read_steps(path), data.planned_steps(path))})

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
        fmt = _format(request)
        rollouts = [{"rollout_id": r.rollout_id, "group_id": g.group_id, "task_id": r.task_id,
                     "adapter_step": r.adapter_step, "status": r.status, "status_step": r.status_step,
                     "reward": r.reward, "advantage": r.advantage, "generated_tokens": r.generated_tokens,
                     "total_tokens": r.total_tokens, "turns": r.turns, "stop_reason": r.info.get("stop_reason", ""),
                     "signals": r.signals} for g in shown for r in g.rollouts]
        if fmt == "json":
            return json_response({"run": name, "step": raw, "rollouts": rollouts})
        if fmt == "csv":
            return csv_response(rollouts, f"{name}-step-{raw}")
        signals = sorted({s for g in groups for r in g.rollouts for s in r.signals})
        statuses = {s: n for s in ("consumed", "discarded", "ready")
                     if (n := sum(r.status == s for g in shown for r in g.rollouts))}
        # the histograms describe what the step trained on: discarded (stale) rollouts apart
        trained = data.filter_rollouts(shown, status="consumed") if not q.get("status") else shown
        discarded = data.filter_rollouts(shown, status="discarded") if not q.get("status") else []
        dists = data.distributions(trained)
        hists = [charts.histogram(v, t + ("" if q.get("status") else " · trained on")) for t, v in dists.items()]
        if discarded:
            hists.append(charts.histogram([r.reward for g in discarded for r in g.rollouts],
                                          "reward · discarded as stale (not trained on)"))
        row = next((r for r in data.read_steps(data.run_dir(home, name)) if r["step"] == which), None)
        path = data.run_dir(home, name)
        finished = data.run_finished(data.read_steps(path), data.planned_steps(path))
        return page("step", f"{name} step {raw}", run=name, run_link=links.run_path(name), step=raw, groups=shown,
                    n_groups=len(shown), n_rollouts=sum(len(g.rollouts) for g in shown), statuses=statuses,
                    filtered=any(q.get(k) for k in ("min_reward", "max_reward", "signal", "task", "status")),
                    charts=hists, signals=signals, row=row,
                    q={k: q.get(k, "") for k in ("min_reward", "max_reward", "signal", "task", "status")},
                    link=lambda rid: links.rollout_path(name, rid), live=live_script(name, finished or raw != data.READY),
                    version=data.run_version(home, name), exports=exports(request, "json", "csv"))

    async def rollout(request: Request) -> Response:
        name, rid = request.path_params["run"], request.path_params["rollout"]
        detail = data.rollout_detail(home, name, rid)
        r = detail["rollout"]
        segments = [{"kind": s.kind, "turn": s.turn, "text": s.text, "tokens": s.tokens,
                     "mean_logprob": sum(t[2] for t in s.tokens) / max(len(s.tokens), 1)} for s in detail["segments"]]
        if _format(request) == "json":
            return json_response({
                "run": name, "rollout": {**vars(r), "turns": r.turns, "signals": r.signals},
                "group_rewards": detail["group"].rewards, "created_s": detail["created_s"],
                "tokens": detail["tokens"], "trained_tokens": detail["trained_tokens"],
                "segments": [{"kind": s["kind"], "turn": s["turn"], "text": s["text"],
                              "tokens": [{"id": t[0], "text": t[1], "logprob": t[2],
                                          "trained": s["kind"] == "action"} for t in s["tokens"]]} for s in segments]})
        shown = {"turns", "stop_reason", "signals"}
        info = [(k, round(v, 3) if isinstance(v, float) else v) for k, v in sorted(r.info.items()) if k not in shown]
        return page("rollout", f"rollout {rid}", run=name, run_link=links.run_path(name), r=r,
                    step_link=links.step_path(name, r.status_step) if r.status_step is not None else "",
                    group_rewards=", ".join(f"{x:g}" for x in detail["group"].rewards), segments=segments,
                    tokens=detail["tokens"], trained=detail["trained_tokens"], created=_date(detail["created_s"]),
                    info=info, exports=exports(request, "json"))

    async def checkpoint(request: Request) -> Response:
        key = request.path_params["checkpoint"]
        q = request.query_params
        table = data.checkpoint_tasks(home, key, q.get("run", ""), against=q.get("against") or None,
                                      against_run=q.get("against_run", ""))
        rows = table["rows"]
        gained = sum(r["flip"] == "gained" for r in rows)
        lost = sum(r["flip"] == "lost" for r in rows)
        levels = sorted({r["level"] for r in rows})
        if q.get("task"):
            rows = [r for r in rows if q["task"] in r["task_id"]]
        if q.get("level"):
            rows = [r for r in rows if str(r["level"]) == q["level"]]
        if q.get("flip"):
            rows = [r for r in rows if (r["flip"] != "") if q["flip"] == "flipped" or r["flip"] == q["flip"]]
        if q.get("flawed"):
            rows = [r for r in rows if r["flawed"]]
        fmt = _format(request)
        if fmt == "json":
            return json_response({k: table[k] for k in ("checkpoint", "run_id", "base", "base_run_id", "runs",
                                                        "summary")} | {"rows": rows})
        if fmt == "csv":
            return csv_response(rows, f"{key}-against-{table['base'] or 'none'}")
        suffix = f"?run={q['run']}" if q.get("run") else ""
        rows = [{**r, "link": links.task_path(key, r["task_id"]) + suffix} for r in rows]
        return page("checkpoint", f"checkpoint {key}", checkpoint=key, run_id=table["run_id"], runs=table["runs"],
                    base=table["base"], base_run_id=table["base_run_id"], summary=table["summary"],
                    base_link=links.checkpoint_path(table["base"]) if table["base"] else "", rows=rows,
                    q={k: q.get(k, "") for k in ("run", "task", "level", "flip", "flawed", "against")},
                    levels=levels, gained=gained, lost=lost, checkpoints=table["checkpoints"],
                    exports=exports(request, "json", "csv"))

    async def task(request: Request) -> Response:
        key, task_id = request.path_params["checkpoint"], request.path_params["task"]
        run_id = request.query_params.get("run", "")
        detail = data.task_attempts(home, key, task_id, run_id)
        fmt = _format(request)
        if fmt == "json":
            return json_response(detail)
        if fmt == "csv":
            return csv_response([{k: v for k, v in a.items() if k not in data.VIEWER_TEXT} for a in detail["attempts"]],
                                f"{key}-{task_id}")
        suffix = f"?run={run_id}" if run_id else ""
        base = detail["base"]
        return page("task", f"{task_id} at {key}", checkpoint=key, ckpt_link=links.checkpoint_path(key),
                    task_id=task_id, run_id=detail["run_id"], flawed=detail["flawed"], attempts=detail["attempts"],
                    base=base if detail["base_attempts"] else None, base_attempts=detail["base_attempts"],
                    link=lambda n: links.attempt_path(key, task_id, n) + suffix,
                    base_link=(lambda n: links.attempt_path(base, task_id, n)) if base else None,
                    exports=exports(request, "json", "csv"))

    async def attempt(request: Request) -> Response:
        key, task_id, raw = (request.path_params[k] for k in ("checkpoint", "task", "attempt"))
        if not raw.isdigit():
            raise BadQuery(f"attempt {raw!r}: expected an attempt number")
        run_id = request.query_params.get("run", "")
        detail = data.attempt_detail(home, key, task_id, int(raw), run_id)
        if _format(request) == "json":
            return json_response(detail)
        return page("attempt", f"{task_id} attempt {raw}", ckpt_link=links.checkpoint_path(key),
                    task_link=links.task_path(key, task_id), prompt=data.shown_prompt(home, task_id),
                    exports=exports(request, "json"), **detail)

    async def compare(request: Request) -> Response:
        names = [n for n in request.query_params.get("runs", "").split(",") if n]
        every = [r["run"] for r in data.list_runs(home)]
        runs = {n: data.read_steps(data.run_dir(home, n)) for n in names}
        if _format(request) == "json":
            return json_response({"runs": runs})
        curves = [charts.plot({n: [(r["step"], float(r[s])) for r in rows if r.get(s) is not None]
                               for n, rows in runs.items()}, s, chart_id=f"compare-{s}") for s in COMPARED]
        return page("compare", "compare runs", names=names, every=every, curves=curves if names else [],
                    run_links={n: links.run_path(n) for n in names}, exports=exports(request, "json"))

    async def compare_evals(request: Request) -> Response:
        a, b = request.query_params.get("a", ""), request.query_params.get("b", "")
        if not a or not b:
            raise BadQuery("query parameters 'a' and 'b': give the two checkpoints to compare")
        return RedirectResponse(f"{links.checkpoint_path(a)}?{urlencode({'against': b})}", status_code=307)

    async def find(request: Request) -> Response:
        q = request.query_params
        params = {k: q.get(k, "") for k in ("q", "regex", "run", "checkpoint", "step", "status", "task",
                                           "min_reward", "max_reward")}
        result = None
        if params["q"]:
            try:
                filters = {"regex": bool(params["regex"]), "status": params["status"], "task": params["task"],
                           "min_reward": _float(request, "min_reward"), "max_reward": _float(request, "max_reward")}
                if params["run"]:
                    if params["step"] and not params["step"].isdigit():
                        raise BadQuery(f"query parameter 'step': expected a step number, got {params['step']!r}")
                    result = data.search_rollouts(home, params["run"], params["q"],
                                                  step=int(params["step"]) if params["step"] else None, **filters)
                    for h in result["hits"]:
                        h["link"] = links.rollout_path(params["run"], h["rollout_id"])
                else:
                    result = data.search_attempts(home, params["q"], checkpoint=params["checkpoint"], **filters)
                    for h in result["hits"]:
                        h["link"] = links.attempt_path(h["checkpoint"], h["task_id"], h["attempt"]) + f"?run={h['run_id']}"
            except data.BadPattern as exc:
                raise BadQuery(str(exc)) from None
        fmt = _format(request)
        if fmt == "json":
            return json_response({"query": params, **(result or {"hits": [], "searched": 0, "more": False})})
        if fmt == "csv":
            return csv_response((result or {"hits": []})["hits"], "find")
        return page("find", "find", p=params, result=result, runs=[r["run"] for r in data.list_runs(home)],
                    checkpoints=list(data.eval_runs(home)), exports=exports(request, "json", "csv") if result else [])

    async def tensorboard(request: Request) -> Response:
        if not tensorboard_url:
            return page("not_found", "no TensorBoard", status=404,
                        message="no TensorBoard is served: start it with `posttrain ui --tensorboard`")
        return RedirectResponse(tensorboard_url, status_code=307)

    async def not_found(request: Request, exc: Exception) -> Response:
        if request.query_params.get("format") in ("json", "csv"):
            return JSONResponse({"error": str(exc)}, status_code=404)
        return page("not_found", "not found", status=404, message=str(exc))

    async def bad_query(request: Request, exc: Exception) -> Response:
        if request.query_params.get("format") in ("json", "csv"):
            return JSONResponse({"error": str(exc)}, status_code=400)
        return page("not_found", "bad request", status=400, message=str(exc))

    run_part = "{run:str}"
    routes = [
        Route("/", index), Route("/evals", evals),
        Route(f"/runs/{run_part}", run), Route(f"/runs/{run_part}/version", version),
        Route(f"/runs/{run_part}/steps/{{step:str}}", step),
        Route(f"/runs/{run_part}/rollouts/{{rollout:str}}", rollout),
        Route("/evals/{checkpoint:str}", checkpoint), Route("/evals/{checkpoint:str}/tasks/{task:str}", task),
        Route("/evals/{checkpoint:str}/tasks/{task:str}/attempts/{attempt:str}", attempt),
        Route("/compare", compare), Route("/compare/evals", compare_evals), Route("/find", find),
        Route("/tensorboard", tensorboard),
        Mount("/static", app=StaticFiles(directory=VENDOR), name="static"),
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
