"""Bad input, generated (hypothesis): every parser and HTTP endpoint answers malformed, huge,
wrongly typed or path-traversing input with its own clear error (a named exception, or HTTP 4xx with a
message), never a crash (5xx, an unexpected exception, a dead server) and never a hang, and nothing
already stored is lost. Promise: DESIGN "Errors"; serving/http.py and sandboxes/pxd.py ("Bad input:
HTTP 400 naming the field"); evals/tasks.py (TaskLoadError names the file and key)."""

from __future__ import annotations

import hashlib
import json
import socket
import string
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.capture_store import trainer_headers
from serving.client import HttpPool

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))

# JSON-shaped values: what a malformed request or file may hold instead of the expected type
scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=40)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                           max_leaves=12)
traversal = st.sampled_from(["../../etc/passwd", "/etc/passwd", "a/../../x", "..", "./../.ssh/id_rsa", "x/\x00y",
                             "%2e%2e/%2e%2e/etc/passwd", "a" * 5000, "", "/", "//host/share", "~root/.bashrc"])


def _mutate(data: bytes, draw_cut: int, insert: bytes) -> bytes:
    cut = draw_cut % (len(data) + 1)
    return data[:cut] + insert + data[cut + len(insert):]


# -- task files -----------------------------------------------------------------------------------

@FUZZ
@given(task_toml=st.text(max_size=300) | json_values.map(lambda v: json.dumps(v)), config=json_values,
       instruction=st.text(max_size=50))
def test_harbor_task_folder_with_any_content_is_loaded_or_reported(tmp_path_factory, task_toml, config, instruction):
    from evals.tasks import IncompleteTask, TaskLoadError, load_harbor

    root = tmp_path_factory.mktemp("harbor")
    task = root / "tasks" / "t1"
    (task / "tests").mkdir(parents=True)
    (task / "task.toml").write_text(task_toml)
    (task / "instruction.md").write_text(instruction)
    (task / "tests" / "config.json").write_text(json.dumps(config))
    try:
        ts = load_harbor(root)
    except TaskLoadError as exc:
        assert "t1" in str(exc) or str(root) in str(exc)
        return
    assert len(ts.tasks) + len(ts.incomplete) == 1  # never silently dropped
    for bad in ts.incomplete:
        assert isinstance(bad, IncompleteTask) and bad.reason


@FUZZ
@given(rows=st.lists(st.text(max_size=80) | json_values.map(json.dumps)
                     | st.fixed_dictionaries({"instance_id": scalars, "problem_statement": scalars,
                                              "base_commit": scalars, "FAIL_TO_PASS": scalars | json_values,
                                              "PASS_TO_PASS": scalars | json_values}).map(json.dumps),
                     min_size=1, max_size=4))
def test_swebench_jsonl_with_any_rows_is_loaded_or_refused_by_line(tmp_path_factory, rows):
    from evals.tasks import TaskLoadError, load_swebench

    path = tmp_path_factory.mktemp("swe") / "tasks.jsonl"
    path.write_text("\n".join(r.replace("\n", " ") for r in rows))
    try:
        load_swebench(path)
    except TaskLoadError as exc:
        assert str(path) in str(exc)


@FUZZ
@given(data=json_values | st.fixed_dictionaries({"id": scalars, "instruction": scalars, "target_tests": json_values,
                                                 "existing_tests": json_values, "repo": traversal | scalars,
                                                 "limits": json_values}))
def test_bundled_task_json_with_any_content_is_loaded_or_refused(tmp_path_factory, data):
    from evals.tasks import TaskLoadError, task_from_json

    task_dir = tmp_path_factory.mktemp("bundled")
    try:
        task_from_json(data, task_dir, f"{task_dir}/task.json")
    except TaskLoadError as exc:
        assert "task.json" in str(exc)


# -- test reports ---------------------------------------------------------------------------------

JUNIT = (b'<?xml version="1.0"?><testsuites><testsuite name="s"><testcase classname="test_a" name="test_x"/>'
         b'<testcase classname="test_a" name="test_y"><failure message="boom"/></testcase></testsuite></testsuites>')


@FUZZ
@given(cut=st.integers(0, 10_000), insert=st.binary(max_size=20) | st.sampled_from(
    [b"<!DOCTYPE x [<!ENTITY a \"aaaaaaaaaa\"><!ENTITY b \"&a;&a;&a;&a;&a;&a;&a;&a;\">]>", b"&b;", b"\xff\xfe", b"</testsuite>"]))
def test_junit_report_mutated_is_parsed_or_refused(cut, insert):
    from evals.grading import ReportError, parse_junit_bytes

    try:
        statuses = parse_junit_bytes(_mutate(JUNIT, cut, insert), "report.xml")
    except ReportError as exc:
        assert "report.xml" in str(exc)
        return
    assert isinstance(statuses, dict)


@FUZZ
@given(report=json_values | st.fixed_dictionaries({"results": st.fixed_dictionaries({"tests": json_values})}),
       node_id=st.sampled_from(["name", "suite.name"]))
def test_ctrf_report_of_any_shape_is_parsed_or_refused(report, node_id):
    from evals.grading import ReportError, parse_ctrf_bytes

    try:
        statuses = parse_ctrf_bytes(json.dumps(report).encode(), "ctrf.json", node_id)
    except ReportError as exc:
        assert "ctrf.json" in str(exc)
        return
    assert isinstance(statuses, dict)


# -- run TOML -------------------------------------------------------------------------------------

EMBEDDED = tomllib.loads((Path(__file__).resolve().parents[2] / "examples" / "embedded.toml").read_text())
SECTIONS = sorted(k for k, v in EMBEDDED.items() if isinstance(v, dict))


@FUZZ
@given(section=st.sampled_from(SECTIONS), key=st.text(string.ascii_lowercase + "_", min_size=1, max_size=20),
       value=json_values, use_known_key=st.booleans(), data=st.data())
def test_run_toml_with_a_wrong_key_or_value_is_refused_naming_it(section, key, value, use_known_key, data):
    from training.planner.schema import PlanError
    from training.planner.resolve import resolve

    if use_known_key and EMBEDDED[section]:
        key = data.draw(st.sampled_from(sorted(EMBEDDED[section])))
    run = json.loads(json.dumps(EMBEDDED))
    run[section][key] = value
    try:
        resolve(run, source="fuzz.toml")
    except PlanError as exc:
        assert "fuzz.toml" in str(exc)


@FUZZ
@given(text=st.text(max_size=200))
def test_run_toml_file_of_any_text_is_refused_or_planned(tmp_path_factory, text):
    from training.planner.schema import PlanError
    from training.planner.resolve import resolve

    path = tmp_path_factory.mktemp("run") / "run.toml"
    path.write_text(text)
    try:
        resolve(path)
    except PlanError as exc:
        assert str(path) in str(exc) or "run.toml" in str(exc)


# -- HTTP: the engine (real tiny model), the router, adapter uploads ----------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from serving.local_engine import LocalEngine
    from serving.http import serve
    from serving.tiny import build_tiny_lora_adapter, build_tiny_model

    root = tmp_path_factory.mktemp("engine")
    model = build_tiny_model(root / "model")
    adapter = build_tiny_lora_adapter(model, root / "v1", seed=1)
    server = serve(LocalEngine(model, max_total_tokens=4096, torch_threads=1), port=0, staging_dir=root / "staging")
    pool = HttpPool(timeout_s=60, headers=trainer_headers())  # bad input from the trainer: past the credential checks
    pool.json("POST", f"{server.url}/load_lora_adapter", {"lora_name": "v1", "lora_path": str(adapter)})
    yield server, pool, root
    server.shutdown()


def _still_serves(url: str, pool: HttpPool, lora: str | None = "v1") -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    if lora:
        body["lora_path"] = lora
    out = pool.json("POST", f"{url}/generate", body)
    assert len(out["output_ids"]) == 2


def _check_4xx(status: int, data: bytes) -> None:
    assert 400 <= status < 500, (status, data[:300])
    assert json.loads(data)["error"]


generate_bodies = st.fixed_dictionaries(
    {"input_ids": json_values | st.lists(st.integers(-2**40, 2**40), max_size=5),
     "sampling_params": json_values | st.fixed_dictionaries({"max_new_tokens": scalars, "temperature": scalars,
                                                             "top_p": scalars, "stop_token_ids": json_values}),
     "lora_path": scalars | traversal, "rid": scalars, "return_logprob": scalars},
    optional={"extra": json_values})


@FUZZ
@given(body=generate_bodies | json_values)
def test_engine_generate_refuses_bad_requests_with_400(engine, body):
    server, pool, _ = engine
    status, data, _ = pool.request("POST", f"{server.url}/generate", json.dumps(body).encode())
    if status != 200:
        _check_4xx(status, data)
    _still_serves(server.url, pool)


@FUZZ
@given(route=st.sampled_from(["/load_lora_adapter", "/unload_lora_adapter", "/commit_lora_adapter"]),
       name=traversal | scalars, path=traversal | scalars, extra=json_values)
def test_engine_adapter_endpoints_refuse_bad_names_and_paths(engine, route, name, path, extra):
    server, pool, root = engine
    body = {"lora_name": name, "lora_path": path, "num_shards": extra, "adapter_config": extra}
    status, data, _ = pool.request("POST", f"{server.url}{route}", json.dumps(body).encode())
    _check_4xx(status, data)
    assert not (root / "etc").exists() and not (root.parent / "x").exists()  # nothing written outside
    _still_serves(server.url, pool)


@FUZZ
@given(name=traversal | st.text(max_size=20), index=st.text(max_size=5), shards=st.text(max_size=5),
       body=st.binary(max_size=200))
def test_engine_shard_upload_refuses_bad_shards(engine, name, index, shards, body):
    from urllib.parse import quote

    server, pool, root = engine
    status, data, _ = pool.request("PUT", f"{server.url}/lora_shards/{quote(name, safe='')}/{quote(index, safe='')}"
                                   f"?num_shards={quote(shards, safe='')}", body)
    if status == 200:  # a well-formed shard; committing garbage must then be refused
        status, data, _ = pool.request("POST", f"{server.url}/commit_lora_adapter", json.dumps(
            {"lora_name": name, "num_shards": int(shards), "adapter_config": {"peft_type": "LORA"}}).encode())
    _check_4xx(status, data)
    assert sorted(p.name for p in root.iterdir()) == ["model", "staging", "v1"]
    _still_serves(server.url, pool)


def test_engine_loading_a_corrupt_adapter_folder_is_refused_and_keeps_the_loaded_ones(engine, tmp_path):
    server, pool, _ = engine
    for name, files in {"trunc": {"adapter_config.json": b'{"peft_type": "LO', "adapter_model.safetensors": b"\x00" * 7},
                        "garbage": {"adapter_config.json": b'{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}',
                                    "adapter_model.safetensors": b"not safetensors"},
                        "empty": {}}.items():
        folder = tmp_path / name
        folder.mkdir()
        for fname, data in files.items():
            (folder / fname).write_bytes(data)
        status, data, _ = pool.request("POST", f"{server.url}/load_lora_adapter",
                                       json.dumps({"lora_name": name, "lora_path": str(folder)}).encode())
        _check_4xx(status, data)
    assert pool.json("GET", f"{server.url}/server_info")["loaded_adapters"] == ["v1"]
    _still_serves(server.url, pool)


def _raw(url: str, payload: bytes, timeout_s: float = 30.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("payload", [
    b"POST /generate HTTP/1.1\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /generate HTTP/1.1\r\nContent-Length: 1000000000000\r\n\r\n{\"input_ids\": [1]",
    b"POST /generate HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
    b"GARBAGE\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)),  # a TLS hello on the plain port
    b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
])
def test_engine_survives_malformed_http(engine, payload):
    """Framing errors: the connection gets an error answer or is closed, never a hang; the server serves on."""
    server, pool, _ = engine
    answer = _raw(server.url, payload)
    if answer.startswith(b"HTTP/1."):
        assert int(answer.split()[1]) >= 400, answer[:200]
    else:  # closed, or the standard library's HTTP/0.9-style error page for a request line without a version
        assert not answer or b"Error code: 400" in answer, answer[:200]
    _still_serves(server.url, pool)


def test_engine_refuses_a_huge_prompt_clearly(engine):
    server, pool, _ = engine
    body = json.dumps({"input_ids": [5] * 2_000_000, "sampling_params": {"max_new_tokens": 4}}).encode()  # ~6 MB
    status, data, _ = pool.request("POST", f"{server.url}/generate", body)
    _check_4xx(status, data)
    _still_serves(server.url, pool)


@pytest.fixture(scope="module")
def router():
    from serving.http import serve
    from serving.router.core import Router
    from serving.router.server import serve_router
    from serving.sim import SimEngine

    replica = serve(SimEngine(max_total_tokens=8192), port=0)
    r = Router("kv_headroom", poll_interval_s=0.2)
    r.add_replica(replica.url)
    server = serve_router(r, port=0)
    pool = HttpPool(timeout_s=60, headers=trainer_headers())  # bad input from the trainer: past the credential checks
    pool.json("POST", f"{replica.url}/load_lora_adapter", {"lora_name": "v1", "lora_path": "/unused"})
    pool.json("POST", f"{server.url}/publish_adapter", {"lora_name": "v1", "lora_path": "/unused"})
    yield server, pool, r
    server.shutdown()
    replica.shutdown()


@FUZZ
@given(route=st.sampled_from(["/generate", "/end_session", "/remove_worker", "/publish_adapter", "/workers"]),
       body=generate_bodies | json_values | st.fixed_dictionaries({"url": traversal | scalars, "rid": scalars,
                                                                  "pool": scalars, "size_gpus": scalars}))
def test_router_endpoints_refuse_bad_requests(router, route, body):
    server, pool, r = router
    replicas = dict(r.replicas)
    if route == "/workers" and isinstance(body, dict) and isinstance(body.get("url"), str) and body["url"].startswith("http"):
        body = {**body, "url": "http://127.0.0.1:9"}  # nothing listens there: stays offline, answers fast
    status, data, _ = pool.request("POST", f"{server.url}{route}", json.dumps(body).encode())
    if status != 200:
        assert 400 <= status < 500 or (route == "/workers" and status == 502), (status, data[:300])
        assert json.loads(data)["error"]
    assert r.replicas.keys() >= replicas.keys() or route == "/remove_worker"
    if route == "/remove_worker" and r.replicas.keys() != replicas.keys():  # a valid removal: put it back
        for url in replicas:
            if url not in r.replicas:
                r.add_replica(url)
    out = pool.json("POST", f"{server.url}/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8},
                                                        "lora_path": "v1", "rid": "check"})
    assert len(out["output_ids"]) == 8


# -- pxd: requests to the in-sandbox daemon ------------------------------------------------------------

@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sandboxes"))
    import pxd  # the daemon module as it runs inside a sandbox (standard library only)

    from tests.sandboxes.conftest import make_repo

    root = tmp_path_factory.mktemp("pxd")
    ws = make_repo(root / "ws")
    (root / "secret.txt").write_text("host file")
    return pxd.Daemon(str(ws)), ws, root


def _tree(ws: Path) -> dict[str, str]:
    return {str(p.relative_to(ws)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ws.rglob("*")) if p.is_file() and ".git" not in p.parts}


@FUZZ
@given(route=st.sampled_from(["/file/read", "/file/write", "/exec", "/session/exec", "/git/diff", "/git/commit",
                              "/git/status", "/nope"]),
       body=st.fixed_dictionaries({}, optional={"path": traversal | scalars, "cwd": traversal | scalars,
                                                "argv": json_values, "timeout_s": scalars, "head_bytes": scalars,
                                                "content_b64": scalars, "env": json_values, "session": scalars,
                                                "max_bytes": scalars, "message": scalars}) | json_values,
       raw=st.booleans(), junk=st.binary(max_size=40))
def test_pxd_refuses_bad_requests_and_never_leaves_the_workspace(daemon, route, body, raw, junk):
    d, ws, root = daemon
    before = _tree(ws)
    payload = junk if raw else json.dumps(body).encode()
    if route in ("/exec", "/session/exec") and isinstance(body, dict) and body.get("argv") is not None:
        payload = json.dumps({**body, "argv": ["true"]}).encode() if not raw else payload  # run nothing harmful
    status, answer = d.handle(f"POST {route} HTTP/1.1", payload)
    assert status != 500, answer
    if status != 200:
        assert answer["error"]
    if route in ("/file/write", "/git/commit") and status == 200:
        return  # a valid write changed the workspace on purpose
    if route == "/file/read" and status == 200:
        assert "host file" not in json.dumps(answer)
    assert _tree(ws) == before
    assert (root / "secret.txt").read_text() == "host file"


@FUZZ
@given(data=st.binary(max_size=300) | st.sampled_from([
    b"POST /exec HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n", b"POST /exec HTTP/1.1\r\nbad header\r\n\r\n",
    b"POST /exec HTTP/1.1\r\nContent-Length: 10\r\n\r\n{}"]))
def test_pxd_framing_of_any_bytes_is_a_request_or_a_request_error(daemon, data):
    import io

    import pxd

    try:
        pxd.read_message(io.BytesIO(data))
    except pxd.RequestError as exc:
        assert str(exc) and exc.status in (400, 413)


def test_a_body_over_the_servers_limit_is_refused_before_it_is_read():
    """A body larger than ``max_body_bytes`` gets 413 as soon as the headers arrive: the server does
    not wait for (or buffer) the body, closes that connection and serves the next one."""
    from serving.http import JsonServer

    server = JsonServer({("POST", "/echo"): lambda r: {"bytes": len(r.body)}}, port=0, max_body_bytes=1024).start()
    try:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /echo HTTP/1.1\r\nContent-Length: 4096\r\n\r\n" + b"x" * 100)  # the rest never comes
            answer = b""
            while b"outside 0..1024" not in answer:  # the answer may come in more than one segment
                try:
                    chunk = s.recv(65536)
                except ConnectionResetError:  # the unread body makes the close a reset
                    break
                if not chunk:
                    break
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 413") and b"outside 0..1024" in answer, answer[:200]
        status, data, _ = HttpPool(timeout_s=10).request("POST", f"{server.url}/echo", b"y" * 1024)
        assert status == 200 and json.loads(data) == {"bytes": 1024}
    finally:
        server.shutdown()


# -- files that are not regular files ---------------------------------------------------------------
# Opening a FIFO for reading waits for a writer that never comes: every command that reads a file it
# is given refuses a FIFO, a device or a folder at once, naming it (sandboxes/files.py). The commands
# run as processes under a timeout, so a command that waits fails its test instead of hanging CI.

ROOT = Path(__file__).resolve().parents[2]
WAIT_LIMIT_S = 60  # far above a refusal (the command's imports); a command that waits fails here


def test_the_regular_file_helper_refuses_fifos_devices_and_folders(tmp_path):
    import os

    from sandboxes.files import NotARegularFile, read_regular_bytes

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "file").write_bytes(b"data")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    for path, kind in ((fifo, "a FIFO"), (tmp_path, "a folder"), ("/dev/null", "a character device")):
        with pytest.raises(NotARegularFile, match=f"^{path}: is {kind}.*expected a regular file$"):
            read_regular_bytes(path)
    assert read_regular_bytes(tmp_path / "link") == b"data"  # a symlink to a file is that file
    with pytest.raises(FileNotFoundError):
        read_regular_bytes(tmp_path / "missing")


def test_a_fifo_swapped_in_after_the_check_is_refused_without_waiting(tmp_path, monkeypatch):
    """The check before the open is skipped here, as when a FIFO replaces the file between the two:
    the open does not block (``O_NONBLOCK``) and the ``fstat`` after it refuses the FIFO."""
    import os
    import threading

    import sandboxes.files as files

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    monkeypatch.setattr(files, "check_regular_file", lambda path: None)
    outcome: list[BaseException | bytes] = []

    def read():
        try:
            outcome.append(files.read_regular_bytes(fifo))
        except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(WAIT_LIMIT_S)
    if reader.is_alive():  # it waits for a writer: unblock it so the thread ends, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail(f"reading {fifo} waited for a writer")
    assert isinstance(outcome[0], files.NotARegularFile) and "FIFO" in str(outcome[0])


@pytest.fixture(scope="module")
def not_files(tmp_path_factory):
    """A folder of FIFOs where each command expects a file, and of task sources, lists and run
    folders holding a FIFO where a file belongs."""
    import os

    root = tmp_path_factory.mktemp("fifos")
    for name in ("run.toml", "report.xml", "config.json", "rows.parquet", "tasks.jsonl", "lists.json", "knobs.json"):
        os.mkfifo(root / name)
    (root / "good-config.json").write_text(json.dumps({"f2p_node_ids": ["t.a"], "p2p_node_ids": [],
                                                      "grade": {"format": "junit"}}))
    harbor = root / "harbor" / "tasks" / "t1"
    (harbor / "tests").mkdir(parents=True)
    (harbor / "task.toml").write_text('[metadata]\ntask_id = "t1"\n[environment]\ndocker_image = "x"\n')
    (harbor / "instruction.md").write_text("fix it\n")
    (harbor / "tests" / "config.json").write_text((root / "good-config.json").read_text())
    os.mkfifo(harbor / "tests" / "test.sh")
    suite = root / "suite"
    (suite / "tasks" / "t1").mkdir(parents=True)
    (suite / "suite.json").write_text(json.dumps({"tasks": ["t1"]}))
    os.mkfifo(suite / "tasks" / "t1" / "task.json")
    (root / "home" / "datasets" / "flawed").mkdir(parents=True)
    os.mkfifo(root / "home" / "datasets" / "flawed" / "list.json")
    (root / "run-dir").mkdir()
    os.mkfifo(root / "run-dir" / "resolved-plan.json")
    return root


# (command line, exit status, the path its message must name); {d} is the folder of not_files
NOT_A_FILE_COMMANDS = [
    pytest.param(["plan", "{d}/run.toml"], 2, "{d}/run.toml", id="plan"),
    pytest.param(["validate", "/dev/null"], 2, "/dev/null", id="validate-device"),
    pytest.param(["run", "{d}/run.toml", "--dry-run"], 2, "{d}/run.toml", id="run"),
    pytest.param(["run", str(ROOT / "examples" / "embedded.toml"), "--run-dir", "{d}/run-dir"], 3,
                 "{d}/run-dir/resolved-plan.json", id="run-resolved-plan"),
    pytest.param(["grade", "--config", "{d}/good-config.json", "--report", "{d}/report.xml"], 2, "{d}/report.xml",
                 id="grade-report"),
    pytest.param(["grade", "--config", "{d}/good-config.json", "--report", "{d}"], 2, "{d}", id="grade-report-folder"),
    pytest.param(["grade", "--config", "{d}/config.json", "--report", "{d}/report.xml"], 2, "{d}/config.json",
                 id="grade-config"),
    pytest.param(["score", "{d}/rows.parquet"], 2, "{d}/rows.parquet", id="score"),
    pytest.param(["tasks", "inspect", "{d}/tasks.jsonl"], 2, "{d}/tasks.jsonl", id="tasks-inspect"),
    pytest.param(["tasks", "inspect", "{d}/suite"], 2, "{d}/suite/tasks/t1/task.json", id="tasks-inspect-suite"),
    # a Harbor dataset loads with the task it cannot read listed as incomplete, the FIFO named
    pytest.param(["tasks", "inspect", "{d}/harbor"], 0, "{d}/harbor/tasks/t1/tests/test.sh", id="tasks-inspect-harbor"),
    pytest.param(["tasks", "export-harbor", "{d}/suite", "{d}/out"], 2, "{d}/suite/tasks/t1/task.json",
                 id="tasks-export-harbor"),
    pytest.param(["tasks", "flawed-lists", "{d}/lists.json"], 2, "{d}/lists.json", id="tasks-flawed-lists"),
    pytest.param(["eval", "{d}/no-dataset", "--sources", "{d}", "--agent", "nop"], 2,
                 "{d}/home/datasets/flawed/list.json", id="eval-flawed-list"),
    pytest.param(["serving", "sglang-args", "{d}/knobs.json"], 2, "{d}/knobs.json", id="serving-sglang-args"),
    pytest.param(["sandbox", "exec", "--task", "t1", "--suite", "{d}/suite", "--", "true"], 2,
                 "{d}/suite/tasks/t1/task.json", id="sandbox-exec"),
]


@pytest.mark.parametrize("argv, status, named", NOT_A_FILE_COMMANDS)
def test_commands_refuse_a_fifo_at_once_naming_it(not_files, argv, status, named):
    import os
    import re
    import subprocess
    import sys

    d = str(not_files)
    argv = [a.replace("{d}", d) for a in argv]
    env = {**os.environ, "POSTTRAIN_HOME": f"{d}/home", "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run([sys.executable, "-m", "dagster_project.cli", *argv], capture_output=True, text=True,
                              cwd=d, env=env, timeout=WAIT_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"posttrain {' '.join(argv)} still waits after {WAIT_LIMIT_S} s")
    lines = [line for line in (done.stderr + done.stdout).splitlines() if named.replace("{d}", d) in line]
    assert done.returncode == status, done.stderr[-2000:]
    assert lines and re.search(r"is a (FIFO|folder|character device)", lines[0]), done.stderr[-2000:] + done.stdout[-500:]
