"""bench/bench_users.py against a fake llama-server of our own (loopback, free port, no model)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "bench_users.py")

_spec = importlib.util.spec_from_file_location("bench_users", SCRIPT)
bench_users = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_users)


class FakeLlamaServer(ThreadingHTTPServer):
    """Speaks the part of llama-server's API the harness uses.

    mode: "ok"        n_predict token events, then the stop event
          "short"     one token fewer than asked, reported as such in tokens_predicted
          "error500"  every /completion answers 500 with a llama-server error document
          "nostop"    the stream ends after the tokens without a stop event
    metrics: False makes GET /metrics answer 501 like llama-server without --metrics.
    overcount: extra tokens added to the tokens_predicted counter per request.
    """

    daemon_threads = True

    def __init__(self, mode: str = "ok", metrics: bool = True, overcount: int = 0) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.mode = mode
        self.metrics_enabled = metrics
        self.overcount = overcount
        self.lock = threading.Lock()
        self.tokens_predicted_total = 0
        self.prompt_tokens_total = 0
        self.requests: list[dict] = []
        self.connections: set[tuple] = set()
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=10)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeLlamaServer

    def setup(self) -> None:
        super().setup()
        # small SSE writes must not wait for the client's delayed ACK (Nagle), as in a real server
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def _send_json(self, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, doc: dict) -> None:
        self._chunk(b"data: " + json.dumps(doc).encode() + b"\n\n")

    def do_GET(self) -> None:
        srv = self.server
        if self.path != "/metrics":
            self._send_json(404, {"error": {"code": 404, "message": "File Not Found",
                                            "type": "not_found_error"}})
            return
        if not srv.metrics_enabled:
            self._send_json(501, {"error": {"code": 501, "type": "not_supported_error",
                                            "message": "This server does not support metrics "
                                                       "endpoint. Start it with `--metrics`"}})
            return
        with srv.lock:
            text = (
                "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
                "# TYPE llamacpp:prompt_tokens_total counter\n"
                f"llamacpp:prompt_tokens_total {srv.prompt_tokens_total}\n"
                "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.\n"
                "# TYPE llamacpp:tokens_predicted_total counter\n"
                f"llamacpp:tokens_predicted_total {srv.tokens_predicted_total}\n"
                "llamacpp:requests_processing 0\n"
            )
        body = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        srv = self.server
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        req = json.loads(body)
        with srv.lock:
            srv.requests.append(req)
            srv.connections.add(self.client_address)
        if self.path != "/completion":
            self._send_json(404, {"error": {"code": 404, "message": "File Not Found",
                                            "type": "not_found_error"}})
            return
        if srv.mode == "error500":
            self._send_json(500, {"error": {"code": 500, "message": "fake failure",
                                            "type": "server_error"}})
            return
        prompt = req["prompt"]
        n = int(req["n_predict"]) - (1 if srv.mode == "short" else 0)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(n):
            tok = 1000 + i
            self._event({"index": 0, "content": f" t{i}", "tokens": [tok], "stop": False,
                         "id_slot": -1, "tokens_predicted": i + 1,
                         "tokens_evaluated": len(prompt)})
            time.sleep(0.0005)
        with srv.lock:  # counted before the stop event goes out
            srv.prompt_tokens_total += len(prompt)
            srv.tokens_predicted_total += n + srv.overcount
        if srv.mode != "nostop":
            self._event({"index": 0, "content": "", "tokens": [], "id_slot": 0, "stop": True,
                         "model": "fake", "tokens_predicted": n, "tokens_evaluated": len(prompt),
                         "stop_type": "limit", "stopping_word": "", "tokens_cached": n + len(prompt),
                         "timings": {"prompt_n": len(prompt), "predicted_n": n}})
        self._chunk(b"")  # the zero-length chunk ends the body


def test_run_bench_counts_and_matches_counters():
    with FakeLlamaServer() as srv:
        rep = bench_users.run_bench(srv.url, users=4, requests=3, npp=16, ntg=8, warmup=1,
                                    timeout=30, seed=7, vocab=(300, 1000))
    assert rep["requests"] == 12 and rep["requests_done"] == 12 and rep["requests_ok"] == 12
    assert rep["errors"] == 0 and rep["error_messages"] == []
    assert rep["short"] == 0
    assert rep["warmup_requests"] == 4 and rep["warmup_errors"] == 0
    assert rep["gen_tokens"] == 12 * 8 and rep["prompt_tokens"] == 12 * 16
    assert rep["gen_tok_s"] > 0 and rep["prompt_tok_s"] > 0 and rep["req_s"] > 0
    assert rep["wall_s"] > 0
    assert rep["tpot_ms"] is not None and rep["tpot_ms"] >= 0
    assert rep["ttft_ms_median"] is not None and rep["ttft_ms_p99"] is not None
    assert rep["ttft_ms_p99"] >= rep["ttft_ms_median"]
    assert rep["content_events"] == 12 * 8 and rep["stream_tokens"] == 12 * 8
    assert rep["stop_types"] == {"limit": 12}
    c = rep["counters"]
    assert c["available"] is True
    assert c["tokens_predicted_server"] == c["tokens_predicted_client"] == 96
    assert c["tokens_predicted_match"] is True
    assert c["prompt_tokens_server"] == c["prompt_tokens_sent"] == 12 * 16
    assert c["prompt_tokens_match"] is True
    assert rep["passed"] is True and rep["exit_status"] == 0 and rep["failures"] == []
    assert len(rep["per_request"]) == 12
    json.dumps(rep)  # the --json document is plain JSON

    # what went over the wire: 4 warm-up + 12 measured requests, exact prompts, one
    # keep-alive connection per user
    assert len(srv.requests) == 16
    for req in srv.requests:
        assert len(req["prompt"]) == 16
        assert all(isinstance(t, int) and 300 <= t < 1000 for t in req["prompt"])
        assert req["n_predict"] == 8 and req["ignore_eos"] is True and req["stream"] is True
        assert req["temperature"] == 0 and req["cache_prompt"] is False
    assert len({tuple(r["prompt"]) for r in srv.requests}) == 16
    assert len(srv.connections) == 4


def test_window_start_callback_runs_once_after_the_warm_up():
    seen = []
    with FakeLlamaServer() as srv:
        rep = bench_users.run_bench(srv.url, users=3, requests=2, npp=4, ntg=2, warmup=1, timeout=30,
                                    on_window_start=lambda: seen.append(len(srv.requests)))
    assert seen == [3]  # every user's warm-up request answered, no measured one sent yet
    assert rep["exit_status"] == 0 and len(srv.requests) == 9


def test_a_failing_window_start_callback_fails_the_run_but_not_the_users():
    def boom() -> None:
        raise OSError("no such process")

    with FakeLlamaServer() as srv:
        rep = bench_users.run_bench(srv.url, users=2, requests=1, npp=4, ntg=2, warmup=0, timeout=30,
                                    on_window_start=boom)
    assert rep["requests_done"] == 2 and rep["exit_status"] == 1
    assert any("on_window_start: OSError: no such process" in f for f in rep["failures"])


def test_prompts_are_seeded():
    a = bench_users.make_prompt(3, 1, "run", 2, 50, (300, 1000))
    assert a == bench_users.make_prompt(3, 1, "run", 2, 50, (300, 1000))
    assert a != bench_users.make_prompt(4, 1, "run", 2, 50, (300, 1000))
    assert a != bench_users.make_prompt(3, 2, "run", 2, 50, (300, 1000))
    assert len(a) == 50 and min(a) >= 300 and max(a) < 1000


def test_short_responses_fail_the_script(tmp_path):
    out = tmp_path / "rep.json"
    with FakeLlamaServer(mode="short") as srv:
        proc = subprocess.run(
            [sys.executable, SCRIPT, "--url", srv.url, "-u", "2", "-r", "2", "--npp", "8",
             "--ntg", "4", "--json", str(out), "--timeout", "30"],
            capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert rep["short"] == 4 and rep["errors"] == 0 and rep["requests_done"] == 4
    assert rep["gen_tokens"] == 4 * 3
    assert "tokens_predicted 3 != 4" in rep["short_messages"][0]
    assert rep["counters"]["tokens_predicted_match"] is True  # the server counted what it sent
    assert "short responses    4" in proc.stdout
    assert "FAIL" in proc.stdout


def test_script_passes_against_a_good_server(tmp_path):
    out = tmp_path / "rep.json"
    with FakeLlamaServer() as srv:
        proc = subprocess.run(
            [sys.executable, SCRIPT, "--url", srv.url, "-u", "2", "-r", "2", "--npp", "8",
             "--ntg", "4", "--warmup", "0", "--json", str(out)],
            capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert rep["requests_done"] == 4 and rep["warmup_requests"] == 0
    assert "PASS" in proc.stdout


def test_http_500_counts_errors():
    with FakeLlamaServer(mode="error500") as srv:
        rep = bench_users.run_bench(srv.url, users=2, requests=3, npp=4, ntg=4, warmup=1,
                                    timeout=30)
    assert rep["errors"] == 6 and rep["requests_done"] == 0 and rep["short"] == 0
    assert rep["warmup_errors"] == 2
    assert rep["error_messages"] and "HTTP 500: fake failure" in rep["error_messages"][0]
    assert rep["gen_tokens"] == 0 and rep["gen_tok_s"] == 0
    assert rep["ttft_ms_median"] is None and rep["tpot_ms"] is None
    assert rep["exit_status"] == 1 and not rep["passed"]


def test_stream_without_stop_is_an_error():
    with FakeLlamaServer(mode="nostop") as srv:
        rep = bench_users.run_bench(srv.url, users=1, requests=2, npp=4, ntg=3, warmup=0,
                                    timeout=30)
    assert rep["errors"] == 2 and rep["exit_status"] == 1
    assert "without a stop event" in rep["error_messages"][0]


def test_counter_mismatch_fails():
    with FakeLlamaServer(overcount=1) as srv:
        rep = bench_users.run_bench(srv.url, users=2, requests=2, npp=4, ntg=4, warmup=1,
                                    timeout=30)
    assert rep["errors"] == 0 and rep["short"] == 0
    c = rep["counters"]
    assert c["tokens_predicted_client"] == 16 and c["tokens_predicted_server"] == 20
    assert c["tokens_predicted_match"] is False
    assert rep["exit_status"] == 1


def test_metrics_unavailable_is_skipped():
    with FakeLlamaServer(metrics=False) as srv:
        rep = bench_users.run_bench(srv.url, users=2, requests=1, npp=4, ntg=2, warmup=1,
                                    timeout=30)
    c = rep["counters"]
    assert c["available"] is False and "501" in c["reason"]
    assert c["tokens_predicted_match"] is None
    assert rep["exit_status"] == 0
    assert "server counters    skipped" in bench_users.format_report(rep)


def test_unreachable_server_counts_errors():
    with FakeLlamaServer() as srv:
        url = srv.url  # the port is free again once the server is closed
    rep = bench_users.run_bench(url, users=2, requests=1, npp=4, ntg=2, warmup=0, timeout=5)
    assert rep["errors"] == 2 and rep["exit_status"] == 1
    assert rep["counters"]["available"] is False


def test_parse_prometheus():
    text = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1536
llamacpp:tokens_predicted_total 3.072e3
  llamacpp:kv_cache_usage_ratio   0.25  1712345678000

http_requests_total{method="post",code="200"} 1027 1395066363000
http_requests_total{method="post",code="400"}    3
msdos_file_access_time_seconds{path="C:\\\\DIR\\\\FILE.TXT",error="Cannot find file:\\n\\"FILE.TXT\\""} 1.458255915e9
weird{label="a } b"} 5
empty_labels{} 7
request_duration_seconds_bucket{le="0.5"} 129389
request_duration_seconds_bucket{le="+Inf"} 144320
something_infinite +Inf
something_negative -Inf
something_nan NaN
not a sample line
broken{le="1" 3
"""
    m = bench_users.parse_prometheus(text)
    assert m["llamacpp:prompt_tokens_total"] == 1536.0
    assert m["llamacpp:tokens_predicted_total"] == 3072.0
    assert m["llamacpp:kv_cache_usage_ratio"] == 0.25
    assert m['http_requests_total{method="post",code="200"}'] == 1027.0
    assert m['http_requests_total{method="post",code="400"}'] == 3.0
    assert "http_requests_total" not in m
    assert m['weird{label="a } b"}'] == 5.0
    assert any(k.startswith("msdos_file_access_time_seconds{") for k in m)
    assert m["empty_labels"] == 7.0 and m["empty_labels{}"] == 7.0
    assert m['request_duration_seconds_bucket{le="+Inf"}'] == 144320.0
    assert m["something_infinite"] == math.inf
    assert m["something_negative"] == -math.inf
    assert math.isnan(m["something_nan"])
    assert not any(k.startswith(("#", "not", "broken")) for k in m)
    # labelled samples of one name add up when the bare name is asked for
    assert bench_users.metric_value(m, "http_requests_total") == 1030.0
    assert bench_users.metric_value(m, "llamacpp:prompt_tokens_total") == 1536.0
    assert bench_users.metric_value(m, "absent") is None


@pytest.mark.parametrize("kw", [dict(users=0), dict(npp=0), dict(vocab=(5, 5))])
def test_bad_arguments(kw):
    args = dict(url="http://127.0.0.1:1", users=1, requests=1, npp=1, ntg=1)
    args.update(kw)
    with pytest.raises(ValueError):
        bench_users.run_bench(**args)
