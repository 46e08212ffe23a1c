"""Randomized HTTP fuzzer for `python -m pyllama.server`.

    python bench/fuzz_http.py [--minutes N | --seconds S] [--seed K] [--model PATH] [--out DIR]
                              [--no-attacks | --attacks-only] [--attack-scale X]

Starts the server on the tiny test model (made with pyllama.models.make when --model is not
given) with small timeouts and limits, then sends it mutated versions of valid requests: byte
flips, insertions, deletions, truncations, duplicated and extra headers, oversized fields,
tampered Content-Length, re-chunked bodies, random JSON and hostile field values, pipelined
batches and requests split into small packets. After every case the server must still answer
GET /health, and no response may carry a 5xx status; every so often a normal completion must
succeed. Failing inputs are saved under bench/out/fuzz_http/ (raw bytes plus a JSON note), and
the server's log is checked for tracebacks at the end. Then three pathological grammars (40
bytes each, whose first token mask would take llguidance minutes) are sent at once while another
client repeats a JSON-mode request: its latency against its unloaded latency, what the grammars
got and the memory of the server and its grammar-check processes are printed (`--seconds 0` runs
this case alone, `--no-grammar` skips it).

Then come the attacks on fairness, one after another against a server with an API key and the
default limits but --max-connections 20: one request of many prompts (beyond --max-prompts, and
at it), idle keep-alive connections at the connection limit (after an unauthorised request, and
after an authorised one), and keyless connections that each send a body of 16 MiB less one byte.
During each, another client runs completions on new connections; the report gives the server's
RSS growth at its peak and that client's latency against its unloaded latency (the target: within
2x). A request of that client that fails is a failure; the latency is reported, never judged.

Prints the number of cases, a histogram of the statuses received, the attacks' figures and the
failures; exits 1 if there were any.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(HERE, "out", "fuzz_http")

# Small limits make the limit paths cheap to reach; the timeouts bound how long a case that never
# completes its request can take.
SERVER_ARGS = ["--metrics", "-np", "2", "-c", "512", "-t", "1", "--header-timeout", "1", "--body-timeout", "1",
               "--timeout", "5", "--max-body", str(256 << 10), "--max-header-bytes", str(16 << 10),
               "--max-connections", "64", "--max-pipelined", "4"]

PROMPT = "The little cat sat on the"

SEEDS: list[tuple[str, str, Optional[dict]]] = [
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("GET", "/props", None),
    ("GET", "/slots", None),
    ("GET", "/metrics", None),
    ("HEAD", "/health", None),
    ("OPTIONS", "/completion", None),
    ("POST", "/completion", {"prompt": PROMPT, "n_predict": 3, "temperature": 0}),
    ("POST", "/completion", {"prompt": PROMPT, "n_predict": 3, "stream": True, "stop": ["x"], "n_probs": 2}),
    ("POST", "/completion", {"prompt": [1, 2, 3, 4], "n_predict": 2, "seed": 7, "top_k": 5}),
    ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                      "stream": True, "stream_options": {"include_usage": True}}),
    ("POST", "/v1/messages", {"max_tokens": 3, "system": "Be brief.", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "thinking": {"type": "enabled",
                                                                               "budget_tokens": 2}}),
    ("POST", "/v1/messages", {"max_tokens": 2, "stream": True, "stop_sequences": ["x"],
                              "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/responses", {"input": [{"role": "user", "content": "hi"},
                                         {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                         {"type": "function_call_output", "call_id": "c", "output": "1"}],
                               "max_output_tokens": 3, "instructions": "Be brief.",
                               "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": True,
                               "text": {"format": {"type": "json_object"}}}),
    ("POST", "/tokenize", {"content": PROMPT, "with_pieces": True}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
]

NASTY_VALUES: list = [
    None, True, False, 0, -1, -2, 1, 2**31, 2**31 - 1, 2**32, 2**63, 2**64, -2**63, 10**30, -10**30,
    10**400, -10**400, 1e18, 1e308, -1e308, 1.5, -0.0, 1e-320, "", "abc", "1", "-1", "NaN", "\u0000", "\ud7ff" * 3,
    "x" * 5000, [], [1], [[]], {}, {"a": 1}, [1] * 3000, ["x"] * 500, list(range(600)),
]
# numbers at the edges of int32, int64, float and beyond; numeric fields get them half the time
NASTY_NUMBERS: list = [10**400, -10**400, 10**30, -10**30, 2**64, 2**63, -2**63 - 1, 2**32, 2**31, -2**31 - 1,
                       1e308, -1e308, 1e18, -1, -2, 0, 0.5, -0.0, 1e-320]
NUMERIC_FIELDS = ["n_predict", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "n_probs", "n",
                  "repeat_last_n", "repeat_penalty", "presence_penalty", "frequency_penalty", "id_slot",
                  "logprobs", "top_logprobs", "max_output_tokens", "thinking_budget_tokens"]
RAW_NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1" * 5000, b"1" * 400,
               b"0x10", b"01", b"1.", b".5", b"-", b"1e", b"9" * 30]
FIELDS = ["prompt", "n_predict", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "n_probs",
          "n", "stop", "stream", "logit_bias", "repeat_last_n", "repeat_penalty", "presence_penalty",
          "frequency_penalty", "id_slot", "cache_prompt", "ignore_eos", "logprobs", "top_logprobs",
          "messages", "content", "tokens", "with_pieces", "add_special", "stream_options", "tools"]
HEADER_POOL = [
    b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked, chunked",
    b"Transfer-Encoding:  chunked", b"Content-Length: 0", b"Content-Length: -1", b"Content-Length: 1",
    b"Content-Length: 99999999999999999999999", b"Content-Length: 18446744073709551615",
    b"Content-Length: 1, 1", b"Content-Length: +5", b"Content-Length: 0x10", b"Expect: 100-continue",
    b"Expect: garbage", b"Connection: close", b"Connection: keep-alive", b"Connection: Upgrade",
    b"Upgrade: websocket", b"Upgrade: h2c", b"Host: ", b"Host: a\x00b", b"X-\xff\xfe: v", b"X: \xff\xfe",
    b" X-Leading-Space: v", b"X-Fold: a\r\n b", b"Content-Type: application/json; charset=latin-1",
    b"Access-Control-Request-Headers: " + b"a," * 2000,
]
METHODS = [b"GET", b"POST", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"PATCH", b"TRACE", b"CONNECT",
           b"PRI", b"get", b"G ET", b"GETT", b"X" * 200, b"", b"\x16\x03\x01"]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.2", b"HTTP/9.9", b"HTTP/1",
            b"HTTP/1.1 extra", b"http/1.1", b"", b"HTTP/11.1"]
PATHS = [b"/", b"*", b"/%", b"/%zz", b"/%ff", b"/%c3%a9", b"/\xc3\xa9", b"/\xff", b"/completion?%ff",
         b"/completion?" + b"a=1&" * 2000, b"http://evil/completion", b"//health", b"/health#frag",
         b"/health/../health", b"/" + b"a" * 20000, b"example.com:443", b"/health?x=%00"]


# ---------------------------------------------------------------------------------------------
# building requests

def render(method: bytes, path: bytes, headers: list[bytes], body: bytes, version: bytes = b"HTTP/1.1") -> bytes:
    return method + b" " + path + b" " + version + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


def seed_request(rng: random.Random) -> tuple[bytes, bytes, list[bytes], bytes]:
    method, path, obj = rng.choice(SEEDS)
    body = b"" if obj is None else json.dumps(obj).encode()
    headers = [b"Host: localhost"]
    if obj is not None:
        headers += [b"Content-Type: application/json", b"Content-Length: %d" % len(body)]
    return method.encode(), path.encode(), headers, body


def chunked(body: bytes, rng: random.Random) -> bytes:
    out = []
    i = 0
    while i < len(body):
        n = rng.choice([1, 2, 7, 64, 1000, len(body)])
        piece = body[i:i + n]
        ext = rng.choice([b"", b"", b";a=b", b";" + b"e" * 300])
        out.append(b"%x%b\r\n%b\r\n" % (len(piece), ext, piece))
        i += n
    out.append(rng.choice([b"0\r\n\r\n", b"0\r\n\r\n", b"0\r\nX-Trailer: 1\r\n\r\n", b"0\r\n", b"zz\r\n\r\n"]))
    return b"".join(out)


def random_json(rng: random.Random, depth: int = 0) -> object:
    r = rng.random()
    if depth > 6 or r < 0.4:
        return rng.choice(NASTY_VALUES)
    if r < 0.7:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(FIELDS): random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def json_body(obj: Optional[dict], rng: random.Random) -> bytes:
    """A hostile variant of a JSON body: nasty field values, raw number literals, deep nesting,
    invalid UTF-8, or random JSON."""
    base = dict(obj or {"prompt": PROMPT, "n_predict": 2})
    r = rng.random()
    if r < 0.35:  # one hostile value in an otherwise valid body reaches that field's checks
        if rng.random() < 0.5:
            base[rng.choice(NUMERIC_FIELDS)] = rng.choice(NASTY_NUMBERS)
        else:
            base[rng.choice(FIELDS)] = rng.choice(NASTY_VALUES)
        return json.dumps(base).encode()
    if r < 0.5:
        for _ in range(rng.randrange(1, 4)):
            base[rng.choice(FIELDS)] = random_json(rng, 3)
        return json.dumps(base).encode()
    if r < 0.65:
        name = rng.choice(FIELDS)
        return json.dumps(base)[:-1].encode() + b', "%s": %s}' % (name.encode(), rng.choice(RAW_NUMBERS))
    if r < 0.75:
        n = rng.choice([65, 200, 1000, 100000])
        return b'{"prompt": ' + b"[" * n + b"1" + b"]" * rng.choice([0, n]) + b"}"
    if r < 0.85:
        text = json.dumps(base).encode()
        i = rng.randrange(len(text))
        return text[:i] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x00"]) + text[i:]
    return json.dumps(random_json(rng)).encode()


# ---------------------------------------------------------------------------------------------
# mutations: each takes and returns raw request bytes

def m_flip(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 9)):
        if b:
            b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


def m_insert(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data) + 1)
    junk = rng.choice([b"\r\n", b"\n", b"\r", b" ", b":", b"\x00", b"\xff", os.urandom(rng.randrange(1, 16)),
                       b"\r\n\r\n", b"0\r\n\r\n", b"GET / HTTP/1.1\r\n"])
    return data[:i] + junk + data[i:]


def m_delete(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data) + 1)
    return data[:i] + data[i + rng.randrange(1, 32):]


def m_dup_header(data: bytes, rng: random.Random) -> bytes:
    head, sep, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    if len(lines) > 1:
        i = rng.randrange(1, len(lines))
        lines[i:i] = [lines[i]] * rng.choice([1, 2, 50])
    return b"\r\n".join(lines) + sep + body


def m_add_header(data: bytes, rng: random.Random) -> bytes:
    head, sep, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    lines.insert(rng.randrange(1, len(lines) + 1), rng.choice(HEADER_POOL))
    return b"\r\n".join(lines) + sep + body


def m_oversize(data: bytes, rng: random.Random) -> bytes:
    head, sep, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    n = rng.choice([8 << 10, 17 << 10, 70 << 10])
    kind = rng.randrange(4)
    if kind == 0:
        lines.insert(1, b"X-Big: " + b"a" * n)
    elif kind == 1:
        lines[1:1] = [b"X-H%d: %s" % (i, b"v" * 60) for i in range(n // 64)]
    elif kind == 2:
        parts = lines[0].split(b" ")
        if len(parts) == 3:
            lines[0] = b" ".join([parts[0], parts[1] + b"?q=" + b"x" * n, parts[2]])
    else:
        body = body + b" " * (300 << 10)  # past --max-body; Content-Length stays as it was
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + sep + body


def m_request_line(data: bytes, rng: random.Random) -> bytes:
    line, sep, rest = data.partition(b"\r\n")
    parts = line.split(b" ")
    if len(parts) != 3:
        return data
    which = rng.randrange(3)
    if which == 0:
        parts[0] = rng.choice(METHODS)
    elif which == 1:
        parts[1] = rng.choice(PATHS)
    else:
        parts[2] = rng.choice(VERSIONS)
    return b" ".join(parts) + sep + rest


MUTATIONS = [m_flip, m_insert, m_delete, m_dup_header, m_add_header, m_oversize, m_request_line]


@dataclass
class Case:
    kind: str
    segments: list[bytes]           # sent one after another, a small pause between them
    truncated: bool = False         # the request is incomplete on purpose: no answer is owed


def make_case(rng: random.Random) -> Case:
    method, path, headers, body = seed_request(rng)
    r = rng.random()
    kind = "plain"
    if r < 0.4 and body:
        kind = "json"
        body = json_body(json.loads(body), rng)
        headers = [h for h in headers if not h.startswith(b"Content-Length")] + [b"Content-Length: %d" % len(body)]
    elif r < 0.5 and body:
        kind = "chunked"
        headers = [h for h in headers if not h.startswith(b"Content-Length")] + [b"Transfer-Encoding: chunked"]
        body = chunked(body, rng)
    data = render(method, path, headers, body)
    if rng.random() < (0.25 if kind == "json" else 0.6):  # hostile JSON is worth more when it parses
        mut = rng.choice(MUTATIONS)
        kind += "+" + mut.__name__[2:]
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            data = mut(data, rng)
    truncated = False
    if rng.random() < 0.08:
        kind += "+truncated"
        data = data[:rng.randrange(1, max(2, len(data)))]
        truncated = True
    elif rng.random() < 0.12:
        kind += "+pipelined"
        extra = [render(*seed_request(rng)) for _ in range(rng.randrange(1, 4))]
        data = b"".join([data] + extra if rng.random() < 0.5 else extra + [data])
    segments = [data]
    if rng.random() < 0.15 and len(data) > 2:
        kind += "+split"
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randrange(1, 6))))
        segments = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
    return Case(kind, segments, truncated)


# ---------------------------------------------------------------------------------------------
# talking to the server

_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3})[^\r\n]*\r\n")


def parse_responses(data: bytes) -> tuple[list[int], bool]:
    """Statuses of the complete responses at the start of `data`, and whether bytes were left that
    do not form a complete response (a response cut short, or garbage)."""
    statuses = []
    i = 0
    while i < len(data):
        m = _STATUS.match(data, i)
        if m is None:
            return statuses, True
        end = data.find(b"\r\n\r\n", m.end() - 2)
        if end < 0:
            return statuses, True
        head = data[m.end():end].decode("latin-1").lower()
        headers = dict(h.split(":", 1) for h in head.split("\r\n") if ":" in h)
        status = int(m.group(1))
        i = end + 4
        if "content-length" in headers:
            n = int(headers["content-length"])
            if n and (i == len(data) or _STATUS.match(data, i)):
                n = 0  # the answer to a HEAD request: the length of a body that is not sent
            i += n
            if i > len(data):
                return statuses, True
        elif headers.get("transfer-encoding", "").strip() == "chunked":
            while True:
                eol = data.find(b"\r\n", i)
                if eol < 0:
                    return statuses, True
                size = int(data[i:eol].split(b";")[0], 16)
                i = eol + 2 + size + 2
                if i > len(data):
                    return statuses, True
                if size == 0:
                    break
        elif status not in (204, 304) and "connection" in headers and "close" in headers["connection"]:
            i = len(data)  # a body that ends with the connection
        statuses.append(status)
    return statuses, False


def exchange(port: int, segments: list[bytes], wait: float, idle: float = 0.05) -> tuple[bytes, bool]:
    """Sends the segments, then reads until the server closes, nothing arrives for `wait` seconds
    before the first byte, or for `idle` seconds after a complete response. Returns what was read
    and whether the server closed the connection."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b""
    closed = False
    try:
        for k, seg in enumerate(segments):
            try:
                s.sendall(seg)
            except OSError:  # the server closed early (an error answer, a limit): read what it said
                break
            if k + 1 < len(segments):
                time.sleep(0.002)
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            s.settimeout(left)
            try:
                d = s.recv(1 << 16)
            except (socket.timeout, TimeoutError):
                break
            except ConnectionResetError:
                closed = True
                break
            if not d:
                closed = True
                break
            buf += d
            statuses, partial = parse_responses(buf)
            if statuses and not partial:
                deadline = min(deadline, time.monotonic() + idle)
    finally:
        s.close()
    return buf, closed


def http_get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    data, _ = exchange(port, [b"GET %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n" % path.encode()],
                       wait=timeout)
    statuses, _ = parse_responses(data)
    return (statuses[0] if statuses else 0), data


def completion_ok(port: int) -> bool:
    body = json.dumps({"prompt": PROMPT, "n_predict": 4, "ignore_eos": True}).encode()
    headers = [b"Host: localhost", b"Connection: close", b"Content-Length: %d" % len(body)]
    req = render(b"POST", b"/completion", headers, body)
    data, _ = exchange(port, [req], wait=30)
    statuses, _ = parse_responses(data)
    return statuses == [200] and b'"tokens_predicted":4' in data


# ---------------------------------------------------------------------------------------------
# the run

@dataclass
class Report:
    cases: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    failures: list[dict] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, log_path: str, args: Optional[list[str]] = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(log_path, "a")
    proc = subprocess.Popen([sys.executable, "-m", "pyllama.server", "-m", model, "--port", str(port),
                             *(SERVER_ARGS if args is None else args)],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {open(log_path).read()[-2000:]}")
        try:
            if http_get(port, "/health", timeout=1)[0] == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError("server did not become ready")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def save_failure(out: str, index: int, case: Case, why: str, response: bytes, report: Report) -> None:
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"case-{index:06d}")
    with open(stem + ".bin", "wb") as f:
        f.write(b"".join(case.segments))
    note = {"case": index, "kind": case.kind, "why": why, "segments": [len(s) for s in case.segments],
            "input_head": b"".join(case.segments)[:2000].decode("latin-1"),
            "response_head": response[:2000].decode("latin-1")}
    with open(stem + ".json", "w") as f:
        json.dump(note, f, indent=1)
    report.failures.append({**note, "file": stem + ".bin"})


def run_case(port: int, case: Case) -> tuple[list[int], Optional[str], bytes]:
    """(statuses, why it failed or None, raw response)."""
    data, _ = exchange(port, case.segments, wait=0.3 if case.truncated else 3.0)
    statuses, partial = parse_responses(data)
    if partial and not (data.startswith(b"HTTP/1.1 ") and b"text/event-stream" in data[:400]):
        return statuses, "unparseable or truncated response", data
    bad = [s for s in statuses if s >= 500]
    if bad:
        return statuses, f"server error status {bad[0]}", data
    return statuses, None, data


def fuzz(port: int, seconds: float, seed: int, out: str, proc: Optional[subprocess.Popen] = None,
         max_failures: int = 20) -> Report:
    rng = random.Random(seed)
    report = Report()
    end = time.monotonic() + seconds
    while time.monotonic() < end and len(report.failures) < max_failures:
        case = make_case(rng)
        index = report.cases
        report.cases += 1
        statuses, why, data = run_case(port, case)
        for s in statuses:
            report.statuses[s] += 1
        if not statuses:
            report.statuses["none"] += 1
        if why is None:
            if proc is not None and proc.poll() is not None:
                why = f"server exited with status {proc.returncode}"
            elif http_get(port, "/health")[0] != 200:
                why = "GET /health did not answer 200 after the case"
            elif index % 25 == 0 and not completion_ok(port):
                why = "a normal completion failed after the case"
        if why is not None:
            save_failure(out, index, case, why, data, report)
            if proc is not None and proc.poll() is not None:
                break
    return report


# ---------------------------------------------------------------------------------------------
# pathological grammars: short, valid, and each first token mask would take llguidance seconds to
# minutes (a forced string of millions of bytes)

def pathological_grammar(n: int) -> str:
    return f'root ::= a{{{n}}}\na ::= b{{{n}}}\nb ::= "x"'


def post_json(port: int, path: str, body: dict, timeout: float = 120.0) -> tuple[int, bytes, float]:
    """(status, raw response, seconds) of one POST on its own connection."""
    data = json.dumps(body).encode()
    headers = [b"Host: localhost", b"Connection: close", b"Content-Length: %d" % len(data)]
    t0 = time.perf_counter()
    raw, _ = exchange(port, [render(b"POST", path.encode(), headers, data)], wait=timeout)
    statuses, _ = parse_responses(raw)
    return (statuses[0] if statuses else 0), raw, time.perf_counter() - t0


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB, from /proc (0, 0 where unreadable)."""
    try:
        fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
        return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])
    except (OSError, KeyError, ValueError):
        return 0, 0


def tree_rss_kib(pid: int) -> int:
    """VmRSS of a process and its descendants (the server and its grammar-check processes), KiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss_kib(p)[0]
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                todo.extend(int(c) for c in open(f"/proc/{p}/task/{tid}/children").read().split())
        except (OSError, ValueError):
            pass
    return total


def checks_running(pid: int) -> int:
    """The server's grammar-check threads (first masks being computed, given-up ones included)."""
    n = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                n += open(f"/proc/{pid}/task/{tid}/comm").read().strip() == "grammar-check"
            except OSError:
                pass
    except OSError:
        pass
    return n


def grammar_case(port: int, proc: subprocess.Popen, n_bad: int = 3, size: int = 3000, watch_s: float = 180) -> dict:
    """n_bad distinct pathological grammars sent at once, while another client repeats a JSON-mode
    request: its latency during them against its unloaded latency (target: within 2x), what the
    grammar requests got, the server's memory, and whether it still serves afterwards."""
    innocent = {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"},
                "max_tokens": 8, "seed": 1}

    def innocent_s() -> float:
        status, raw, took = post_json(port, "/v1/chat/completions", innocent)
        if status != 200:
            raise RuntimeError(f"the JSON-mode request failed during the grammar case: {raw[:300]!r}")
        return took

    innocent_s()  # (compiles JSON mode once)
    unloaded = sorted(innocent_s() for _ in range(5))[2]
    rss0 = tree_rss_kib(proc.pid)
    results: list[tuple[int, bytes, float]] = []
    threads = [threading.Thread(target=lambda k=k: results.append(post_json(
        port, "/completion", {"prompt": PROMPT, "n_predict": 4, "grammar": pathological_grammar(size + k)})))
        for k in range(n_bad)]
    for t in threads:
        t.start()
    loaded = []
    peak = rss0
    while any(t.is_alive() for t in threads) or len(loaded) < 5:
        loaded.append(innocent_s())
        peak = max(peak, tree_rss_kib(proc.pid))
    for t in threads:
        t.join()
    # the given-up computations still run to their end: the other client's latency meanwhile
    settle = []
    t_end = time.monotonic() + watch_s
    while (checks_running(proc.pid) or len(settle) < 5) and time.monotonic() < t_end:
        settle.append(innocent_s())
        peak = max(peak, tree_rss_kib(proc.pid))
        time.sleep(0.05)
    still = checks_running(proc.pid)
    statuses = collections.Counter(status for status, _, _ in results)
    messages = sorted({json.loads(raw.split(b"\r\n\r\n", 1)[1] or b"{}").get("error", {}).get("message", "")
                       for _, raw, _ in results if b"\r\n\r\n" in raw})
    return {"unloaded_s": unloaded, "during_median_s": sorted(loaded)[len(loaded) // 2], "during_max_s": max(loaded),
            "after_median_s": sorted(settle)[len(settle) // 2], "after_n": len(settle), "checks_left": still,
            "bad_statuses": dict(statuses), "rss_end_mib": tree_rss_kib(proc.pid) / 1024,
            "bad_max_s": max(took for _, _, took in results), "messages": messages,
            "rss_mib": rss0 / 1024, "rss_peak_mib": peak / 1024, "serves_after": completion_ok(port)}


def print_grammar_case(r: dict) -> None:
    ratio = r["during_median_s"] / r["unloaded_s"]
    print(f"pathological grammars: statuses {r['bad_statuses']} within {r['bad_max_s']:.2f} s: {r['messages']}")
    print(f"  another client's JSON-mode request: unloaded {r['unloaded_s'] * 1e3:.0f} ms, during "
          f"{r['during_median_s'] * 1e3:.0f} ms median ({ratio:.2f}x; target 2x), {r['during_max_s'] * 1e3:.0f} ms max, "
          f"while the given-up checks run on {r['after_median_s'] * 1e3:.0f} ms median ({r['after_n']} requests; "
          f"{r['checks_left']} checks left at the end)")
    print(f"  server RSS (with its check processes) {r['rss_mib']:.0f} MiB before, {r['rss_peak_mib']:.0f} MiB at most, "
          f"{r['rss_end_mib']:.0f} MiB after; serves afterwards: {r['serves_after']}")


def log_problems(log_path: str) -> list[str]:
    text = open(log_path, errors="replace").read()
    return [m.group(0) for m in re.finditer(r"(Traceback|Fatal error|RecursionError)[^\n]*", text)]


def ensure_model(out: str) -> str:
    path = os.path.join(out, "tiny.gguf")
    if not os.path.exists(path):
        os.makedirs(out, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pyllama.models.make", "--preset", "tiny", "--out", path],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return path


# ---------------------------------------------------------------------------------------------
# attacks on fairness: what one client can do to another's latency and to the server's memory

ATTACK_KEY = "fuzz-attack-key"
ATTACK_ARGS = ["-np", "2", "-c", "512", "-t", "1", "--api-key", ATTACK_KEY, "--max-connections", "20"]
AUTH = b"Authorization: Bearer " + ATTACK_KEY.encode()


@dataclass
class AttackResult:
    name: str
    rss_growth: int = 0                 # bytes, peak during the attack over the RSS before it
    base_s: float = 0.0                 # the other client's median latency, unloaded
    during_s: list[float] = field(default_factory=list)  # its latencies during the attack (answered ones)
    failed: list[str] = field(default_factory=list)      # its requests that did not answer 200
    note: str = ""                      # what the attack itself got back

    @property
    def ratio(self) -> float:
        return statistics.median(self.during_s) / self.base_s if self.during_s and self.base_s else float("nan")

    @property
    def worst_ratio(self) -> float:
        return max(self.during_s) / self.base_s if self.during_s and self.base_s else float("nan")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def post_raw(port: int, path: bytes, body: bytes, headers: tuple[bytes, ...] = (AUTH,),
             wait: float = 120.0) -> tuple[int, bytes]:
    req = render(b"POST", path, [b"Host: localhost", b"Connection: close", b"Content-Length: %d" % len(body),
                                 *headers], body)
    data, _ = exchange(port, [req], wait=wait)
    statuses, _ = parse_responses(data)
    return (statuses[0] if statuses else 0), data


def other_client(port: int) -> tuple[float, Optional[str]]:
    """One completion of another client on a new connection: (seconds, why it failed or None)."""
    body = json.dumps({"prompt": PROMPT, "n_predict": 4, "ignore_eos": True}).encode()
    t0 = time.monotonic()
    status, data = post_raw(port, b"/completion", body, wait=60)
    dt = time.monotonic() - t0
    return dt, None if status == 200 and b'"tokens_predicted":4' in data else f"status {status}: {data[:120]!r}"


def a_fanout_refused(port: int, scale: float) -> str:
    n = max(1000, int(100000 * scale))
    status, _ = post_raw(port, b"/completion", json.dumps({"prompt": ["a"] * n, "n_predict": 1}).encode())
    return f"{n} prompts -> {status}"


def a_fanout_at_limit(port: int, scale: float) -> str:
    n = max(16, int(2048 * scale))  # the default --max-prompts
    status, _ = post_raw(port, b"/completion", json.dumps({"prompt": ["a"] * n, "n_predict": 1}).encode())
    return f"{n} prompts -> {status}"


def hold_idle(port: int, n: int, request: bytes, hold_s: float) -> str:
    socks, answers = [], collections.Counter()
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(request)
            try:
                statuses, _ = parse_responses(s.recv(65536))
                answers[statuses[0] if statuses else "none"] += 1
            except OSError:
                answers["reset"] += 1
            socks.append(s)
        time.sleep(hold_s)
    finally:
        for s in socks:
            s.close()
    return f"{n} idle connections after " + ", ".join(f"{k}: {v}" for k, v in sorted(answers.items(), key=str))


def a_idle_unauthorised(port: int, scale: float) -> str:
    return hold_idle(port, 20, b"GET /slots HTTP/1.1\r\nHost: localhost\r\n\r\n", max(1.0, 4 * scale))


def a_idle_authorised(port: int, scale: float) -> str:
    return hold_idle(port, 20, b"GET /slots HTTP/1.1\r\nHost: localhost\r\n" + AUTH + b"\r\n\r\n",
                     max(1.0, 4 * scale))


def a_preauth_body(port: int, scale: float) -> str:
    """Keyless connections that each send a 16 MiB body less one byte, so that it never completes."""
    n, size = max(4, int(40 * scale)), 16 << 20
    answers: collections.Counter = collections.Counter()
    lock = threading.Lock()
    chunk = b"x" * (1 << 20)

    def one() -> None:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            s.sendall(b"POST /completion HTTP/1.1\r\nHost: localhost\r\nExpect: 100-continue\r\n"
                      b"Content-Length: %d\r\n\r\n" % size)
            sent = 0
            try:
                while sent < size - 1:
                    sent += s.send(chunk[:min(len(chunk), size - 1 - sent)])
            except OSError:
                pass
            try:
                statuses, _ = parse_responses(s.recv(65536))
                key = statuses[0] if statuses else "none"
            except OSError:
                key = "reset"
            with lock:
                answers[key] += 1
        finally:
            s.close()

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return f"{n} bodies of {size - 1} bytes -> " + ", ".join(f"{k}: {v}" for k, v in sorted(answers.items(), key=str))


ATTACKS: list[tuple[str, Callable[[int, float], str]]] = [
    ("fan-out beyond --max-prompts", a_fanout_refused),
    ("fan-out at --max-prompts", a_fanout_at_limit),
    ("idle after 401 at --max-connections", a_idle_unauthorised),
    ("idle keep-alive at --max-connections", a_idle_authorised),
    ("keyless 16 MiB bodies", a_preauth_body),
]


def run_attack(port: int, pid: int, name: str, attack: Callable[[int, float], str], scale: float) -> AttackResult:
    res = AttackResult(name)
    base = []
    for _ in range(20):
        dt, why = other_client(port)
        if why is None:
            base.append(dt)
    res.base_s = statistics.median(base) if base else 0.0
    rss0 = rss_bytes(pid)
    peak = [rss0]
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("note", attack(port, scale)), daemon=True)
    sampling = True

    def sample() -> None:
        while sampling:
            peak[0] = max(peak[0], rss_bytes(pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t.start()
    t0 = time.monotonic()
    time.sleep(0.2)  # the attack is under way
    while t.is_alive() or time.monotonic() - t0 < 1.0:
        dt, why = other_client(port)
        if why is None:
            res.during_s.append(dt)
        else:
            res.failed.append(why)
    t.join(180)
    sampling = False
    sampler.join(5)
    res.rss_growth = peak[0] - rss0
    res.note = out.get("note", "did not finish")
    return res


def attacks(model: str, out: str, scale: float) -> list[AttackResult]:
    """Every attack in turn against one server (each measured from the RSS it starts at)."""
    proc, port = start_server(model, os.path.join(out, "server-attacks.log"), ATTACK_ARGS)
    try:
        return [run_attack(port, proc.pid, name, attack, scale) for name, attack in ATTACKS]
    finally:
        stop_server(proc)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0, help="how long to fuzz")
    ap.add_argument("--seconds", type=float, help="how long to fuzz, in seconds (overrides --minutes)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (the same seed replays the same cases)")
    ap.add_argument("--model", help="GGUF model to serve (default: a tiny one made under --out)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="where failing inputs and the server log go")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--no-attacks", action="store_true", help="fuzz only")
    which.add_argument("--attacks-only", action="store_true", help="run the attacks only, no fuzzing")
    ap.add_argument("--no-grammar", action="store_true",
                    help="skip the pathological-grammar case (a few seconds of a core or two)")
    ap.add_argument("--attack-scale", type=float, default=1.0,
                    help="size of the attacks (prompts, bodies, hold time), 1 = the full ones")
    args = ap.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    os.makedirs(args.out, exist_ok=True)
    model = args.model or ensure_model(args.out)
    report = Report()
    grammar: Optional[dict] = None
    t0 = time.monotonic()
    if not args.attacks_only:
        log_path = os.path.join(args.out, "server.log")
        open(log_path, "w").close()
        proc, port = start_server(model, log_path)
        try:
            report = fuzz(port, seconds, args.seed, args.out, proc)
            grammar = None if args.no_grammar else grammar_case(port, proc)
        finally:
            stop_server(proc)
        for line in log_problems(log_path):
            report.failures.append({"why": "server log: " + line, "file": log_path})
    elapsed = time.monotonic() - t0
    results: list[AttackResult] = []
    if not args.no_attacks:
        log_path = os.path.join(args.out, "server-attacks.log")
        open(log_path, "w").close()
        results = attacks(model, args.out, args.attack_scale)
        for r in results:
            for why in r.failed[:3]:
                report.failures.append({"kind": r.name, "why": "another client's request failed: " + why,
                                        "file": log_path})
        for line in log_problems(log_path):
            report.failures.append({"why": "server log: " + line, "file": log_path})
    if not args.attacks_only:
        hist = ", ".join(f"{k}: {v}" for k, v in sorted(report.statuses.items(), key=lambda kv: str(kv[0])))
        print(f"{report.cases} cases in {elapsed:.1f} s (seed {args.seed})")
        print(f"statuses: {hist}")
    if grammar is not None:
        print_grammar_case(grammar)
        if not grammar["serves_after"] or any(s >= 500 and s != 503 for s in grammar["bad_statuses"]):
            report.failures.append({"why": f"pathological grammars: {grammar['bad_statuses']}",
                                    "file": os.path.join(args.out, "server.log")})
    if results:
        print(f"attacks (scale {args.attack_scale:g}): server RSS growth at its peak; another client's completion "
              "(new connection, n_predict 4): median and worst during the attack against unloaded (target 2x)")
        for r in results:
            print(f"  {r.name}: {r.note}")
            line = f"    RSS +{r.rss_growth / 2**20:.1f} MiB; other client {r.base_s * 1e3:.1f} ms unloaded, "
            if r.during_s:
                target = "within 2x" if r.ratio <= 2.0 else "over 2x"
                line += (f"{statistics.median(r.during_s) * 1e3:.1f} ms median ({r.ratio:.2f}x, {target}), "
                         f"{max(r.during_s) * 1e3:.0f} ms worst ({r.worst_ratio:.2f}x) over {len(r.during_s)} answered")
            else:
                line += "none of its requests answered"
            print(line + f", {len(r.failed)} failed")
    print(f"failures: {len(report.failures)}")
    for f in report.failures:
        print(f"  {f.get('kind', '-')}: {f['why']} -> {f['file']}")
        if "input_head" in f:
            print(f"    {f['input_head'][:160]!r}")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
