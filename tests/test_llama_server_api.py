"""llama-server's endpoints and fields as scripts use them: API keys, CORS, /props, /slots (and slot
save / restore / erase), /v1/models, /tokenize, error fields, /completion's fields, /infill,
/embeddings, /metrics, __verbose.

One in-process server (the server's own load() and HTTPServer, on a free loopback port) serves the
module; each test sets the ServerState fields the command line would set, and puts them back.
"""
from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import math
import os
import threading
import zlib
from typing import Any, Optional

import numpy as np
import pytest
import uvloop

from pyllama.server.__main__ import build_parser, load
from pyllama.server.api import Api, ServerState, infill_prompt, nested_fields, valid_slot_filename
from pyllama.server import slot_file
from pyllama.server.http import HTTPError, HTTPServer, Request, api_key_valid, origin_allowed

N_SLOTS, N_CTX = 2, 512
SLOT_CTX = N_CTX // N_SLOTS
PROMPT = "The quick brown fox jumps over the lazy dog"


class InProcessServer:
    def __init__(self, model: str, *extra: str):
        args = build_parser().parse_args(["-m", model, "-np", str(N_SLOTS), "-c", str(N_CTX), "-t", "1", *extra])
        self.state = ServerState(args)
        load(self.state)
        self.api = Api(self.state)
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.http = HTTPServer(self.api.routes(), access=self.state, public_paths=self.api.public_paths())
        self.port = asyncio.run_coroutine_threadsafe(self.http.start("127.0.0.1", 0), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.http.shutdown(1.0), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.state.router.stop()
        if self.state.reconnector is not None:
            self.state.reconnector.stop()
        for g in self.state.groups:
            g.stop()
        self.state.engine.close()

    def request(self, method: str, path: str, body: Any = None,
                headers: Optional[dict] = None) -> tuple[int, Any, http.client.HTTPResponse]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            payload = resp.read()
            ctype = resp.getheader("Content-Type", "")
            return resp.status, json.loads(payload) if "json" in ctype and payload else payload.decode(), resp
        finally:
            conn.close()

    def post(self, path: str, body: Any, **kw) -> tuple[int, Any]:
        status, doc, _ = self.request("POST", path, body, **kw)
        return status, doc

    def get(self, path: str, **kw) -> tuple[int, Any]:
        status, doc, _ = self.request("GET", path, **kw)
        return status, doc

    def stream(self, path: str, body: dict) -> list[Any]:
        status, text, _ = self.request("POST", path, {**body, "stream": True})
        assert status == 200, text
        return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ") and line[6:] != "[DONE]"]

    @contextlib.contextmanager
    def settings(self, **fields):
        old = {k: getattr(self.state, k) for k in fields}
        for k, v in fields.items():
            setattr(self.state, k, v)
        try:
            yield self.state
        finally:
            for k, v in old.items():
                setattr(self.state, k, v)


@pytest.fixture(scope="module")
def srv(tiny_model):
    s = InProcessServer(tiny_model)
    try:
        yield s
    finally:
        s.close()


GREEDY = {"n_predict": 6, "temperature": 0, "ignore_eos": True}


# --- API keys ------------------------------------------------------------------------------------

INVALID_KEY = {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}


def test_api_key_required_everywhere_but_health_and_models(srv):
    with srv.settings(api_keys=["key-one", "key-two"]):
        for method, path in (("GET", "/props"), ("GET", "/slots"), ("POST", "/completion"),
                             ("POST", "/v1/chat/completions"), ("GET", "/no-such-path")):
            status, doc, _ = srv.request(method, path, {"prompt": "x"} if method == "POST" else None)
            assert (status, doc) == (401, INVALID_KEY), path
            status, doc, _ = srv.request(method, path, headers={"Authorization": "Bearer key-three"})
            assert (status, doc) == (401, INVALID_KEY), path
        assert srv.get("/health") == (200, {"status": "ok"})
        assert srv.get("/v1/health") == (200, {"status": "ok"})
        # as llama-server: a client may list the model before it has a key
        assert srv.get("/v1/models")[0] == srv.get("/models")[0] == 200
        assert srv.get("/props", headers={"Authorization": "Bearer key-two"})[0] == 200
        assert srv.get("/props", headers={"X-Api-Key": "key-one"})[0] == 200
        assert srv.get("/props", headers={"Authorization": "Bearer key-one-and-more"})[0] == 401
        status, doc = srv.post("/completion", {"prompt": PROMPT, **GREEDY}, headers={"Authorization": "Bearer key-one"})
        assert status == 200 and doc["tokens_predicted"] == 6
        # a browser's preflight carries no credentials: answered
        status, _, resp = srv.request("OPTIONS", "/completion", headers={"Origin": "http://localhost:3000",
                                                                          "Access-Control-Request-Method": "POST"})
        assert status == 200 and resp.getheader("Access-Control-Allow-Origin") == "http://localhost:3000"
    assert srv.get("/props")[0] == 200  # no keys: open


def test_api_key_valid_checks_every_key():
    def req(**headers) -> Request:
        return Request("GET", "/props", headers={k.lower().replace("_", "-"): v for k, v in headers.items()})
    keys = ["a" * 16, "b" * 16]
    assert api_key_valid(req(Authorization="Bearer " + "b" * 16), keys)
    assert api_key_valid(req(authorization="bearer " + "a" * 16), keys)
    assert api_key_valid(req(x_api_key="a" * 16), keys)
    assert not api_key_valid(req(Authorization="a" * 16), keys)  # no Bearer
    assert not api_key_valid(req(Authorization="Bearer " + "a" * 15), keys)
    assert not api_key_valid(req(), keys)


# --- CORS -----------------------------------------------------------------------------------------

def test_cors_reflects_only_local_origins_by_default(srv):
    for origin in ("http://localhost", "http://localhost:5173", "https://127.0.0.1:8443", "http://[::1]:8080"):
        _, _, resp = srv.request("GET", "/health", headers={"Origin": origin})
        assert resp.getheader("Access-Control-Allow-Origin") == origin
        assert "Origin" in resp.getheader("Vary")
    for origin in ("http://evil.example", "http://localhost.evil.example", "http://127.0.0.1.evil.example",
                   "file://", "null"):
        _, _, resp = srv.request("GET", "/health", headers={"Origin": origin})
        assert resp.getheader("Access-Control-Allow-Origin") is None, origin
    _, _, resp = srv.request("GET", "/health")
    assert resp.getheader("Access-Control-Allow-Origin") is None


def test_cors_origins_widen_it(srv):
    with srv.settings(cors_origins=["https://app.example"]):
        _, _, resp = srv.request("GET", "/health", headers={"Origin": "https://app.example"})
        assert resp.getheader("Access-Control-Allow-Origin") == "https://app.example"
        _, _, resp = srv.request("GET", "/health", headers={"Origin": "https://other.example"})
        assert resp.getheader("Access-Control-Allow-Origin") is None
    with srv.settings(cors_origins=["*"]):
        _, _, resp = srv.request("GET", "/health", headers={"Origin": "https://other.example"})
        assert resp.getheader("Access-Control-Allow-Origin") == "https://other.example"


def test_cors_preflight(srv):
    status, body, resp = srv.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 200 and body == ""
    assert resp.getheader("Access-Control-Allow-Origin") == "http://localhost:3000"
    assert "POST" in resp.getheader("Access-Control-Allow-Methods").split(", ")
    assert resp.getheader("Access-Control-Allow-Headers") == "authorization, content-type"


def test_cors_methods_headers_and_credentials(srv):
    """--cors-methods, --cors-headers, --no-cors-credentials (llama-server's flags)."""
    ask = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    with srv.settings(cors_methods=["GET", "POST"], cors_headers=["*"]):
        _, _, resp = srv.request("OPTIONS", "/v1/chat/completions", headers=ask)
        assert resp.getheader("Access-Control-Allow-Methods") == "GET, POST"
        assert resp.getheader("Access-Control-Allow-Headers") == "*"
    _, _, resp = srv.request("GET", "/health", headers={"Origin": "http://localhost:3000"})
    assert resp.getheader("Access-Control-Allow-Credentials") == "true"
    with srv.settings(cors_credentials=False):
        _, _, resp = srv.request("GET", "/health", headers={"Origin": "http://localhost:3000"})
        assert resp.getheader("Access-Control-Allow-Origin") == "http://localhost:3000"
        assert resp.getheader("Access-Control-Allow-Credentials") is None


def test_origin_allowed():
    assert origin_allowed("http://localhost:1", [])
    assert not origin_allowed("http://localhost:1/path", [])
    assert not origin_allowed("", ["*"])
    assert origin_allowed("https://a.example", ["https://a.example/"])


# --- /props ---------------------------------------------------------------------------------------

def test_props_values(srv, tiny_model):
    status, props = srv.get("/props")
    assert status == 200
    dgs = props["default_generation_settings"]
    assert dgs["n_ctx"] == SLOT_CTX and dgs["is_processing"] is False
    params = dgs["params"]
    assert params["n_predict"] == -1 and params["temperature"] == pytest.approx(0.8)
    assert (params["top_k"], params["top_p"], params["min_p"]) == (40, pytest.approx(0.95), pytest.approx(0.05))
    assert params["repeat_last_n"] == 64 and params["repeat_penalty"] == 1.0 and params["seed"] == -1
    assert params["n_probs"] == 0 and params["stop"] == [] and params["ignore_eos"] is False
    assert params["samplers"] == ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                                  "temperature"]
    # llama-server's fields for what neither the model nor the server here has, at their "off" values
    assert (params["adaptive_target"], params["lora"], params["speculative.types"], params["n_discard"]) == \
        (-1.0, [], "none", 0)
    assert params["backend_sampling"] is False  # the output layer is local: sampled on this host
    assert props["total_slots"] == N_SLOTS
    assert props["model_path"] == tiny_model and props["model_alias"] == os.path.basename(tiny_model)
    assert props["bos_token"] == "<s>" and props["eos_token"] == srv.state.tokenizer.token_text(srv.state.tokenizer.eos_id)
    assert props["build_info"].startswith("pyllama ")
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert props["model_ftype"] == "all F32" and props["is_sleeping"] is False  # llama.cpp's name of the type
    # what llama-server's own page reads (build 9749): the page on, no settings of its own, no CORS
    # proxy, and the marker a multimodal prompt would carry (a text model never expands it)
    assert props["ui"] is True and props["ui_settings"] == {} and props["cors_proxy_enabled"] is False
    assert re.fullmatch(r"<__media_[A-Za-z0-9]{32}__>", props["media_marker"])
    with srv.settings(ui_settings={"theme": "dark"}):  # --ui-config
        assert srv.get("/props")[1]["ui_settings"] == {"theme": "dark"}
    assert srv.get("/props")[1]["media_marker"] == props["media_marker"]  # one per server
    assert props["chat_template"] == srv.state.chat.source
    assert props["chat_template_caps"] == srv.state.chat.llama_caps()
    assert props["chat_template_caps"]["supports_string_content"] is True
    assert (props["endpoint_slots"], props["endpoint_props"], props["endpoint_metrics"]) == (True, False, False)


def test_post_props(srv):
    status, doc = srv.post("/props", {"n_predict": 5})
    assert status == 501 and doc["error"]["type"] == "not_supported_error" and "--props" in doc["error"]["message"]
    with srv.settings(props_writable=True):
        assert srv.post("/props", {"n_predict": 5}) == (200, {"success": True})
        assert srv.post("/props", [1])[0] == 400


# --- /slots ---------------------------------------------------------------------------------------

def test_slots(srv, monkeypatch):
    status, slots = srv.get("/slots")
    assert status == 200 and [s["id"] for s in slots] == [0, 1]
    assert all(s["n_ctx"] == SLOT_CTX and s["is_processing"] is False for s in slots)
    assert srv.get("/slots?fail_on_no_slot=1")[0] == 200
    monkeypatch.setattr(srv.api, "_idle", lambda slot: False)  # every slot taken
    assert srv.get("/slots?fail_on_no_slot=1") == (503, {"error": {"code": 503, "message": "no slot available",
                                                                   "type": "unavailable_error"}})
    assert srv.get("/slots")[0] == 200
    monkeypatch.undo()
    with srv.settings(slots_enabled=False):
        assert srv.get("/slots") == (501, {"error": {
            "code": 501, "message": "This server does not support slots endpoint. Start it with `--slots`",
            "type": "not_supported_error"}})


def test_slot_save_erase_restore(srv, tmp_path):
    body = {"prompt": PROMPT, "id_slot": 0, "cache_prompt": True, **GREEDY}
    status, first = srv.post("/completion", body)
    assert status == 200
    assert srv.post("/slots/0?action=save", {"filename": "s0.bin"})[0] == 501  # no --slot-save-path
    with srv.settings(slot_save_path=str(tmp_path)):
        n_cached = srv.get("/slots")[1][0]["n_past"]
        assert n_cached == first["tokens_evaluated"] + first["tokens_predicted"] - 1
        status, saved = srv.post("/slots/0?action=save", {"filename": "s0.bin"})
        assert status == 200, saved
        assert (saved["id_slot"], saved["filename"], saved["n_saved"]) == (0, "s0.bin", n_cached)
        assert saved["n_written"] == os.path.getsize(tmp_path / "s0.bin") and saved["timings"]["save_ms"] >= 0
        assert srv.post("/slots/0?action=erase", {}) == (200, {"id_slot": 0, "n_erased": n_cached})
        assert srv.get("/slots")[1][0]["n_past"] == 0
        n_decode = srv.state.metrics.snapshot()["n_decode_total"]
        status, restored = srv.post("/slots/0?action=restore", {"filename": "s0.bin"})
        assert status == 200, restored
        assert (restored["id_slot"], restored["n_restored"], restored["n_read"]) == (0, n_cached, saved["n_written"])
        assert srv.get("/slots")[1][0]["n_past"] == n_cached
        # the file's KV rows went in as they were: nothing was computed
        assert srv.state.metrics.snapshot()["n_decode_total"] == n_decode
        # the next request with that prefix reuses the restored cache
        status, again = srv.post("/completion", body)
        assert again["content"] == first["content"]
        assert again["timings"]["prompt_n"] == 1 and again["timings"]["cache_n"] == first["tokens_evaluated"] - 1
        for bad in ("../s0.bin", "a/b", "a\\b", ".hidden", "..", "", " s0.bin", "s0..bin", "c:x", "a\nb", 7):
            assert srv.post("/slots/0?action=restore", {"filename": bad}) == (400, {"error": {
                "code": 400, "message": "Invalid filename", "type": "invalid_request_error"}}), bad
        assert srv.post("/slots/0?action=restore", {"filename": "missing.bin"})[0] == 400
        (tmp_path / "junk.bin").write_bytes(b"not a slot")
        assert srv.post("/slots/0?action=restore", {"filename": "junk.bin"})[0] == 400
        assert srv.post("/slots/9?action=erase", {})[1]["error"]["message"] == "Invalid slot ID"
        assert srv.post("/slots/x?action=erase", {})[1]["error"]["message"] == "Invalid slot ID"
        assert srv.post("/slots/0?action=drop", {})[1]["error"]["message"] == "Invalid action"
    assert sorted(os.listdir(tmp_path)) == ["junk.bin", "s0.bin"]


def _saved_slot(srv, tmp_path, slot: int = 0) -> tuple[dict, dict]:
    """A greedy completion in `slot`, then its save to s.bin: (the completion, the save's answer)."""
    status, first = srv.post("/completion", {"prompt": PROMPT, "id_slot": slot, "cache_prompt": True, **GREEDY})
    assert status == 200, first
    status, saved = srv.post(f"/slots/{slot}?action=save", {"filename": "s.bin"})
    assert status == 200, saved
    return first, saved


def _reuses(srv, slot: int, first: dict) -> None:
    """The next request with the first one's prompt, in `slot`, computes only its last token."""
    status, again = srv.post("/completion", {"prompt": PROMPT, "id_slot": slot, "cache_prompt": True, **GREEDY})
    assert status == 200 and again["content"] == first["content"]
    assert again["timings"]["prompt_n"] == 1 and again["timings"]["cache_n"] == first["tokens_evaluated"] - 1


def test_slot_restore_other_slot_and_token_files(srv, tmp_path):
    with srv.settings(slot_save_path=str(tmp_path)):
        first, saved = _saved_slot(srv, tmp_path)
        n_decode = srv.state.metrics.snapshot()["n_decode_total"]
        status, restored = srv.post("/slots/1?action=restore", {"filename": "s.bin"})
        assert status == 200 and restored["n_restored"] == saved["n_saved"]
        assert srv.state.metrics.snapshot()["n_decode_total"] == n_decode
        _reuses(srv, 1, first)
        # a file of the first format holds tokens only: their KV is computed on restore
        ctx = srv.state.groups[0].ctx
        tokens = slot_file.read((tmp_path / "s.bin").read_bytes(), srv.state.tokenizer.n_vocab, ctx.kv_layout(),
                                "s.bin").tokens
        head = json.dumps({"n_vocab": srv.state.tokenizer.n_vocab, "model": "m", "n_tokens": len(tokens)})
        (tmp_path / "v1.bin").write_bytes(slot_file.MAGIC_V1 + head.encode() + b"\n"
                                          + np.asarray(tokens, dtype="<i4").tobytes())
        assert srv.post("/slots/1?action=erase", {})[0] == 200
        n_decode = srv.state.metrics.snapshot()["n_decode_total"]
        status, restored = srv.post("/slots/1?action=restore", {"filename": "v1.bin"})
        assert status == 200 and restored["n_restored"] == len(tokens) == saved["n_saved"]
        assert srv.state.metrics.snapshot()["n_decode_total"] > n_decode
        assert srv.get("/slots")[1][1]["n_past"] == len(tokens)
        _reuses(srv, 1, first)


def test_slot_restore_without_room_computes(srv, tmp_path, monkeypatch):
    """Rows for which the group cannot free the cells are computed into the slot instead."""
    with srv.settings(slot_save_path=str(tmp_path)):
        first, saved = _saved_slot(srv, tmp_path)
        assert srv.post("/slots/0?action=erase", {})[0] == 200
        group = srv.state.groups[0]
        kv = group.ctx.kv
        assert group.write_slot(group.slots[0], [1] * (kv.n_blocks * kv.block_size + 1), []) is False
        # what the last step reserved is not held between steps
        group.core.scheduler._reserved = kv.n_blocks
        n_decode = srv.state.metrics.snapshot()["n_decode_total"]
        assert srv.post("/slots/0?action=restore", {"filename": "s.bin"})[0] == 200
        assert srv.state.metrics.snapshot()["n_decode_total"] == n_decode
        assert srv.post("/slots/0?action=erase", {})[0] == 200
        monkeypatch.setattr(group, "write_slot", lambda *a: False)
        n_decode = srv.state.metrics.snapshot()["n_decode_total"]
        status, restored = srv.post("/slots/0?action=restore", {"filename": "s.bin"})
        assert status == 200 and restored["n_restored"] == saved["n_saved"]
        assert srv.state.metrics.snapshot()["n_decode_total"] > n_decode
        monkeypatch.undo()
        _reuses(srv, 0, first)


def test_slot_restore_refuses_other_layouts(srv, tmp_path):
    """A file whose rows would not fit this cache is refused whole: the slot keeps what it held."""
    with srv.settings(slot_save_path=str(tmp_path)):
        first, saved = _saved_slot(srv, tmp_path)
        data = (tmp_path / "s.bin").read_bytes()
        at = len(slot_file.MAGIC)
        end = data.index(b"\n", at)
        header = json.loads(data[at:end])

        def variant(name: str, **change) -> str:
            changed = data[:at] + json.dumps({**header, **change}).encode() + data[end:-4]
            (tmp_path / name).write_bytes(changed + zlib.crc32(changed).to_bytes(4, "little"))
            return name
        other_type = [["q8_0", 34, v, vb] for _, _, v, vb in header["kv"]]
        cases = {
            variant("type.bin", kv=other_type): "holds the KV cache of another model or cache type",
            variant("layers.bin", kv=header["kv"][:-1]): "holds the KV cache of another model or cache type",
            variant("vocab.bin", n_vocab=header["n_vocab"] + 1): "was saved with a model of",
            variant("count.bin", n_tokens=header["n_tokens"] - 1): "is not a slot file of this server",
        }
        (tmp_path / "short.bin").write_bytes(data[:-1])
        cases["short.bin"] = "is not a slot file of this server"
        n_past = srv.get("/slots")[1][0]["n_past"]
        for name, message in cases.items():
            status, doc = srv.post("/slots/0?action=restore", {"filename": name})
            assert status == 400 and message in doc["error"]["message"], (name, doc)
            assert srv.get("/slots")[1][0]["n_past"] == n_past, name
        _reuses(srv, 0, first)


def test_slot_saves_to_one_file_concurrently(srv, tmp_path):
    """Saves of two slots to one file at once each succeed and leave one slot's whole file, never a
    mix, nor a temporary file behind."""
    with srv.settings(slot_save_path=str(tmp_path)):
        _saved_slot(srv, tmp_path, 0)
        status, doc = srv.post("/completion", {"prompt": "Another prompt, of other words", "id_slot": 1,
                                               "cache_prompt": True, **GREEDY})
        assert status == 200, doc
        expect = set()
        for slot in (0, 1):
            assert srv.post(f"/slots/{slot}?action=save", {"filename": f"ref{slot}.bin"})[0] == 200
            expect.add((tmp_path / f"ref{slot}.bin").read_bytes())
        assert len(expect) == 2
        failed, mixed = [], 0
        for _ in range(20):
            def save(slot: int) -> None:
                status, doc = srv.post(f"/slots/{slot}?action=save", {"filename": "x.bin"})
                if status != 200:
                    failed.append(doc)
            threads = [threading.Thread(target=save, args=(slot,)) for slot in (0, 1, 0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            mixed += (tmp_path / "x.bin").read_bytes() not in expect
        assert failed == [] and mixed == 0
    assert sorted(os.listdir(tmp_path)) == ["ref0.bin", "ref1.bin", "s.bin", "x.bin"]


def test_slot_restore_refuses_damaged_files(srv, tmp_path):
    """A file whose bytes changed after the save fails its checksum: a 400, the slot untouched."""
    with srv.settings(slot_save_path=str(tmp_path)):
        first, saved = _saved_slot(srv, tmp_path)
        data = (tmp_path / "s.bin").read_bytes()
        n_tokens = saved["n_saved"]
        start = data.index(b"\n", len(slot_file.MAGIC)) + 1
        at_row = start + 4 * n_tokens + 5  # a byte of the first layer's K rows
        at_token = start + 1  # the second byte of the first token id, still inside the vocabulary
        for name, at in (("row.bin", at_row), ("token.bin", at_token), ("end.bin", len(data) - 1)):
            (tmp_path / name).write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:])
        n_past = srv.get("/slots")[1][0]["n_past"]
        for name in ("row.bin", "token.bin", "end.bin"):
            status, doc = srv.post("/slots/0?action=restore", {"filename": name})
            assert status == 400 and "checksum" in doc["error"]["message"], (name, doc)
            assert srv.get("/slots")[1][0]["n_past"] == n_past, name
        # a file of the second format (no checksum) is still restored, rows and all
        (tmp_path / "v2.bin").write_bytes(slot_file.MAGIC_V2 + data[len(slot_file.MAGIC):-4])
        assert srv.post("/slots/0?action=erase", {})[0] == 200
        n_decode = srv.state.metrics.snapshot()["n_decode_total"]
        status, restored = srv.post("/slots/0?action=restore", {"filename": "v2.bin"})
        assert status == 200 and restored["n_restored"] == n_tokens, restored
        assert srv.state.metrics.snapshot()["n_decode_total"] == n_decode
        _reuses(srv, 0, first)


def test_valid_slot_filename():
    assert valid_slot_filename("slot-1.bin") and valid_slot_filename("日本.bin")
    assert not valid_slot_filename("x" * 256) and not valid_slot_filename("a\x00b") and not valid_slot_filename("x.")


# --- /v1/models, /tokenize ----------------------------------------------------------------------

def test_models(srv, tiny_model):
    name = os.path.basename(tiny_model)
    status, doc = srv.get("/v1/models")
    assert status == 200 and doc["object"] == "list"
    (m,) = doc["data"]
    assert (m["id"], m["object"], m["aliases"], m["tags"]) == (name, "model", [name], [])
    assert m["meta"]["n_vocab"] == 512 and m["meta"]["n_ctx_train"] == srv.state.engine.model.hparams.n_ctx_train
    assert m["meta"]["n_ctx"] == srv.state.n_ctx_slot and m["meta"]["ftype"] == "all F32"
    (o,) = doc["models"]
    assert (o["name"], o["model"], o["details"]["format"]) == (name, name, "gguf")
    with srv.settings(aliases=[name, "short"]):
        assert srv.get("/models")[1]["data"][0]["aliases"] == [name, "short"]


def test_tokenize_parse_special_and_pieces(srv):
    assert srv.post("/tokenize", {"content": "<s>a"})[1]["tokens"] == [256, 97]
    assert srv.post("/tokenize", {"content": "<s>a", "parse_special": False})[1]["tokens"] == [60, 115, 62, 97]
    assert srv.post("/tokenize", {"content": "a", "add_special": True})[1]["tokens"] == [256, 97]
    _, doc = srv.post("/tokenize", {"content": "a你", "with_pieces": True})
    assert doc["tokens"] == [{"id": 97, "piece": "a"}, {"id": 228, "piece": [0xE4]}, {"id": 189, "piece": [0xBD]},
                             {"id": 160, "piece": [0xA0]}]
    assert srv.post("/tokenize", {"content": "a", "parse_special": 1})[0] == 400


# --- errors ---------------------------------------------------------------------------------------

def test_prompt_over_the_context(srv):
    status, doc = srv.post("/completion", {"prompt": [97] * 300, "n_predict": 1})
    assert status == 400
    err = doc["error"]
    assert (err["code"], err["type"], err["n_prompt_tokens"], err["n_ctx"]) == (400, "exceed_context_size_error",
                                                                                  300, SLOT_CTX)


# --- /completion fields -------------------------------------------------------------------------

def test_array_of_prompts_and_n_cmpl(srv):
    one = [srv.post("/completion", {"prompt": p, **GREEDY})[1] for p in ("Once upon", "A B C")]
    status, both = srv.post("/completion", {"prompt": ["Once upon", "A B C"], **GREEDY})
    assert status == 200 and isinstance(both, list)
    assert [r["index"] for r in both] == [0, 1] and [r["content"] for r in both] == [r["content"] for r in one]
    assert srv.post("/completion", {"prompt": [[97, 98]], **GREEDY})[1]["index"] == 0  # one prompt: one object
    status, two = srv.post("/completion", {"prompt": "Once upon", "n_cmpl": 2, **GREEDY})
    assert [r["index"] for r in two] == [0, 1] and two[0]["content"] == two[1]["content"] == one[0]["content"]


def test_return_tokens_and_response_fields(srv):
    _, plain = srv.post("/completion", {"prompt": PROMPT, **GREEDY})
    assert plain["tokens"] == []
    _, with_tokens = srv.post("/completion", {"prompt": PROMPT, "return_tokens": True, **GREEDY})
    assert len(with_tokens["tokens"]) == 6
    assert srv.state.tokenizer.decode(with_tokens["tokens"]) == with_tokens["content"]
    _, few = srv.post("/completion", {"prompt": PROMPT, "response_fields": ["content", "generation_settings/n_predict",
                                                                           "nothing/here"], **GREEDY})
    assert few == {"content": plain["content"], "generation_settings/n_predict": 6}
    assert nested_fields(["a/b/c", "a/x"], {"a": {"b": {"c": 1}}}) == {"a/b/c": 1}


def test_timings_per_token_and_progress(srv):
    events = srv.stream("/completion", {"prompt": PROMPT, "timings_per_token": True, "return_progress": True,
                                        "cache_prompt": False, **GREEDY})
    progress = [e for e in events if "prompt_progress" in e]
    tokens = [e for e in events if not e["stop"] and "prompt_progress" not in e]
    n_prompt = len(srv.post("/tokenize", {"content": PROMPT, "add_special": True})[1]["tokens"])
    assert progress and progress[-1]["prompt_progress"]["processed"] == n_prompt
    assert all(p["prompt_progress"]["total"] == n_prompt and p["prompt_progress"]["cache"] == 0 for p in progress)
    # as llama-server: a first event before any of the prompt is computed, and whole milliseconds
    assert progress[0]["prompt_progress"]["processed"] == 0 and progress[0]["prompt_progress"]["time_ms"] == 0
    assert len(progress) >= 2 and all(isinstance(p["prompt_progress"]["time_ms"], int) for p in progress)
    assert [e["timings"]["predicted_n"] for e in tokens[:-1]] == list(range(1, len(tokens)))
    assert all(e["timings"]["prompt_n"] == n_prompt for e in tokens[:-1])
    plain = srv.stream("/completion", {"prompt": PROMPT, **GREEDY})
    assert not any("timings" in e or "prompt_progress" in e for e in plain if not e["stop"])


def test_probabilities_pre_and_post_sampling(srv):
    body = {"prompt": PROMPT, "n_predict": 4, "ignore_eos": True, "n_probs": 5, "top_k": 3, "temperature": 1.0,
            "seed": 7, "return_tokens": True}
    _, pre = srv.post("/completion", body)
    _, post = srv.post("/completion", {**body, "post_sampling_probs": True})
    assert pre["tokens"] == post["tokens"]  # the same sampling, only reported differently
    for e, tok in zip(pre["completion_probabilities"], pre["tokens"]):
        assert e["id"] == tok and "prob" not in e and len(e["top_logprobs"]) == 5  # the whole vocabulary
        lps = [t["logprob"] for t in e["top_logprobs"]]
        assert lps == sorted(lps, reverse=True) and sum(math.exp(x) for x in lps) < 1.0
        assert e["logprob"] <= lps[0]
    for e, tok in zip(post["completion_probabilities"], post["tokens"]):
        assert e["id"] == tok and "logprob" not in e
        top = e["top_probs"]
        assert len(top) <= 3 and sum(t["prob"] for t in top) == pytest.approx(1.0, abs=1e-5)  # after top_k = 3
        assert e["prob"] == pytest.approx(next(t["prob"] for t in top if t["id"] == tok))
    # greedy: the token is the raw argmax, so it heads the pre-sampling list
    _, g = srv.post("/completion", {"prompt": PROMPT, "n_predict": 3, "temperature": 0, "n_probs": 2,
                                    "ignore_eos": True})
    for e in g["completion_probabilities"]:
        assert e["top_logprobs"][0]["id"] == e["id"] and e["top_logprobs"][0]["logprob"] == e["logprob"]
    # as llama-server, more candidates than the sampling kernel keeps (20): they come from the logits row
    _, many = srv.post("/completion", {**body, "n_probs": 50})
    assert many["tokens"] == pre["tokens"]
    for e, few in zip(many["completion_probabilities"], pre["completion_probabilities"]):
        assert len(e["top_logprobs"]) == 50 and e["top_logprobs"][:5] == few["top_logprobs"]
    status, doc = srv.post("/completion", {**body, "n_probs": 50, "post_sampling_probs": True})
    assert status == 400 and "'n_probs' must be between 0 and 20" in doc["error"]["message"]
    status, doc = srv.post("/completion", {**body, "n_probs": 5000})
    assert status == 400 and "'n_probs' must be between 0 and 1024" in doc["error"]["message"]
    status, doc = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                    "logprobs": True, "top_logprobs": 30})
    assert status == 200 and len(doc["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 30


def test_verbose(srv):
    with srv.settings(verbose=True):
        _, doc = srv.post("/completion", {"prompt": PROMPT, "response_fields": ["content"], **GREEDY})
        assert set(doc) == {"content", "__verbose"} and doc["__verbose"]["content"] == doc["content"]
        assert doc["__verbose"]["tokens_predicted"] == 6
        _, chat = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **GREEDY})
        assert chat["__verbose"]["content"] == chat["choices"][0]["message"]["content"]
    assert "__verbose" not in srv.post("/completion", {"prompt": PROMPT, **GREEDY})[1]


# --- /metrics, /infill, /embeddings -------------------------------------------------------------

def test_metrics_needs_the_flag(srv):
    assert srv.get("/metrics") == (501, {"error": {
        "code": 501, "message": "This server does not support metrics endpoint. Start it with `--metrics`",
        "type": "not_supported_error"}})
    with srv.settings(metrics_enabled=True):
        status, text = srv.get("/metrics")
        assert status == 200 and "llamacpp:prompt_tokens_total" in text


def test_infill_without_fim_tokens(srv):
    status, doc = srv.post("/infill", {"input_prefix": "def f(", "input_suffix": "):\n", **GREEDY})
    assert status == 400 and "fill-in-the-middle" in doc["error"]["message"]


def test_infill_prompt_layout():
    class Tok:
        fim_pre_id, fim_suf_id, fim_mid_id, fim_sep_id = 500, 501, 502, 503
        bos_id, add_bos = 1, True

        def encode(self, text, add_special=False, parse_special=False):
            assert not add_special and not parse_special
            return [ord(c) for c in text]
    got = infill_prompt(Tok(), {"input_prefix": "ab", "input_suffix": "c", "prompt": "d",
                                "input_extra": [{"filename": "f", "text": "x"}]})
    assert got == [1, 503, ord("f"), ord("\n"), ord("x"), 500, ord("a"), ord("b"), 501, ord("c"), 502, ord("d")]
    spm = infill_prompt(Tok(), {"input_prefix": "ab", "input_suffix": "c", "prompt": "d"}, spm=True)
    assert spm == [1, 501, ord("c"), 500, ord("a"), ord("b"), 502, ord("d")]  # --spm-infill: suffix first
    with pytest.raises(HTTPError):
        infill_prompt(Tok(), {"input_prefix": 3})


@pytest.mark.parametrize("field,value", [
    ("input_prefix", 3), ("input_prefix", None), ("input_suffix", [{"text": "x"}]), ("input_suffix", [1.5]),
    ("input_prefix", True), ("prompt", None), ("prompt", 7), ("prompt", [1, 2]), ("prompt", {"a": "b"})])
def test_infill_field_types(srv, field, value):
    """A field of the wrong type is a 400 naming it (before the model's FIM tokens are looked at)."""
    status, doc = srv.post("/infill", {"input_prefix": "def f(", "input_suffix": "):\n", **GREEDY, field: value})
    assert status == 400, doc
    assert f"'{field}'" in doc["error"]["message"]


def test_infill_prompt_token_arrays():
    """input_prefix and input_suffix take token ids and text mixed, as llama-server's tokenize_mixed."""
    class Tok:
        fim_pre_id, fim_suf_id, fim_mid_id = 500, 501, 502
        bos_id, add_bos, n_vocab = 1, False, 600

        def encode(self, text, add_special=False, parse_special=False):
            assert not add_special and not parse_special
            return [ord(c) for c in text]
    got = infill_prompt(Tok(), {"input_prefix": ["ab", 7], "input_suffix": [9, "c"], "prompt": "d"})
    assert got == [500, ord("a"), ord("b"), 7, 501, 9, ord("c"), 502, ord("d")]
    with pytest.raises(HTTPError, match="'input_suffix'"):
        infill_prompt(Tok(), {"input_prefix": "a", "input_suffix": [600]})  # outside the vocabulary


def test_lora_adapters_none_loaded(srv):
    status, doc = srv.get("/lora-adapters")
    assert status == 200 and doc == []
    status, doc = srv.post("/lora-adapters", [])
    assert status == 200 and doc == {"success": True}
    status, doc = srv.post("/lora-adapters", [{"id": 0, "scale": 0.5}])
    assert status == 400 and "invalid adapter id" in doc["error"]["message"]
    status, doc = srv.post("/lora-adapters", {"id": 0})
    assert status == 400


def test_embeddings_need_the_embedding_flag(srv):
    for path in ("/embedding", "/embeddings", "/v1/embeddings"):
        status, doc = srv.post(path, {"input": "x"})
        assert status == 501 and doc["error"]["type"] == "not_supported_error", path


def test_apply_template_and_prefill(srv):
    """/apply-template returns the prompt a chat body renders to; a final assistant message is
    continued (the prompt ends with its text, no end of turn), and asking for both a generation
    prompt and continuing the last message is refused, as llama-server does."""
    msgs = [{"role": "user", "content": "Say hi"}]
    status, doc = srv.post("/apply-template", {"messages": msgs})
    assert status == 200 and "Say hi" in doc["prompt"]
    status, pre = srv.post("/apply-template", {"messages": msgs + [{"role": "assistant", "content": "Hi th"}]})
    assert status == 200 and pre["prompt"].endswith("Hi th")
    assert pre["prompt"].startswith(doc["prompt"])  # the head is the conversation with its generation prompt
    status, err = srv.post("/apply-template", {"messages": msgs + [{"role": "assistant", "content": "x"}],
                                               "continue_final_message": True, "add_generation_prompt": True})
    assert status == 400 and "add_generation_prompt" in err["error"]["message"]
    status, err = srv.post("/apply-template", {"messages": "nope"})
    assert status == 400
    body = {"messages": msgs + [{"role": "assistant", "content": "Hi th"}], "max_tokens": 2, "temperature": 0}
    status, out = srv.post("/v1/chat/completions", body)
    assert status == 200 and out["usage"]["prompt_tokens"] > 0 and out["usage"]["completion_tokens"] == 2
    # as llama-server, the reply starts with the continued message's text, streamed or not
    content = out["choices"][0]["message"]["content"]
    assert content.startswith("Hi th") and len(content) > len("Hi th")
    events = [e for e in srv.stream("/v1/chat/completions", body) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"].get("content") for e in events]
    assert deltas[0] is None and "".join(d for d in deltas if d) == content
    assert deltas[1].startswith("Hi th")


def test_openai_usage_counts_cached_prompt_tokens(srv):
    """As llama-server's: usage.prompt_tokens_details.cached_tokens, the prompt tokens the prompt
    cache held, in whole replies, streams' finishing chunks and include_usage chunks."""
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    _, first = srv.post("/v1/chat/completions", chat)
    _, again = srv.post("/v1/chat/completions", chat)
    n_prompt = again["usage"]["prompt_tokens"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < n_prompt and again["timings"]["cache_n"] == cached
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] <= cached
    events = srv.stream("/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    usages = [e["usage"] for e in events if e.get("usage")]
    assert len(usages) == 2 and all(u["prompt_tokens_details"]["cached_tokens"] == cached for u in usages)
    _, text = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 2})
    _, text = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 2})
    details = text["usage"]["prompt_tokens_details"]
    assert 0 < details["cached_tokens"] < text["usage"]["prompt_tokens"]
