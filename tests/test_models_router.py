"""Router mode: several models behind one server (--models-dir, --models-preset), each in its own
server process: the model list and its statuses, load and unload, routing by the body's `model` and
the `?model=` parameter with llama-server's errors, autoload, --models-max eviction, the memory budget,
idle models put to sleep, a model that fails to load, streams passed through, the API key, and the
children stopped with the router."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time

import pytest

from server_util import ServerProcess, child_pids

from pyllama.server.http import Request
from pyllama.server.models.process import ModelProcess
from pyllama.server.models.proxy import forward
from pyllama.server.models.registry import ModelRegistry, estimate_memory, parse_ini, passthrough_args
from pyllama.util.errors import PyllamaError

PROMPT = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0}


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie waiting for its parent does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 15) -> list[int]:
    """The processes of `pids` still running after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def statuses(router: ServerProcess) -> dict[str, dict]:
    code, body = router.request("GET", "/models")
    assert code == 200, body
    return {m["id"]: m["status"] for m in body["data"]}


def wait_status(router: ServerProcess, name: str, value: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = statuses(router)[name]
        if status["value"] == value:
            return status
        assert time.monotonic() < deadline, f"{name} stayed {status} (wanted {value})"
        time.sleep(0.05)


def start_router(*args: str, sizes: tuple[str, ...] = ("-c", "512", "-np", "1")) -> ServerProcess:
    router = ServerProcess("", *args, *sizes)
    try:
        return router.wait_ready()
    except BaseException:
        router.stop()
        raise


def stop_router(router: ServerProcess) -> None:
    """Stops the router and checks that no model process outlives it."""
    kids = child_pids(router.proc.pid)
    code = router.stop()
    left = wait_gone(kids)
    for k in left:
        os.kill(k, signal.SIGKILL)
    assert code == 0 and not left, router.stderr_text[-2000:]


@pytest.fixture(scope="module")
def models_dir(model_factory, tmp_path_factory):
    """Three tiny models (a, b, c), one in a subfolder, and a file that is no GGUF (broken)."""
    d = tmp_path_factory.mktemp("router_models")
    shutil.copy(model_factory("tiny", seed=1), d / "a.gguf")
    shutil.copy(model_factory("tiny", seed=2), d / "b.gguf")
    (d / "c").mkdir()
    shutil.copy(model_factory("tiny", seed=3), d / "c" / "c-model.gguf")
    (d / "broken.gguf").write_bytes(b"not a model at all, only some bytes")
    (d / "notes.txt").write_text("not a model")
    return d


@pytest.fixture(scope="module")
def router(models_dir):
    """A router of the folder with at most two models loaded at once."""
    r = start_router("--models-dir", str(models_dir), "--models-max", "2")
    try:
        yield r
    finally:
        stop_router(r)


def complete(router: ServerProcess, model: str, **kw) -> tuple[int, dict]:
    return router.post("/v1/completions", {**PROMPT, "model": model, **kw})


# --- the registry, without processes -----------------------------------------------------------
def test_models_dir_scan_names_files_and_subfolders(models_dir):
    reg = ModelRegistry(str(models_dir), None, ["--models-dir", str(models_dir), "-t", "1"])
    assert sorted(reg.models) == ["a", "b", "broken", "c"]
    assert reg.models["c"].path == str(models_dir / "c" / "c-model.gguf")
    entry = reg.models["a"]
    assert entry.source == "models_dir" and entry.options == ["-t", "1"]
    assert entry.argv(1234)[-8:] == ["-m", str(models_dir / "a.gguf"), "--host", "127.0.0.1", "--port", "1234",
                                     "--alias", "a"]


def test_preset_options_precedence_and_spellings(models_dir, tmp_path):
    ini = tmp_path / "p.ini"
    ini.write_text("version = 1\n; a comment\n[*]\nc = 1024\nn-predict = 7 ; trailing comment\nwarmup = false\n"
                   "[a]\nc = 2048\nLLAMA_ARG_N_PARALLEL = 2\nalias = first,primo\nstop-timeout = 3\n"
                   f"[custom]\nmodel = {models_dir / 'b.gguf'}\nload-on-startup = true\nno-warmup = false\n"
                   "sleep-idle-seconds = 5\n")
    reg = ModelRegistry(str(models_dir), str(ini), ["--models-preset", str(ini), "--n-predict", "9"])
    a = reg.models["a"]
    assert a.source == "preset" and a.stop_timeout == 3 and reg.find("primo") is a
    # the router's command line wins over the sections; a model's section over [*]
    assert a.options == ["--ctx-size", "2048", "--no-warmup", "--parallel", "2", "--n-predict", "9"]
    custom = reg.models["custom"]
    assert custom.load_on_startup and custom.sleep_idle_seconds == 5
    assert "--warmup" in custom.options and "--no-warmup" not in custom.options
    assert reg.models["b"].source == "models_dir" and "--ctx-size" in reg.models["b"].options


@pytest.mark.parametrize("text, message", [
    ("[a]\nnot-a-flag = 1\n", "option 'not-a-flag' not recognized"),
    ("[a]\ncontrol-vector = x.gguf\n", "not supported by pyllama"),
    ("[a]\nc = many\n", "'many'"),
    ("[a]\nwarmup = perhaps\n", "not a boolean"),
    ("[a\nc = 1\n", "a section header"),
    ("[a]\njust some words\n", "expected 'key = value'"),
    ("c = 1\n", "outside any section"),
    ("[nowhere]\nc = 1\n", "no model file"),
    ("[a]\nstop-timeout = soon\n", "stop-timeout"),
])
def test_bad_preset_is_one_clear_error(models_dir, tmp_path, text, message):
    ini = tmp_path / "bad.ini"
    ini.write_text(text)
    with pytest.raises(PyllamaError, match=message) as err:
        ModelRegistry(str(models_dir), str(ini), [])
    assert "\n" not in str(err.value)


def test_missing_folder_or_preset_file(tmp_path):
    with pytest.raises(PyllamaError, match="does not exist or is not a directory"):
        ModelRegistry(str(tmp_path / "none"), None, [])
    with pytest.raises(PyllamaError, match="cannot read it"):
        ModelRegistry(None, str(tmp_path / "none.ini"), [])


def test_router_flags_stay_with_the_router():
    kept, dests = passthrough_args(["--models-dir", "d", "--port", "9", "-t", "2", "--api-key=k", "-c", "64",
                                    "--no-models-autoload", "--models-memory", "100", "--sleep-idle-seconds", "3"])
    assert kept == ["-t", "2", "-c", "64"] and dests == {"threads", "ctx_size"}


def test_ini_values_and_memory_estimate(models_dir):
    assert parse_ini("[x]\nk = a b ; c\nurl = http://h/#frag\n", "p")["x"] == {"k": "a b", "url": "http://h/#frag"}
    small, large = estimate_memory(str(models_dir / "a.gguf"), ["-c", "512"]), \
        estimate_memory(str(models_dir / "a.gguf"), ["-c", "8192"])
    assert small > os.path.getsize(models_dir / "a.gguf") and large > small
    assert estimate_memory(str(models_dir / "broken.gguf"), []) > 0


def test_program_refuses_a_bad_configuration(tmp_path):
    for args in (["--models-dir", str(tmp_path / "none")], ["--models-preset", str(tmp_path / "none.ini")]):
        server = ServerProcess("", *args)
        server.proc.wait(60)
        assert server.stop() == 1
        assert "error:" in server.stderr_text and "Traceback" not in server.stderr_text


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def test_forward_relays_each_piece_as_it_arrives():
    """The proxy hands on the first event while the model's server still holds the second."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    release = threading.Event()
    seen: list[bytes] = []

    def child() -> None:
        conn, _ = srv.accept()
        with conn:
            seen.append(conn.recv(65536))
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                         b"X-Model-Note: kept\r\n\r\n" + _chunk(b"data: 1\n\n"))
            release.wait(10)
            conn.sendall(_chunk(b"data: 2\n\n") + b"0\r\n\r\n")

    thread = threading.Thread(target=child, daemon=True)
    thread.start()

    async def run() -> tuple:
        done: list[int] = []
        req = Request("POST", "/v1/completions", {"model": "a"}, {"authorization": "Bearer k", "host": "x"}, b"{}")
        resp = await forward(req, srv.getsockname()[1], 10.0, lambda: done.append(1))
        it = resp.chunks.__aiter__()
        first = await asyncio.wait_for(it.__anext__(), 5)  # the child has not sent the rest yet
        release.set()
        rest = [c async for c in it]
        return resp, first, rest, done

    try:
        resp, first, rest, done = asyncio.run(run())
    finally:
        release.set()
        thread.join(10)
        srv.close()
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    assert ("x-model-note", "kept") in resp.headers
    assert first == b"data: 1\n\n" and b"".join(rest) == b"data: 2\n\n" and done == [1]
    head = seen[0].split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"post /v1/completions?model=a http/1.1") and b"authorization: bearer k" in head
    assert b"host: x" not in head


@pytest.mark.integration  # a model server process, started by the fixture or the test
def test_model_output_is_drained_and_prefixed(capfd):
    """A model server's output reaches the router's stderr line by line after its name, a line
    longer than any read buffer included (an undrained pipe would block the model server)."""
    code = "import sys; sys.stdout.write('x' * 200000 + '\\n'); print('done'); print('tail', end='')"

    async def run() -> int:
        p = ModelProcess("m", [sys.executable, "-c", code], 0, dict(os.environ), 5.0)
        await p.start()
        return await asyncio.wait_for(p.wait(), 30)

    assert asyncio.run(run()) == 0
    err = capfd.readouterr().err
    assert "[m] done\n" in err and "[m] tail\n" in err and err.count("x") >= 200000


# --- one router for most checks ---------------------------------------------------------------
@pytest.mark.integration  # a model server process, started by the fixture or the test
def test_listing_shows_every_model_unloaded_first(router):
    code, body = router.request("GET", "/v1/models")
    assert code == 200 and body["object"] == "list"
    ids = [m["id"] for m in body["data"]]
    assert ids == ["a", "b", "broken", "c"]
    for m in body["data"]:
        assert m["object"] == "model" and m["source"] == "models_dir"
        assert m["status"]["args"][1:3] == ["-m", "pyllama.server"] and "--alias" in m["status"]["args"]


@pytest.mark.integration  # a model server process, started by the fixture or the test
def test_routing_errors_as_llama_server(router):
    code, body = router.post("/v1/completions", PROMPT)
    assert code == 400 and body["error"]["message"] == "model name is missing from the request"
    code, body = complete(router, "nosuch")
    assert code == 400 and body["error"]["message"] == "model 'nosuch' not found"
    code, body = router.request("GET", "/slots")
    assert code == 400 and body["error"]["message"] == "model name is missing from the request"
    code, body = router.request("POST", "/v1/completions", raw=b"{not json")
    assert code == 400 and "Invalid JSON" in body["error"]["message"]
    code, body = router.request("GET", "/props")
    assert code == 200 and body["role"] == "router" and body["max_instances"] == 2


@pytest.mark.integration  # a model server process, started by the fixture or the test
def test_autoload_and_routing_by_body_and_query(router):
    code, body = complete(router, "a")
    assert code == 200 and body["model"] == "a" and body["usage"]["completion_tokens"] == 4
    assert statuses(router)["a"]["value"] == "loaded"
    listed = {m["id"]: m for m in router.request("GET", "/models")[1]["data"]}
    assert listed["a"]["meta"]["n_vocab"] > 0 and listed["a"]["owned_by"] == "pyllama"  # the model server's own
    code, props = router.request("GET", "/props?model=a")
    assert code == 200 and props["model_alias"] == "a"
    code, body = router.post("/v1/chat/completions", {"model": "a", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert code == 200 and body["model"] == "a"


@pytest.mark.integration  # a model server process, started by the fixture or the test
def test_load_and_unload_endpoints(router):
    code, body = router.post("/models/load", {"model": "nosuch"})
    assert code == 404 and body["error"]["message"] == "model is not found"
    code, body = router.post("/models/unload", {"model": "b"})
    assert code == 400 and body["error"]["message"] == "model is not running"
    code, body = router.post("/models/load", {"model": "b"})
    assert code == 200 and body == {"success": True}
    wait_status(router, "b", "loaded")
    code, body = router.post("/models/load", {"model": "b"})
    assert code == 400 and body["error"]["message"] == "model is already running"
    code, body = router.post("/models/unload", {"model": "b"})
    assert code == 200 and body == {"success": True}
    assert wait_status(router, "b", "unloaded") == {"value": "unloaded", "args": statuses(router)["b"]["args"]}


@pytest.mark.integration  # a model server process, started by the fixture or the test
def test_models_max_unloads_the_least_recently_used(router):
    assert complete(router, "a")[0] == 200
    assert complete(router, "b")[0] == 200
    assert complete(router, "a")[0] == 200  # b is now the least recently used
    assert len(child_pids(router.proc.pid)) == 2
    code, body = complete(router, "c")
    assert code == 200 and body["model"] == "c"
    st = statuses(router)
    assert (st["a"]["value"], st["b"]["value"], st["c"]["value"]) == ("loaded", "unloaded", "loaded")
    assert len(child_pids(router.proc.pid)) == 2


@pytest.mark.integration  # a model server process, started by the fixture or the test
def test_a_model_that_fails_to_load_does_not_affect_the_others(router):
    code, body = complete(router, "broken")
    assert code == 500 and body["error"]["message"] == "model name=broken failed to load"
    st = statuses(router)["broken"]
    assert st["value"] == "unloaded" and st["failed"] is True and st["exit_code"] == 1
    code, body = complete(router, "a")
    assert code == 200 and body["model"] == "a"


@pytest.mark.integration  # a model server process, started by the fixture or the test
def test_streams_pass_through_as_they_come(router):
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({"model": "a", "prompt": "Once", "max_tokens": 200,
                                                                 "temperature": 0, "ignore_eos": True,
                                                                 "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
        first = resp.readline()
        assert first.startswith(b"data: {")  # an event before the generation is over
        rest = resp.read()
    finally:
        conn.close()
    events = [ln[6:] for ln in (first + rest).split(b"\n") if ln.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and len(events) > 100
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


@pytest.mark.integration  # a model server process, started by the fixture or the test
def test_streamed_chat_through_the_router(router):
    events = router.stream("/v1/chat/completions", {"model": "a", "max_tokens": 3,
                                                    "messages": [{"role": "user", "content": "hi"}]})
    assert events[-1] == "[DONE]" and all(e["model"] == "a" for e in events[:-1])


# --- routers of their own ---------------------------------------------------------------------
def test_no_autoload_api_key_and_idle_sleep(models_dir):
    r = start_router("--models-dir", str(models_dir), "--no-models-autoload", "--api-key", "sekrit",
                     "--sleep-idle-seconds", "1")
    key = {"Authorization": "Bearer sekrit"}
    try:
        code, body = r.post("/v1/completions", {**PROMPT, "model": "a"})
        assert code == 401
        assert r.request("GET", "/models")[0] == 200  # public, as llama-server's
        code, body = r.post("/v1/completions", {**PROMPT, "model": "a"}, headers=key)
        assert code == 400 and body["error"]["message"] == "model is not loaded"
        code, body = r.post("/v1/completions?autoload=true", {**PROMPT, "model": "a"}, headers=key)
        assert code == 200 and body["model"] == "a"
        assert len(child_pids(r.proc.pid)) == 1
        wait_status(r, "a", "sleeping", timeout=15)
        deadline = time.monotonic() + 10
        while child_pids(r.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child_pids(r.proc.pid) == []
        # a sleeping model wakes on its next request, autoload or not
        code, body = r.post("/v1/completions", {**PROMPT, "model": "a"}, headers=key)
        assert code == 200 and body["model"] == "a"
        assert statuses(r)["a"]["value"] == "loaded"
        # a request for a model that is still loading waits for it
        assert r.post("/models/load", {"model": "b"}, headers=key) == (200, {"success": True})
        code, body = r.post("/v1/completions", {**PROMPT, "model": "b"}, headers=key)
        assert code == 200 and body["model"] == "b"
    finally:
        stop_router(r)


def test_memory_budget_refuses_and_evicts(models_dir, tmp_path):
    ini = tmp_path / "mem.ini"
    # the sizes in the preset: the router's own -c would win over the sections
    ini.write_text(f"[*]\nc = 512\nnp = 1\n[big]\nmodel = {models_dir / 'a.gguf'}\nc = 2000000\n")
    a_bytes = estimate_memory(str(models_dir / "a.gguf"), ["-c", "512"])
    budget = (2 * a_bytes + a_bytes // 2) >> 20  # two small models fit, not three
    r = start_router("--models-dir", str(models_dir), "--models-preset", str(ini), "--models-max", "0",
                     "--models-memory", str(budget), sizes=())
    try:
        code, body = complete(r, "big")
        assert code == 503 and "not enough memory for model 'big'" in body["error"]["message"]
        assert body["error"]["type"] == "unavailable_error" and statuses(r)["big"]["value"] == "unloaded"
        assert complete(r, "a")[0] == 200 and complete(r, "b")[0] == 200
        code, body = complete(r, "c")  # a, the least recently used, makes room
        assert code == 200
        st = statuses(r)
        assert (st["a"]["value"], st["b"]["value"], st["c"]["value"]) == ("unloaded", "loaded", "loaded")
        code, body = r.request("GET", "/models")
        assert {m["id"]: m["memory_estimate"] for m in body["data"]}["a"] == a_bytes
    finally:
        stop_router(r)


def test_children_stop_with_the_router(models_dir, tmp_path):
    r = start_router("--models-dir", str(models_dir))
    kids: list[int] = []
    try:
        assert complete(r, "a")[0] == 200 and complete(r, "b")[0] == 200
        kids = child_pids(r.proc.pid)
        assert len(kids) == 2
        r.proc.send_signal(signal.SIGINT)
        assert r.proc.wait(30) == 0
        assert wait_gone(kids, 5) == []
    finally:
        r.stop()
        for k in wait_gone(kids, 0):
            os.kill(k, signal.SIGKILL)
    # a router killed outright: the kernel sends its children SIGTERM (a, loaded at start-up)
    ini = tmp_path / "startup.ini"
    ini.write_text("[a]\nload-on-startup = true\n")
    r = start_router("--models-dir", str(models_dir), "--models-preset", str(ini))
    kids = []
    try:
        wait_status(r, "a", "loaded")
        kids = child_pids(r.proc.pid)
        assert len(kids) == 1
        r.proc.kill()
        r.proc.wait(10)
        assert wait_gone(kids) == []
    finally:
        r.stop()
        for k in wait_gone(kids, 0):
            os.kill(k, signal.SIGKILL)
