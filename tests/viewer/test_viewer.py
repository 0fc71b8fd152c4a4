"""The trajectory viewer over a real run and real evals (``conftest.viewer_home``), in a real browser.

The browser tests drive Debian's headless Chromium over the DevTools protocol (``viewer.browser``)
against the viewer served by uvicorn on loopback: they click from the index to a rollout and to an
eval attempt as a researcher would.
"""

from __future__ import annotations

import ast
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.viewer.conftest import RUN, WRONG_MARK
from viewer import data, links

ROOT = Path(__file__).resolve().parents[2]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_rollout_page_shows_the_turns_and_reward_in_a_browser(served, viewer_home):
    from viewer.browser import Browser

    _, facts = viewer_home
    solved = next(r for r in facts["rollouts"].values() if r.reward == 1.0)
    with Browser() as browser:
        browser.goto(served + "/")
        browser.click(f"a[href='{links.run_path(RUN)}']")
        assert "Run r" in browser.text("h1")
        browser.click(f"a[href='{links.step_path(RUN, 1)}']")
        assert "2 group(s), 4 rollout(s)" in browser.text("main")
        browser.click(f"a[href='{links.rollout_path(RUN, solved.rollout_id)}']")
        page = browser.text("main")
        assert browser.text("#reward") == "1.000"
        assert "prompt" in page and "turn 0 · action" in page and "advantage\n+0.5000" in page
        assert "commit" in browser.text(".turn.action pre")  # the action the model wrote, decoded
        assert "tests pass" in page or "observation" in page or solved.info["stop_reason"] == "commit"


def test_attempt_page_shows_the_failing_tests_and_the_diff_in_a_browser(served, viewer_home):
    from viewer.browser import Browser

    _, facts = viewer_home
    first = facts["tasks"][0]
    with Browser() as browser:
        browser.goto(served + "/evals")
        browser.click(f"a[href='{links.checkpoint_path('r-step_000001')}']")
        table = browser.text("#tasks")
        assert first in table and "gained" in table  # solved once at step 1, never by the base model
        browser.click(f"a[href='{links.task_path('r-step_000001', first)}']")
        browser.click(f"a[href='{links.attempt_path('r-step_000001', first, 1)}']")
        assert browser.text("#reward") == "0.000"
        tests = browser.text("#tests")
        assert "target\tfailed" in tests
        assert WRONG_MARK in browser.text("#diff")
        assert browser.evaluate("document.querySelectorAll('#tests td.fail').length") >= 1


def test_step_page_filters_and_distributions(served):
    status, page = get(served + links.step_path(RUN, 1) + "?min_reward=1")
    assert status == 200 and "1 group(s), 1 rollout(s) matching the filters" in page
    assert "response length (generated tokens)" in page and "group reward spread (std)" in page
    status, page = get(served + links.step_path(RUN, 1) + "?min_reward=high")
    assert status == 400 and "query parameter &#39;min_reward&#39;: expected a number, got &#39;high&#39;" in page


def test_unknown_pages_are_404_naming_what_is_missing(served):
    status, page = get(served + links.rollout_path(RUN, "nope"))
    assert status == 404 and "no rollout &#39;nope&#39;" in page
    status, page = get(served + links.checkpoint_path("r-step_000009"))
    assert status == 404 and "no eval rows of checkpoint &#39;r-step_000009&#39;" in page
    status, page = get(served + "/runs/..")
    assert status == 404


def test_group_advantages_match_grpo():
    """Pinned: rewards (1, 0) -> mean 0.5, advantages ±0.5; scaled by their std 0.5 -> ±1; equal rewards
    -> 0; and the same as the trainer's torch version on a mixed group."""
    import torch

    from training.grpo import group_advantages
    from training.progress import plain_advantages

    assert plain_advantages([1.0, 0.0]) == [0.5, -0.5]
    assert [round(a, 5) for a in plain_advantages([1.0, 0.0], scale_by_std=True)] == [1.0, -1.0]
    assert plain_advantages([0.0, 0.0, 0.0]) == [0.0, 0.0, 0.0]
    rewards = [1.0, 0.25, 0.0, 0.5]
    for scale in (False, True):
        torch_adv = group_advantages(torch.tensor([rewards]), scale_by_std=scale).advantages[0].tolist()
        assert [round(a, 5) for a in plain_advantages(rewards, scale_by_std=scale)] == [round(a, 5) for a in torch_adv]


def test_task_table_has_flips_and_flawed_marks(viewer_home):
    home, facts = viewer_home
    table = data.checkpoint_tasks(home, "r-step_000001")
    rows = {r["task_id"]: r for r in table["rows"]}
    first, second = facts["tasks"]
    assert table["base"] == "r-step_000000"
    assert (rows[first]["base_passes"], rows[first]["passes"], rows[first]["flip"]) == (0, 1, "gained")
    assert rows[first]["change"] == 0.5
    assert (rows[second]["passes"], rows[second]["flip"], rows[second]["flawed"]) == (0, "", ["audit"])


def test_rollout_segments_split_at_the_mask(viewer_home):
    home, facts = viewer_home
    rollout = next(iter(facts["rollouts"].values()))
    detail = data.rollout_detail(home, RUN, rollout.rollout_id)
    kinds = [s.kind for s in detail["segments"]]
    assert kinds[0] == "prompt" and kinds[1] == "action"
    assert sum(len(s.tokens) for s in detail["segments"]) == len(rollout.input_ids)
    assert sum(len(s.tokens) for s in detail["segments"] if s.kind == "action") == rollout.generated_tokens


def test_the_viewer_imports_no_dagster():
    """It sits below dagster_project and assets: it reads run files and runs without Dagster."""
    for path in (ROOT / "viewer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in {"dagster", "dagster_project", "assets"}, f"{path} imports {name}"


@pytest.mark.parametrize("path", ["/", "/evals", links.run_path(RUN)])
def test_index_pages_render(served, path):
    status, page = get(served + path)
    assert status == 200 and "posttrain viewer" in page


def test_screenshots_of_the_pages(served, viewer_home, tmp_path):
    """The docs' screenshots (docs/viewer.md): ``POSTTRAIN_VIEWER_SCREENSHOTS=docs/screenshots`` writes
    them there, else into a temporary folder; each is a PNG of the page as Chromium drew it."""
    import os

    from viewer.browser import Browser

    _, facts = viewer_home
    out = Path(os.environ.get("POSTTRAIN_VIEWER_SCREENSHOTS") or tmp_path)
    first = facts["tasks"][0]
    solved = next(r for r in facts["rollouts"].values() if r.reward == 1.0)
    pages = {
        "viewer-rollout.png": links.rollout_path(RUN, solved.rollout_id),
        "viewer-attempt.png": links.attempt_path("r-step_000001", first, 1),
        "viewer-per-task.png": links.checkpoint_path("r-step_000001"),
        "viewer-run.png": links.run_path(RUN),  # curves by step and time per phase
        "viewer-step.png": links.step_path(RUN, 1),
    }
    with Browser(width=1200, height=800) as browser:
        for name, path in pages.items():
            browser.goto(served + path)
            png = browser.screenshot(out / name, max_height=1100)
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_run_page_draws_the_reward_audit_and_the_canary_curve(served, viewer_home):
    """`posttrain audit RUN` writes runs/RUN/audit.json; the run page draws its wrong fixes per step, and
    the canaries' pass rate is one of the step curves. A malformed audit file is left out, not an error."""
    from training.audit import StepAudit, write_audit
    from training.checkpoint import run_path

    home, _ = viewer_home
    run_dir = run_path(home, RUN)
    write_audit(run_dir, [StepAudit(1, rewarded=3, regraded=3, wrong_fixes=1), StepAudit(2, rewarded=4, regraded=4)], 5)
    try:
        status, page = get(served + links.run_path(RUN))
        assert status == 200 and "reward audit (hidden inputs of seed 5)" in page
        assert "wrong fixes that earned reward" in page and "canaries passed" in page
        (run_dir / "audit.json").write_text("{not json")
        status, page = get(served + links.run_path(RUN))
        assert status == 200 and "reward audit" not in page
    finally:
        (run_dir / "audit.json").unlink()
