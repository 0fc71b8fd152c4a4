"""The researcher's view, second round (issue 52), over the real run and evals of ``conftest.viewer_home``
(copied where a test changes them) and in a real browser (Debian's headless Chromium, ``viewer.browser``):
links follow the port the viewer is served on; a step's consumed and discarded rollouts apart; charts
with real axes (uPlot), zoom and smoothing; eval action arguments without JSON escapes; the prompt the
model was shown; "committed" that agrees with the diff; a finished run without an ETA; pass@1 with
intervals and per level; any checkpoint against any other; overlaid curves of several runs; search
over rollouts and attempts; CSV and JSON of every table; a running run's page that refreshes."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from tests.inherited_signals import block_sigterm, ignore_sigterm
from tests.viewer.conftest import RUN, WRONG_MARK
from viewer import data, links

ROOT = Path(__file__).resolve().parents[2]


def get(url: str) -> tuple[int, str, dict]:
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


@pytest.fixture
def home_copy(viewer_home, tmp_path):
    """A copy of ``viewer_home`` that a test may change."""
    home, facts = viewer_home
    shutil.copytree(home, tmp_path / "home")
    return tmp_path / "home", facts


@pytest.fixture
def served_copy(home_copy):
    from viewer.app import serve_in_thread

    with serve_in_thread(home_copy[0]) as url:
        yield url


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_links_follow_the_port_the_viewer_serves_the_home_on(home_copy, monkeypatch):
    """`python -m viewer --port P` (as `posttrain ui --viewer-port P` starts it) records where it serves
    the home; a run or eval materialized afterwards without `posttrain ui` (the demo, `posttrain eval`)
    links there, TensorBoard (through the viewer's /tensorboard) included, not to port 3001."""
    from assets.metadata import per_task_table

    home, facts = home_copy
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "viewer", "--home", str(home), "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert f"trajectory viewer on http://127.0.0.1:{port}" in proc.stdout.readline()
        monkeypatch.delenv(links.URL_ENV, raising=False)
        monkeypatch.setenv("POSTTRAIN_HOME", str(home))
        assert links.viewer_url() == f"http://127.0.0.1:{port}"
        assert links.url("/tensorboard") == f"http://127.0.0.1:{port}/tensorboard"
        table = per_task_table(data.checkpoint_tasks(home, "r-step_000001")["rows"], "r-step_000001")
        assert all(r.data["viewer"].startswith(f"http://127.0.0.1:{port}/evals/") for r in table.records)
        status, page, _ = get(table.records[0].data["viewer"])
        assert status == 200 and "attempts at" in page.lower()
        monkeypatch.setenv(links.URL_ENV, "http://127.0.0.1:4321")  # posttrain ui's own processes: its flag wins
        assert links.viewer_url() == "http://127.0.0.1:4321"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _run_with_discarded(home: Path) -> str:
    """Run ``s``: four groups of two stored through the real store; two sampled by adapter step 0 are
    discarded as stale by step 1 (min adapter step 1), the two of adapter step 1 consumed."""
    import random

    from training.checkpoint import run_path, store_path
    from training.rollout import Rollout
    from training.store import RolloutStore

    rng = random.Random(0)
    store = RolloutStore(store_path(run_path(home, "s")))
    rewards = {"old0": (1.0, 1.0), "old1": (1.0, 0.0), "new0": (1.0, 0.0), "new1": (0.0, 0.0)}
    for group_id, pair in rewards.items():
        adapter = 0 if group_id.startswith("old") else 1
        store.add_group(group_id, f"bundled-l{1 + adapter}-000-t", adapter, 2)
        for i, reward in enumerate(pair):
            store.put(Rollout(f"{group_id}-{i}", group_id, f"bundled-l{1 + adapter}-000-t", adapter,
                              [rng.randrange(100) for _ in range(40)], [0] * 30 + [1] * 10, [0.0] * 30 + [-0.5] * 10,
                              reward, {"stop_reason": "commit", "turns": 1, "agent_s": 2.0, "grade_s": 1.0}))
    take = store.take_groups(4, step=1, min_adapter_step=1)
    assert (len(take.groups), len(take.discarded_groups)) == (2, 2)
    store.close()
    return "s"


@pytest.mark.parametrize("inherited", [ignore_sigterm, block_sigterm], ids=["ignored", "blocked"])
def test_the_viewer_stops_on_sigterm_whatever_it_inherited(home_copy, inherited):
    """A viewer started with SIGTERM ignored or blocked (as a test runner, a shell or a supervisor may
    leave it) still ends on SIGTERM, sent as soon as it announces itself, before it serves."""
    home, _ = home_copy
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "viewer", "--home", str(home), "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=inherited)
    try:
        assert f"trajectory viewer on http://127.0.0.1:{port}" in proc.stdout.readline()
        proc.terminate()
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        proc.kill()
        proc.wait()


def test_the_viewer_announces_its_address_only_once_it_listens(home_copy):
    """`posttrain ui` and the tests read the viewer's "trajectory viewer on" line as "it serves": the
    port is bound before the line is printed, so a request right after it is answered; a port already
    taken is a clear error and exit 1, with no line announcing a viewer that never serves."""
    import socket

    home, _ = home_copy
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "viewer", "--home", str(home), "--port", str(port)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done
    assert "trajectory viewer on" not in done.stdout
    assert f"cannot serve on 127.0.0.1:{port}" in done.stderr

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "viewer", "--home", str(home), "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert f"trajectory viewer on http://127.0.0.1:{port}" in proc.stdout.readline()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepted at once: the port is bound before the line
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_steps_table_and_histograms_keep_discarded_rollouts_apart(home_copy, served_copy):
    home, _ = home_copy
    run = _run_with_discarded(home)
    [row] = data.store_steps(home, run)
    # consumed rewards 1, 0, 0, 0 (mean 0.25); discarded 1, 1, 1, 0 (0.75); a mean over both said 0.5
    assert (row["consumed"], row["reward_mean_consumed"], row["discarded"], row["reward_mean_discarded"]) == (
        4, 0.25, 4, 0.75)
    status, page, _ = get(served_copy + links.run_path(run))
    assert status == 200
    assert "<th>mean reward, consumed</th>" in page and "<th>mean reward, discarded</th>" in page
    assert '<td class="num">0.250</td><td class="num">4</td><td class="num">0.750</td>' in page
    status, page, _ = get(served_copy + links.step_path(run, 1))
    assert "4 consumed, 4 discarded" in page
    assert "reward · trained on" in page and "n=4" in page  # the histograms count the 4 trained on
    assert "reward · discarded as stale (not trained on)" in page
    assert page.count("discarded (not trained on)") == 4


def test_charts_have_real_axes_zoom_and_smoothing_in_a_browser(served, viewer_home):
    """The run page's curves are uPlot charts: the y range holds every value (none clipped), the axes
    carry several ticks (not only min and max), a drag zooms in, and the smoothing slider smooths."""
    from viewer.browser import Browser

    with Browser() as browser:
        browser.goto(served + links.run_path(RUN))
        assert browser.evaluate("typeof uPlot") == "function"
        charts = browser.evaluate("""JSON.stringify(window.posttrainCharts.map(u => ({
            title: u.spec.title, ymin: u.scales.y.min, ymax: u.scales.y.max,
            data: u.data.slice(1).flat().filter(v => v != null),
            yticks: u.axes[1]._splits ? u.axes[1]._splits.length : 0,
            xticks: u.axes[0]._splits ? u.axes[0]._splits.length : 0})))""")
        charts = json.loads(charts)
        loss = next(c for c in charts if c["title"] == "loss")
        assert loss["ymin"] <= min(loss["data"]) and loss["ymax"] >= max(loss["data"])
        assert all(c["yticks"] >= 3 for c in charts if c["data"]), charts
        # smoothing: the slider redraws every curve as an exponential moving average
        smoothed = browser.evaluate("""(() => { const s = document.getElementById('smoothing'); s.value = '0.9';
            s.dispatchEvent(new Event('input'));
            const u = window.posttrainCharts.find(u => u.spec.title === 'loss'); return u.data[1]; })()""")
        assert smoothed[0] == pytest.approx(0.1) and smoothed[1] == pytest.approx(0.9 * 0.1 + 0.1 * 0.05)


def test_histogram_ticks_are_round_values_across_the_range():
    from viewer.charts import histogram, ticks

    assert ticks(-0.00595, 0.3) == [0.0, 0.1, 0.2, 0.3]
    svg = histogram([-0.00595 + 0.025 * i for i in range(14)], "advantage")
    labels = [part.split("<")[0] for part in svg.split('class="tick" text-anchor=')[1:]]
    assert len(labels) >= 3, svg


def _rewrite_rows(home: Path, checkpoint: str, change) -> None:
    path = home / "evals" / "deepswe" / checkpoint / "run-1.parquet"
    frame = pd.read_parquet(path)
    change(frame)
    frame.to_parquet(path, index=False)


def test_attempt_page_shows_args_as_written_the_prompt_shown_and_committed_that_agrees(home_copy, served_copy,
                                                                                       viewer_home):
    home, facts = home_copy
    first = facts["tasks"][0]
    args_text = "if x > 4 and y < 'z': return \"&\""

    def change(frame):
        one = frame.index[(frame["task_id"] == first) & (frame["attempt"] == 1)][0]
        zero = frame.index[(frame["task_id"] == first) & (frame["attempt"] == 0)][0]
        t = json.loads(frame.loc[one, "transcript"])
        next(m for m in t if m["role"] == "action")["action"]["args"]["text"] = args_text
        frame.loc[one, "transcript"] = json.dumps(t)
        assert frame.loc[zero, "committed"]
        frame.loc[zero, "diff"] = ""  # a Harbor attempt's row keeps no diff, though it committed

    _rewrite_rows(home, "r-step_000001", change)
    status, page, _ = get(served_copy + links.attempt_path("r-step_000001", first, 1))
    assert status == 200
    assert "\\u003e" not in page and "\\u0027" not in page
    assert "if x &gt; 4 and y &lt; &#39;z&#39;: return \\&#34;&amp;\\&#34;" in page  # escaped for HTML only
    assert "<dt>committed</dt><dd>yes</dd>" in page and "nothing committed" not in page
    status, page, _ = get(served_copy + links.attempt_path("r-step_000001", first, 0))
    assert "<dt>committed</dt><dd>yes</dd>" in page and "nothing committed" not in page, page[page.find("Committed diff"):][:300]
    assert "the agent committed, but this attempt's row keeps no diff" in page, page[page.find("Committed diff"):][:300]

    # with the suite in the home, the transcript starts with the prompt the model was shown
    suite = home / "datasets" / "bundled"
    shutil.copytree(viewer_home[0].parent / "suite", suite)  # the suite the evals ran
    status, page, _ = get(served_copy + links.attempt_path("r-step_000001", first, 1))
    shown = page[page.index('id="shown-prompt"'):]
    from markupsafe import escape

    from evals.actions import render_compact_prompt
    from evals.bundled import read_suite

    [task] = [t for t in read_suite(suite) if t.id == first]
    assert "prompt the model was shown" in shown
    assert str(escape(render_compact_prompt(task))) in shown


def test_a_finished_run_shows_no_eta_and_names_its_leftover_rollouts(home_copy, served_copy):
    from training.checkpoint import run_path

    home, _ = home_copy
    status, page, _ = get(served_copy + links.run_path(RUN))
    assert "2 step(s) of 6 · ETA" in page and "live: this run is training" in page
    plan = run_path(home, RUN) / "resolved-plan.json"
    plan.write_text(json.dumps({**json.loads(plan.read_text()), "trainer": {"steps": 2}}))
    status, page, _ = get(served_copy + links.run_path(RUN))
    assert "2 step(s) of 2 · finished" in page and "ETA" not in page and "live:" not in page
    status, page, _ = get(served_copy + "/")
    assert "finished" in page and "left over (the run ended before a step took them)" in page
    assert json.loads(get(served_copy + links.run_path(RUN) + "?format=json")[1])["eta_s"] is None


def test_checkpoint_page_has_intervals_and_per_level_pass_at_1(served, viewer_home):
    home, facts = viewer_home
    summary = data.checkpoint_tasks(home, "r-step_000001")["summary"]
    # task 1: 1 of 2 attempts pass at step 1, 0 of 2 at the base; task 2: none at either
    assert summary["pass@1"].value == 0.25 and summary["against_pass@1"].value == 0.0
    assert summary["change"].value == 0.25 and summary["change"].low == 0.0 and summary["change"].high == 0.5
    assert [lv["level"] for lv in summary["levels"]] == sorted({lv["level"] for lv in summary["levels"]})
    status, page, _ = get(served + links.checkpoint_path("r-step_000001"))
    assert 'id="summary"' in page and "0.250 [0.000, 0.500]" in page and "+0.250 [+0.000, +0.500]" in page
    assert page.count("<td>level ") == len(summary["levels"]) >= 1


def test_compare_runs_and_any_checkpoint_against_any_other_in_a_browser(home_copy, served_copy):
    from training.checkpoint import metrics_dir, run_path
    from training.metrics import MetricsWriter
    from viewer.browser import Browser

    home, facts = home_copy
    writer = MetricsWriter(metrics_dir(run_path(home, "r2")))
    for step in range(1, 11):
        writer.record({"step": step, "time_s": 100.0 * step, "loss": 0.3 / step, "reward_mean": 0.05 * step,
                       "solve_rate": 0.05 * step}, [])
    first = facts["tasks"][0]
    with Browser() as browser:
        browser.goto(served_copy + "/compare?runs=r,r2")
        charts = json.loads(browser.evaluate(
            "JSON.stringify(window.posttrainCharts.map(u => [u.spec.title, u.spec.names]))"))
        assert ["reward_mean", ["r", "r2"]] in charts and ["loss", ["r", "r2"]] in charts
        # zoom: a drag across the chart sets the x scale (the same call); double-click resets it
        before, after = browser.evaluate(
            "(async () => { const u = window.posttrainCharts.find(u => u.spec.title === 'loss');"
            " const before = u.scales.x.max - u.scales.x.min; u.setScale('x', {min: 3, max: 6});"
            " await new Promise(r => setTimeout(r, 0));"  # uPlot commits a scale change in a microtask
            " return [before, u.scales.x.max - u.scales.x.min]; })()")
        assert (before, after) == (9, 3)
        # step 0 against step 1, by its page's "compare with" form: the flip turns round
        browser.goto(served_copy + links.checkpoint_path("r-step_000000"))
        browser.evaluate("document.querySelector('#against-form select').value = 'r-step_000001'")
        browser.click("#against-form button")
        assert "against=r-step_000001" in browser.url()
        table = browser.text("#tasks")
        assert first in table and "lost" in table
        assert "-0.250 [-0.500, +0.000]" in browser.text("#summary")
    # the URL is the link: /compare/evals redirects to it
    status, page, _ = get(served_copy + "/compare/evals?a=r-step_000000&b=r-step_000001")
    assert status == 200 and "-0.250 [-0.500, +0.000]" in page
    status, page, _ = get(served_copy + links.checkpoint_path("r-step_000000") + "?against=r-step_000009")
    assert status == 404 and "r-step_000009" in page


def test_find_rollouts_and_attempts_by_text_or_regex_in_a_browser(served, viewer_home):
    from viewer.browser import Browser

    _, facts = viewer_home
    first, second = facts["tasks"]
    with Browser() as browser:
        browser.goto(served + "/find")
        browser.evaluate(f"document.querySelector('#find-form input[name=q]').value = {json.dumps(WRONG_MARK)}")
        browser.click("#find-form button")
        hits = browser.text("#hits")
        # every attempt but step 1's right one committed the mark: 3 of 4 at step 1, 4 of 4 at step 0
        assert browser.text("#found").startswith("7 match(es) in 8 attempts searched")
        assert first in hits and second in hits and "diff" in hits or "transcript" in hits
    status, page, _ = get(served + "/find?" + urllib.parse.urlencode(
        {"q": r"checked,\s+unchanged", "regex": "1", "checkpoint": "r-step_000001", "task": first, "format": "json"}))
    found = json.loads(page)
    assert status == 200 and [(h["task_id"], h["attempt"]) for h in found["hits"]] == [(first, 1)]
    # rollouts: the decoded text of every rollout of the run, filtered by reward
    status, page, _ = get(served + "/find?" + urllib.parse.urlencode(
        {"q": "commit", "run": RUN, "min_reward": "1", "format": "json"}))
    found = json.loads(page)
    solved = {r.rollout_id for r in facts["rollouts"].values() if r.reward >= 1}
    assert {h["rollout_id"] for h in found["hits"]} == solved and found["searched"] == len(solved)
    status, page, _ = get(served + "/find?q=%28unclosed&regex=1")
    assert status == 400 and "is not a regular expression" in page


def test_every_table_comes_away_as_csv_and_json_and_a_rollout_as_json(served, viewer_home):
    from viewer.browser import Browser

    _, facts = viewer_home
    first = facts["tasks"][0]
    solved = next(r for r in facts["rollouts"].values() if r.reward == 1.0)
    with Browser() as browser:  # the page's own "take away" link, fetched as the browser downloads it
        browser.goto(served + links.checkpoint_path("r-step_000001"))
        href = browser.evaluate("[...document.querySelectorAll('a.export')].find(a => a.textContent === 'csv').href")
        text = browser.evaluate(f"fetch({json.dumps(href)}).then(r => r.text())")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert {r["task_id"]: r["flip"] for r in rows}[first] == "gained"
    status, body, headers = get(served + links.checkpoint_path("r-step_000001") + "?format=csv")
    assert headers["content-type"].startswith("text/csv") and "attachment" in headers["content-disposition"]
    payload = json.loads(get(served + links.checkpoint_path("r-step_000001") + "?format=json")[1])
    assert payload["summary"]["change"]["value"] == 0.25 and len(payload["rows"]) == 2
    steps = list(csv.DictReader(io.StringIO(get(served + links.run_path(RUN) + "?format=csv")[1])))
    assert [int(r["step"]) for r in steps] == [1, 2]
    rollouts = json.loads(get(served + links.step_path(RUN, 1) + "?format=json")[1])["rollouts"]
    assert len(rollouts) == 4 and {r["status"] for r in rollouts} == {"consumed"}
    detail = json.loads(get(served + links.rollout_path(RUN, solved.rollout_id) + "?format=json")[1])
    tokens = [t for s in detail["segments"] for t in s["tokens"]]
    assert [t["id"] for t in tokens] == list(solved.input_ids)
    assert sum(t["trained"] for t in tokens) == solved.generated_tokens
    attempt = json.loads(get(served + links.attempt_path("r-step_000001", first, 0) + "?format=json")[1])
    assert attempt["row"]["reward"] == 1.0 and attempt["transcript"][0]["role"] == "task"
    status, body, _ = get(served + links.checkpoint_path("r-step_000001") + "?format=xml")
    assert status == 400 and "expected one of html, json, csv" in body


def test_a_running_runs_page_refreshes_when_it_writes_a_step_in_a_browser(home_copy, served_copy):
    from training.checkpoint import metrics_dir, run_path
    from viewer.browser import Browser, BrowserError

    home, _ = home_copy
    with Browser() as browser:
        browser.goto(served_copy + links.run_path(RUN))
        assert browser.text("#state").startswith("2 step(s) of 6")
        steps = metrics_dir(run_path(home, RUN)) / "steps.parquet"
        rows = pd.read_parquet(steps).to_dict("records")
        rows.append({**rows[-1], "step": 3, "time_s": rows[-1]["time_s"] + 10})
        pd.DataFrame(rows).to_parquet(steps.with_name(".tmp-steps.parquet"), index=False)  # as MetricsWriter does
        steps.with_name(".tmp-steps.parquet").replace(steps)
        deadline = time.monotonic() + 60  # the page polls every 2 s; this only bounds a broken page
        while True:
            try:
                state = browser.text("#state")
            except BrowserError:  # caught between two loads
                state = ""
            if state.startswith("3 step(s) of 6"):
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.5)


def test_screenshots_of_compare_find_and_a_checkpoint_against_another(home_copy, served_copy, tmp_path):
    """The docs' screenshots of this round (docs/viewer.md): ``POSTTRAIN_VIEWER_SCREENSHOTS=docs/screenshots``
    writes them there, else into a temporary folder; each is a PNG of the page as Chromium drew it."""
    from training.checkpoint import metrics_dir, run_path
    from training.metrics import MetricsWriter
    from viewer.browser import Browser

    home, _ = home_copy
    writer = MetricsWriter(metrics_dir(run_path(home, "r2")))
    for step in range(1, 11):
        writer.record({"step": step, "time_s": 100.0 * step, "loss": 0.3 / step, "reward_mean": 0.05 * step,
                       "solve_rate": 0.04 * step, "policy_age_mean": 0.5, "discarded_samples": step % 3,
                       "useful_tokens_per_s": 90.0 + step, "canary_pass_rate": 0.0}, [])
    out = Path(os.environ.get("POSTTRAIN_VIEWER_SCREENSHOTS") or tmp_path)
    pages = {
        "viewer-compare.png": "/compare?runs=r,r2",
        "viewer-find.png": "/find?" + urllib.parse.urlencode({"q": WRONG_MARK}),
        "viewer-checkpoint-against.png": links.checkpoint_path("r-step_000000") + "?against=r-step_000001",
    }
    with Browser(width=1200, height=800) as browser:
        for name, path in pages.items():
            browser.goto(served_copy + path)
            png = browser.screenshot(out / name, max_height=1100)
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
