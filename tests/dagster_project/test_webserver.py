"""The Dagster webserver on loopback serves the asset graph, over GraphQL and as a rendered page."""

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dagster_project.instance import ensure_dagster_home
from serving.fleet import free_port

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"task_dataset", "image_cache", "difficulty_curriculum", "rl_run", "checkpoints", "deepswe_eval", "eval_report"}
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--window-size=1600,1000", "--virtual-time-budget=20000",
]


@pytest.fixture
def webserver(posttrain_home):
    home = ensure_dagster_home(str(posttrain_home))
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster-webserver"), "-w", str(ROOT / "workspace.yaml"),
         "-h", "127.0.0.1", "-p", str(port)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/server_info", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, "dagster-webserver exited"
            assert time.monotonic() < deadline, "dagster-webserver did not answer"
            time.sleep(1)
        yield url, home
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def graphql(url: str, query: str) -> dict:
    request = urllib.request.Request(
        f"{url}/graphql", data=json.dumps({"query": query}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.load(resp)


@pytest.mark.slow
def test_webserver_serves_the_asset_graph(webserver, tmp_path):
    url, _ = webserver
    deadline = time.monotonic() + 120
    while True:  # the code location loads in the background after the server answers
        data = graphql(url, "{ assetNodes { assetKey { path } dependencyKeys { path } isPartitioned } }")
        nodes = data.get("data", {}).get("assetNodes") or []
        if nodes or time.monotonic() > deadline:
            break
        time.sleep(1)
    by_key = {n["assetKey"]["path"][0]: n for n in nodes}
    assert set(by_key) == KEYS
    assert by_key["deepswe_eval"]["isPartitioned"] and by_key["checkpoints"]["isPartitioned"]
    assert [d["path"] for d in by_key["deepswe_eval"]["dependencyKeys"]] == [["checkpoints"]]

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is installed by scripts/setup.sh"
    profile = tmp_path / "chromium-profile"

    def render(path: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, f"{url}{path}"],
            capture_output=True, text=True, timeout=180, check=True,
        )

    # The global lineage shows one node per group; a group's page shows its assets and neighbours.
    lineage = render("/asset-groups", "--dump-dom").stdout
    for group in ("tasks", "sandboxes", "training", "evals"):
        assert f">{group}<" in lineage, f"group {group} not on the lineage page"
    page = "/locations/posttrain/asset-groups/training"
    dom = render(page, "--dump-dom").stdout
    for key in ("image_cache", "difficulty_curriculum", "rl_run", "checkpoints", "deepswe_eval"):
        assert key in dom, f"{key} not rendered on the training group's graph"

    shot = tmp_path / "asset-graph.png"
    render(page, f"--screenshot={shot}")
    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (1600, 1000)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 50, "the screenshot is blank"
