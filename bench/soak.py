"""Soak: many concurrent streaming clients for minutes over a two-group layer split, then SIGTERM.

    python bench/soak.py [--preset small | --model PATH] [--clients 256] [--minutes 5]
        [--warmup-s 30] [--device RPC0,CPU] [--groups 2] [-t 1] [--ts 1,1] [--slots N]
        [--ctx CELLS] [--rss-interval 2] [--max-slope 5] [--request-timeout 300] [--shutdown-bound 30]
        [--abort-rate 0.02] [--seed 0] [--server-args '...'] [--out DIR]

Starts one rpc server (`python -m pyllama.rpc_server -t T`) and one server splitting the model
over it (`--rpc ENDPOINT --device RPC0,CPU --pipeline-groups 2 -np SLOTS -c SLOTS*PER_SLOT`; SLOTS
is the client count rounded up to a multiple of the groups, so that no request waits for a slot
unless --slots says otherwise). Both log to files under --out.

Load. C clients, all coroutines of one event loop over raw keep-alive sockets (no thread per
client), run a closed loop: each sends a streaming request and reads its Server-Sent Events to the
end, then sends the next. The mix, drawn per request from a seeded generator: `POST /completion`
with stream=true (a prompt of 4..96 random token ids, or a short text), or `POST
/v1/chat/completions` with stream=true (most with stream_options.include_usage); n_predict 1..64;
greedy or sampled; a third with one or two stop strings; --abort-rate of them disconnect on purpose
after a few events (half with a FIN, half with a RST), counted apart. The first --warmup-s seconds
are warm-up; the load window of --minutes follows.

Every response is checked. /completion: HTTP 200, text/event-stream, chunked framing to its last
chunk; one event per token with `tokens_predicted` counting up by one; exactly one final event
(`stop: true`), last; its tokens_predicted equals the token events, `timings.predicted_n` equals
it, it is at most n_predict and equal to it when `stop_type` is `limit`; `tokens_evaluated` is
the prompt's length for id prompts; `stopping_word` is one of the request's stops when
`stop_type` is `word`; the streamed text contains no stop string. Chat: one id and object over all
chunks, the role first, exactly one chunk with a finish_reason, the usage chunk (when asked) with
completion_tokens at most max_tokens and equal to it when finish_reason is `length`, content chunks
at most completion_tokens + 1, then `data: [DONE]` and nothing after it. Outcomes: complete (all
checks pass), invalid (complete framing, a check failed), failed (a clean HTTP error, or an error
event in the stream), truncated (the stream ended early), lost (no answer at all: the connection
closed before a status line, or no end within --request-timeout), aborted (on purpose).

Memory. Every --rss-interval seconds the RSS, open file descriptors and threads of both processes
are sampled (psutil) into rss.csv. Reported per process: RSS at the start of the load window (the
first sample after warm-up), the maximum and the last sample in the window, and the least-squares
slope over the second half of the window in MiB/min. The slope is judged against --max-slope only
when that half spans at least --slope-min-s seconds (a few seconds of samples say nothing). The
default of 5 MiB/min tells a leak from glibc's heap settling: large numpy arrays of varying sizes
raise its dynamic mmap threshold, and the server's heap grows by a few MiB/min at first, less and
less over about ten minutes (MALLOC_MMAP_THRESHOLD_=65536 in the environment keeps it flat); a
tighter claim needs a longer window and a lower --max-slope.

The server's prompt cache in host memory (`--cache-ram`, 8192 MiB by default) may grow up to its
limit: its bytes and limit are read from /metrics (`llamacpp:prompt_cache_bytes`,
`llamacpp:prompt_cache_limit_bytes`) with every sample and reported beside the RSS. For the server
the slope judged is that of its RSS less the cache's bytes; the cache over its limit, or the
server's RSS growing in the window by more than the limit (plus --max-slope a minute), fails.

Shutdown. At the end of the window the server gets SIGTERM while the clients are still streaming;
the clients send nothing new. Measured: the time to the server's exit. Checked: the exit status is
0; every request in flight at SIGTERM ended (within --shutdown-bound seconds) complete and valid,
with a clean HTTP error, closed at an event boundary without a partial event, or closed before any
answer (a request the server had not read yet); no child process of the server remains. Then the
rpc server gets SIGTERM the same way (exit status 0, within the bound).

Written under --out (default bench/out/soak/<time>): summary.json, rss.csv, failures.jsonl (the
first 200 failed requests), server.log, rpc_server.log. Exit status 1 on any invalid, failed,
truncated or lost request, an unclean shutdown, or a judged slope above --max-slope; 0 otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # a checkout without an install
    sys.path.insert(0, ROOT)

import psutil  # noqa: E402

from server_util import free_port  # noqa: E402

PROG = "soak"
MAX_ID_PROMPT = 96       # token ids in a /completion prompt at most
MAX_TEXT_WORDS = 12      # words of a text prompt or chat message at most
MAX_N_PREDICT = 64
PER_SLOT = 256           # KV positions per slot: prompt (ids, or text and chat template) + n_predict + slack
MAX_FAILURE_RECORDS = 200
WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "far", "away", "from", "home",
         "while", "rain", "fell", "over", "quiet", "hills", "story", "of", "light", "stone", "river", "song")
STOPS = ("e", "s", "th", "a", "\n", "ing", "er", ".")

RSS_COLUMNS = ["t_s", "phase", "server_rss_mib", "rpc_rss_mib", "server_fds", "rpc_fds", "server_threads",
               "rpc_threads", "in_flight", "completed", "tokens", "server_cache_mib", "server_rest_mib"]
OUTCOMES = ("complete", "invalid", "failed", "truncated", "lost", "aborted")


# ---------------------------------------------------------------------------------------------
# Processes


def kill_survivors(children: list) -> list[str]:
    """Kills the processes of `children` (psutil) still running; returns what they were."""
    left = []
    for c in children:
        try:
            if c.is_running() and c.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{c.pid} {' '.join(c.cmdline())[:120]}")
                c.kill()
        except psutil.Error:
            pass
    return left


class Proc:
    """A child process logging to a file."""

    def __init__(self, cmd: list[str], log_path: str, env: dict) -> None:
        self.cmd = cmd
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env)
        self.ps = psutil.Process(self.proc.pid)

    def log_text(self) -> str:
        try:
            with open(self.log_path, "r", errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    def log_tail(self, n: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def stop(self, bound: float) -> dict:
        """SIGTERM, wait up to `bound` seconds (then SIGKILL). Reports exit status, time, leftovers."""
        res: dict = {"signal": "SIGTERM", "exit_status": None, "exit_s": None, "killed": False,
                     "children_left": []}
        try:
            children = self.ps.children(recursive=True)
        except psutil.Error:
            children = []
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            res["exit_status"] = self.proc.wait(bound)
        except subprocess.TimeoutExpired:
            res["killed"] = True
            self.proc.kill()
            res["exit_status"] = self.proc.wait()
        res["exit_s"] = round(time.monotonic() - t0, 3)
        res["children_left"] = kill_survivors(children)
        self._log.close()
        return res

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if not self._log.closed:
            self._log.close()


def start_rpc_server(threads: int, log_path: str, env: dict, timeout: float = 120) -> tuple[Proc, str]:
    cmd = [sys.executable, "-m", "pyllama.rpc_server", "--host", "127.0.0.1", "--port", "0", "-t", str(threads)]
    p = Proc(cmd, log_path, env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in p.log_text().splitlines():
            if "listening on" in line:
                port = int(line.rsplit(":", 1)[1].split()[0])
                return p, f"127.0.0.1:{port}"
        if p.proc.poll() is not None:
            raise RuntimeError(f"rpc_server exited {p.proc.returncode}: {p.log_tail()}")
        time.sleep(0.1)
    p.kill()
    raise TimeoutError("rpc_server did not start")


def start_server(model: str, args: list[str], log_path: str, env: dict, timeout: float = 600) -> tuple[Proc, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "pyllama.server", "-m", model, "--port", str(port), "--metrics", *args]
    p = Proc(cmd, log_path, env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise RuntimeError(f"server exited {p.proc.returncode}: {p.log_tail()}")
        try:
            status, _ = asyncio.run(_get("127.0.0.1", port, "/health", 5.0))
            if status == 200:
                return p, port
        except (OSError, asyncio.TimeoutError, ValueError):
            pass
        time.sleep(0.2)
    p.kill()
    raise TimeoutError("server did not become ready")


# ---------------------------------------------------------------------------------------------
# HTTP over raw asyncio streams

class Cut(Exception):
    """The connection ended before the response did."""

    def __init__(self, where: str, reset: bool = False) -> None:
        super().__init__(where)
        self.where = where
        self.reset = reset


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        raise Cut("before the status line" if not e.partial else "in the headers") from None
    except ConnectionResetError:
        raise Cut("before the status line", reset=True) from None
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise ValueError(f"bad status line {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    return int(parts[1]), headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    try:
        if "content-length" in headers:
            return await reader.readexactly(int(headers["content-length"]))
        if headers.get("transfer-encoding", "").lower() == "chunked":
            out = bytearray()
            async for chunk in _chunks(reader):
                out += chunk
            return bytes(out)
        return await reader.read()
    except asyncio.IncompleteReadError:
        raise Cut("in the body") from None
    except ConnectionResetError:
        raise Cut("in the body", reset=True) from None


async def _chunks(reader: asyncio.StreamReader):
    """The chunks of a chunked body; Cut when it ends early (where: 'between chunks' or 'mid-chunk')."""
    while True:
        try:
            line = await reader.readuntil(b"\r\n")
        except asyncio.IncompleteReadError as e:
            raise Cut("between chunks" if not e.partial else "mid-chunk") from None
        except ConnectionResetError:
            raise Cut("between chunks", reset=True) from None
        size = int(line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            try:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
            except asyncio.IncompleteReadError:
                raise Cut("in the trailer") from None
            return
        try:
            data = await reader.readexactly(size + 2)
        except asyncio.IncompleteReadError:
            raise Cut("mid-chunk") from None
        except ConnectionResetError:
            raise Cut("mid-chunk", reset=True) from None
        if data[-2:] != b"\r\n":
            raise ValueError("chunk not followed by CRLF")
        yield data[:-2]


async def _get(host: str, port: int, path: str, timeout: float) -> tuple[int, bytes]:
    async def go() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            status, headers = await _read_head(reader)
            return status, await _read_body(reader, headers)
        finally:
            writer.transport.abort()
    try:
        return await asyncio.wait_for(go(), timeout)
    except Cut as e:
        raise OSError(f"cut {e.where}") from None


# ---------------------------------------------------------------------------------------------
# Requests

def make_request(rng: random.Random, vocab: tuple[int, int], abort_rate: float) -> dict:
    """One request of the mix: {path, body, kind, n_predict, stops, id_prompt_len, usage, abort_after}."""
    n_predict = rng.randint(1, MAX_N_PREDICT)
    stops = rng.sample(STOPS, rng.randint(1, 2)) if rng.random() < 1 / 3 else []
    sampling: dict = {"temperature": 0.0} if rng.random() < 0.5 else {
        "temperature": 0.8, "seed": rng.randrange(1 << 31)}
    abort_after = rng.randint(1, max(1, n_predict // 2)) if rng.random() < abort_rate else None
    ignore_eos = rng.random() < 0.5
    if rng.random() < 0.6:
        if rng.random() < 0.75:
            prompt: Any = [rng.randrange(*vocab) for _ in range(rng.randint(4, MAX_ID_PROMPT))]
            id_len = len(prompt)
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, MAX_TEXT_WORDS)))
            id_len = None
        body = {"prompt": prompt, "n_predict": n_predict, "stream": True, "ignore_eos": ignore_eos, **sampling}
        if stops:
            body["stop"] = stops
        return {"path": "/completion", "body": body, "kind": "completion", "n_predict": n_predict,
                "stops": stops, "id_prompt_len": id_len, "usage": False, "abort_after": abort_after}
    msgs = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, MAX_TEXT_WORDS)))}]
    if rng.random() < 0.3:
        msgs.insert(0, {"role": "system", "content": "be brief"})
    usage = rng.random() < 0.8
    body = {"model": "m", "messages": msgs, "max_tokens": n_predict, "stream": True, **sampling}
    if ignore_eos:
        body["ignore_eos"] = True
    if usage:
        body["stream_options"] = {"include_usage": True}
    if stops:
        body["stop"] = stops
    return {"path": "/v1/chat/completions", "body": body, "kind": "chat", "n_predict": n_predict, "stops": stops,
            "id_prompt_len": None, "usage": usage, "abort_after": abort_after}


def _sse_events(buf: bytearray) -> list[str]:
    """Complete events' data fields taken off the front of buf (multi-line data joined with \\n)."""
    out = []
    while True:
        i = buf.find(b"\n\n")
        if i < 0:
            return out
        block = bytes(buf[:i]).decode("utf-8")
        del buf[:i + 2]
        data = [ln[5:].lstrip(" ") if ln.startswith("data:") else None for ln in block.split("\n")]
        data = [d for d in data if d is not None]
        if data:
            out.append("\n".join(data))


class Checker:
    """Follows one streamed response event by event; `problems` lists what is wrong."""

    def __init__(self, req: dict) -> None:
        self.req = req
        self.problems: list[str] = []
        self.events = 0
        self.tokens = 0          # generated tokens as the response reports them
        self.content: list[str] = []
        self.done = False        # the stream's last event has arrived
        self.final: Optional[dict] = None
        # chat
        self.chat_id = None
        self.finish_reason = None
        self.content_chunks = 0
        self.usage: Optional[dict] = None
        self.error: Any = None   # the error object of an error event

    def bad(self, msg: str) -> None:
        if len(self.problems) < 5:
            self.problems.append(msg)

    def feed(self, data: str) -> None:
        self.events += 1
        if self.done:
            self.bad(f"event after the end of the stream: {data[:80]!r}")
            return
        if self.req["kind"] == "completion":
            self._completion(data)
        else:
            self._chat(data)

    def _json(self, data: str) -> Optional[dict]:
        try:
            ev = json.loads(data)
        except ValueError:
            self.bad(f"bad JSON in an event: {data[:80]!r}")
            return None
        if not isinstance(ev, dict):
            self.bad(f"event is not an object: {data[:80]!r}")
            return None
        if "error" in ev:
            self.error = ev["error"]
            self.done = True
            return None
        return ev

    def _completion(self, data: str) -> None:
        ev = self._json(data)
        if ev is None:
            return
        self.content.append(ev.get("content") or "")
        if not ev.get("stop"):
            toks = ev.get("tokens")
            if not isinstance(toks, list) or len(toks) != 1:
                self.bad(f"token event without exactly one token: {data[:80]!r}")
            self.tokens += 1
            if ev.get("tokens_predicted") != self.tokens:
                self.bad(f"token event {self.tokens} says tokens_predicted {ev.get('tokens_predicted')}")
            return
        self.done = True
        self.final = ev
        req = self.req
        n = ev.get("tokens_predicted")
        if n != self.tokens:
            self.bad(f"final tokens_predicted {n} != {self.tokens} token events")
        timings = ev.get("timings") or {}
        if timings.get("predicted_n") != n:
            self.bad(f"timings.predicted_n {timings.get('predicted_n')} != tokens_predicted {n}")
        st = ev.get("stop_type")
        if st not in ("eos", "limit", "word"):
            self.bad(f"stop_type {st!r}")
        if isinstance(n, int):
            if n > req["n_predict"]:
                self.bad(f"tokens_predicted {n} > n_predict {req['n_predict']}")
            if st == "limit" and n != req["n_predict"]:
                self.bad(f"stop_type limit at {n} tokens, n_predict {req['n_predict']}")
        if st == "word" and ev.get("stopping_word") not in req["stops"]:
            self.bad(f"stopping_word {ev.get('stopping_word')!r} not among {req['stops']}")
        if req["id_prompt_len"] is not None and ev.get("tokens_evaluated") != req["id_prompt_len"]:
            self.bad(f"tokens_evaluated {ev.get('tokens_evaluated')} != prompt of {req['id_prompt_len']} ids")
        if ev.get("truncated"):
            self.bad("final event says truncated")

    def _chat(self, data: str) -> None:
        req = self.req
        if data == "[DONE]":
            self.done = True
            if self.finish_reason is None:
                self.bad("[DONE] without a finish_reason")
            if req["usage"] and self.usage is None:
                self.bad("[DONE] without the usage chunk")
            return
        ev = self._json(data)
        if ev is None:
            return
        if self.chat_id is None:
            self.chat_id = ev.get("id")
        elif ev.get("id") != self.chat_id:
            self.bad(f"chunk id {ev.get('id')!r} != {self.chat_id!r}")
        if ev.get("object") != "chat.completion.chunk":
            self.bad(f"object {ev.get('object')!r}")
        choices = ev.get("choices")
        if not isinstance(choices, list):
            self.bad("chunk without choices")
            return
        if not choices:  # the usage chunk
            u = ev.get("usage")
            if not req["usage"] or not isinstance(u, dict) or self.usage is not None:
                self.bad(f"unexpected chunk without choices: {data[:80]!r}")
                return
            if self.finish_reason is None:
                self.bad("usage chunk before the finish_reason")
            self.usage = u
            n = u.get("completion_tokens")
            self.tokens = n if isinstance(n, int) else 0
            if not isinstance(n, int) or n > req["n_predict"]:
                self.bad(f"usage.completion_tokens {n!r} with max_tokens {req['n_predict']}")
            elif self.finish_reason == "length" and n != req["n_predict"]:
                self.bad(f"finish_reason length at {n} tokens, max_tokens {req['n_predict']}")
            elif self.content_chunks > n + 1:
                self.bad(f"{self.content_chunks} content chunks for {n} tokens")
            if u.get("total_tokens") != (u.get("prompt_tokens") or 0) + (n or 0):
                self.bad(f"usage totals do not add up: {u}")
            return
        if len(choices) != 1:
            self.bad(f"{len(choices)} choices in a chunk")
            return
        c = choices[0]
        delta = c.get("delta") or {}
        if self.events == 1:
            if delta.get("role") != "assistant":
                self.bad(f"first chunk without the assistant role: {data[:80]!r}")
            return
        if self.finish_reason is not None:
            self.bad(f"chunk after the finish_reason: {data[:80]!r}")
        if c.get("finish_reason") is not None:
            self.finish_reason = c["finish_reason"]
            if self.finish_reason not in ("stop", "length"):
                self.bad(f"finish_reason {self.finish_reason!r}")
            return
        text = delta.get("content")
        if not isinstance(text, str):
            self.bad(f"chunk without content: {data[:80]!r}")
            return
        self.content_chunks += 1
        self.content.append(text)
        if not req["usage"]:
            self.tokens = self.content_chunks  # a lower bound: tokens without text send no chunk

    def finish(self) -> None:
        """Checks that need the whole stream."""
        if self.error is not None:
            return
        text = "".join(self.content)
        for s in self.req["stops"]:
            if s in text:
                self.bad(f"stop string {s!r} in the streamed text")
                break
        if self.req["kind"] == "chat" and self.finish_reason == "length" and not self.req["usage"] \
                and self.content_chunks > self.req["n_predict"] + 1:
            self.bad(f"{self.content_chunks} content chunks for max_tokens {self.req['n_predict']}")


# ---------------------------------------------------------------------------------------------
# The run

class Run:
    def __init__(self, a, port: int, vocab: tuple[int, int], server: Proc, rpc: Proc, out_dir: str) -> None:
        self.a = a
        self.host, self.port = "127.0.0.1", port
        self.vocab = vocab
        self.server, self.rpc = server, rpc
        self.out_dir = out_dir
        self.phase = "warmup"
        self.t_start = 0.0
        self.t_load = self.t_load_end = 0.0
        self.t_term: Optional[float] = None
        self.stop_new = False
        self.counts = {ph: {k: 0 for k in ("started", *OUTCOMES)} for ph in ("warmup", "load")}
        self.tokens = {"warmup": 0, "load": 0}          # tokens of the requests completed in each phase
        self.completed_in = {"warmup": 0, "load": 0}
        self.kinds: dict[str, int] = {}
        self.stop_types: dict[str, int] = {}
        self.failures: list[dict] = []
        self.in_flight: dict[int, dict] = {}   # client -> the request it is in
        self.shutdown_reqs: list[dict] = []    # requests in flight at SIGTERM, with their end
        self.client_end: dict[int, float] = {}
        self.samples: list[dict] = []
        # the server's prompt cache (--cache-ram) from /metrics: bytes held, its limit (None: unknown)
        self.cache_bytes: Optional[float] = None
        self.cache_limit: Optional[float] = None
        self.completed_total = 0
        # the curve is written as it is sampled, so that a run cut short still leaves it
        self._csv_file = open(os.path.join(out_dir, "rss.csv"), "w", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=RSS_COLUMNS, extrasaction="ignore")
        self._csv.writeheader()

    # --- clients --------------------------------------------------------------------------------
    async def client(self, cid: int) -> None:
        rng = random.Random(f"soak/{self.a.seed}/{cid}")
        reader = writer = None
        try:
            while not self.stop_new:
                if writer is None:
                    try:
                        reader, writer = await asyncio.open_connection(self.host, self.port)
                    except OSError as e:
                        self._record({"phase": self.phase, "kind": "connect"}, "lost", f"connect: {e}")
                        await asyncio.sleep(0.5)
                        continue
                req = make_request(rng, self.vocab, self.a.abort_rate)
                req["phase"] = self.phase
                req["client"] = cid
                self.counts[req["phase"]]["started"] += 1
                self.in_flight[cid] = req
                keep = await self.one(reader, writer, req)
                self.in_flight.pop(cid, None)
                if not keep:
                    writer.transport.abort()
                    reader = writer = None
        finally:
            if writer is not None:
                writer.transport.abort()
            self.client_end[cid] = time.monotonic()

    async def one(self, reader, writer, req: dict) -> bool:
        """Send req, read and check its response, record the outcome; returns whether the
        connection may be reused."""
        body = json.dumps(req["body"]).encode()
        head = (f"POST {req['path']} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        req["t_send"] = time.monotonic()
        chk = Checker(req)
        req["checker"] = chk
        try:
            return await asyncio.wait_for(self._exchange(reader, writer, head + body, req, chk),
                                          self.a.request_timeout)
        except asyncio.TimeoutError:
            self._record(req, "lost", f"no end within {self.a.request_timeout:g} s "
                                      f"({chk.events} events read)")
            return False

    async def _exchange(self, reader, writer, data: bytes, req: dict, chk: Checker) -> bool:
        try:
            writer.write(data)
            status, headers = await _read_head(reader)
        except Cut as e:
            self._record(req, "lost", f"connection closed {e.where}" + (" (reset)" if e.reset else ""),
                         cut=e.where, reset=e.reset)
            return False
        except OSError as e:
            self._record(req, "lost", f"{type(e).__name__}: {e}", cut="before the status line", reset=True)
            return False
        except ValueError as e:
            self._record(req, "invalid", f"bad response head: {e}")
            return False
        req["status"] = status
        keep = headers.get("connection", "").lower() != "close"
        if status != 200:
            try:
                body = await _read_body(reader, headers)
            except Cut as e:
                self._record(req, "truncated", f"HTTP {status}, error body cut {e.where}", cut=e.where, reset=e.reset)
                return False
            self._record(req, "failed", f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}")
            return keep
        if "text/event-stream" not in headers.get("content-type", "") or \
                headers.get("transfer-encoding", "").lower() != "chunked":
            self._record(req, "invalid", f"200 with Content-Type {headers.get('content-type')!r}, "
                                         f"Transfer-Encoding {headers.get('transfer-encoding')!r}")
            return False
        buf = bytearray()
        abort_after = req["abort_after"]
        try:
            async for chunk in _chunks(reader):
                buf += chunk
                for ev in _sse_events(buf):
                    chk.feed(ev)
                if abort_after is not None and chk.events >= abort_after and not chk.done:
                    if req["client"] % 2:
                        writer.transport.abort()      # RST
                    else:
                        writer.close()                # FIN
                    self._record(req, "aborted", f"after {chk.events} events")
                    return False
        except Cut as e:
            partial = bool(buf.strip())
            self._record(req, "truncated", f"stream cut {e.where} after {chk.events} events"
                         + (", inside an event" if partial else "") + (" (reset)" if e.reset else ""),
                         cut=e.where, reset=e.reset, partial_event=partial)
            return False
        except OSError as e:
            self._record(req, "truncated", f"stream cut after {chk.events} events: {type(e).__name__}: {e}",
                         cut="mid-stream", reset=True)
            return False
        except (ValueError, UnicodeDecodeError) as e:
            self._record(req, "invalid", f"bad framing: {e}")
            return False
        if buf.strip():
            chk.bad(f"{len(buf)} bytes after the last event")
        if chk.error is not None:
            self._record(req, "failed", f"error event: {json.dumps(chk.error)[:200]}")
            return keep
        if not chk.done:
            self._record(req, "truncated", f"stream ended without its last event after {chk.events} events",
                         cut="at the end of the body")
            return keep
        chk.finish()
        if chk.problems:
            self._record(req, "invalid", "; ".join(chk.problems))
            return keep
        self._record(req, "complete", "")
        return keep

    def _record(self, req: dict, outcome: str, why: str, cut: Optional[str] = None, reset: bool = False,
                partial_event: bool = False) -> None:
        now = time.monotonic()
        ph = req.get("phase", self.phase)
        req["outcome"], req["why"], req["t_end"] = outcome, why, now
        req["cut"], req["reset"], req["partial_event"] = cut, reset, partial_event
        if req.get("in_shutdown"):
            return  # judged by the shutdown check
        if ph in self.counts:
            if req.get("kind") == "connect":
                self.counts[ph]["started"] += 1
            self.counts[ph][outcome] += 1
        chk: Optional[Checker] = req.get("checker")
        if outcome == "complete" and chk is not None:
            self.completed_total += 1
            if self.phase in self.tokens:  # throughput counts by the time of completion
                self.tokens[self.phase] += chk.tokens
                self.completed_in[self.phase] += 1
            k = req["kind"]
            self.kinds[k] = self.kinds.get(k, 0) + 1
            st = (chk.final or {}).get("stop_type") if k == "completion" else chk.finish_reason
            key = f"{k}:{st}"
            self.stop_types[key] = self.stop_types.get(key, 0) + 1
        if outcome not in ("complete", "aborted") and len(self.failures) < MAX_FAILURE_RECORDS:
            self.failures.append(_failure_doc(req, self.t_start))

    # --- memory ---------------------------------------------------------------------------------
    def sample(self) -> dict:
        s = {"t_s": round(time.monotonic() - self.t_start, 3), "phase": self.phase,
             "completed": self.completed_total, "tokens": self.tokens["warmup"] + self.tokens["load"],
             "in_flight": len(self.in_flight)}
        for name, p in (("server", self.server), ("rpc", self.rpc)):
            try:
                if p.proc.poll() is not None:  # exited: a zombie reports no memory at all
                    raise psutil.NoSuchProcess(p.proc.pid)
                with p.ps.oneshot():
                    s[f"{name}_rss_mib"] = round(p.ps.memory_info().rss / 2**20, 2)
                    s[f"{name}_fds"] = p.ps.num_fds()
                    s[f"{name}_threads"] = p.ps.num_threads()
            except psutil.Error:
                s[f"{name}_rss_mib"] = s[f"{name}_fds"] = s[f"{name}_threads"] = None
        if self.cache_bytes is not None:  # the RSS the cache accounts for, and the rest
            s["server_cache_mib"] = round(self.cache_bytes / 2**20, 2)
            if s["server_rss_mib"] is not None:
                s["server_rest_mib"] = round(s["server_rss_mib"] - s["server_cache_mib"], 2)
        self.samples.append(s)
        self._csv.writerow(s)
        self._csv_file.flush()
        return s

    async def sampler(self) -> None:
        while True:
            await self.read_cache()
            self.sample()
            await asyncio.sleep(self.a.rss_interval)

    async def read_cache(self) -> None:
        """The prompt cache's bytes and limit from /metrics (kept as they were when it does not answer)."""
        try:
            status, body = await _get(self.host, self.port, "/metrics", 10.0)
        except (OSError, asyncio.TimeoutError, ValueError):
            return
        if status != 200:
            return
        for line in body.decode("utf-8", "replace").splitlines():
            if line.startswith("llamacpp:prompt_cache_bytes "):
                self.cache_bytes = float(line.split()[1])
            elif line.startswith("llamacpp:prompt_cache_limit_bytes "):
                self.cache_limit = float(line.split()[1])

    # --- the whole run --------------------------------------------------------------------------
    async def main(self) -> dict:
        a = self.a
        self.t_start = time.monotonic()
        clients = [asyncio.ensure_future(self.client(i)) for i in range(a.clients)]
        sampler = asyncio.ensure_future(self.sampler())
        progress = asyncio.ensure_future(self.progress())
        await asyncio.sleep(a.warmup_s)
        self.phase = "load"
        self.t_load = time.monotonic()
        self.sample()
        await asyncio.sleep(a.minutes * 60.0)
        self.sample()
        health = await self.health()
        scheduler = await self.scheduler_counts()
        # the end of the window: SIGTERM under load
        self.t_load_end = time.monotonic()
        self.phase = "shutdown"
        self.stop_new = True
        for req in self.in_flight.values():
            req["in_shutdown"] = True
            self.shutdown_reqs.append(req)
        children = []
        try:
            children = self.server.ps.children(recursive=True)
        except psutil.Error:
            pass
        self.t_term = time.monotonic()
        self.server.proc.send_signal(signal.SIGTERM)
        exit_status = None
        killed = False
        while time.monotonic() - self.t_term < a.shutdown_bound:
            exit_status = self.server.proc.poll()
            if exit_status is not None:
                break
            await asyncio.sleep(0.02)
        t_exit = time.monotonic()
        if exit_status is None:
            killed = True
            self.server.proc.kill()
            exit_status = self.server.proc.wait()
        _, pending = await asyncio.wait(clients, timeout=max(0.1, a.shutdown_bound - (time.monotonic() - self.t_term)))
        hung = len(pending)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5)
        for t in clients:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()
        sampler.cancel()
        progress.cancel()
        self._csv_file.close()
        left = kill_survivors(children)
        try:
            rpc_after = round(self.rpc.ps.memory_info().rss / 2**20, 2)
            rpc_fds_after = self.rpc.ps.num_fds()
        except psutil.Error:
            rpc_after = rpc_fds_after = None
        return {"health_before_term": health, "scheduler": scheduler,
                "server_exit_status": exit_status, "server_killed": killed,
                "server_exit_s": round(t_exit - self.t_term, 3), "server_children_left": left,
                "clients_hung": hung, "rpc_rss_after_server_exit_mib": rpc_after,
                "rpc_fds_after_server_exit": rpc_fds_after,
                "clients_end_max_s": round(max(self.client_end.values(), default=self.t_term) - self.t_term, 3)}

    async def health(self) -> Any:
        try:
            status, body = await _get(self.host, self.port, "/health", 30.0)
            return {"status": status, "body": body.decode("utf-8", "replace")[:200]}
        except (OSError, asyncio.TimeoutError, ValueError) as e:
            return {"status": None, "body": f"{type(e).__name__}: {e}"}

    async def scheduler_counts(self) -> dict:
        """Preemptions and context shifts so far, from /metrics (None where it does not say)."""
        out: dict = {"preemptions": None, "context_shifts": None}
        try:
            status, body = await _get(self.host, self.port, "/metrics", 30.0)
        except (OSError, asyncio.TimeoutError, ValueError):
            return out
        for line in body.decode("utf-8", "replace").splitlines():
            for key, name in (("preemptions", "llamacpp:n_preemptions_total "),
                              ("context_shifts", "llamacpp:n_context_shifts_total ")):
                if line.startswith(name):
                    out[key] = int(float(line[len(name):]))
        return out

    async def progress(self) -> None:
        while True:
            await asyncio.sleep(self.a.progress_s)
            s = self.samples[-1] if self.samples else {}
            c = self.counts["warmup"] if self.phase == "warmup" else self.counts["load"]
            bad = sum(c[k] for k in ("invalid", "failed", "truncated", "lost"))
            print(f"  {s.get('t_s', 0):7.0f} s  {self.phase:7s}  started {c['started']}  complete {c['complete']}  "
                  f"aborted {c['aborted']}  bad {bad}  in flight {len(self.in_flight)}  "
                  f"RSS server {s.get('server_rss_mib')} MiB, rpc {s.get('rpc_rss_mib')} MiB", flush=True)


def _failure_doc(req: dict, t0: float) -> dict:
    chk: Optional[Checker] = req.get("checker")
    return {"client": req.get("client"), "phase": req.get("phase"), "kind": req.get("kind"),
            "outcome": req.get("outcome"), "why": req.get("why"), "status": req.get("status"),
            "t_send_s": round(req["t_send"] - t0, 3) if "t_send" in req else None,
            "t_end_s": round(req["t_end"] - t0, 3) if "t_end" in req else None,
            "events": chk.events if chk else None, "request": req.get("body")}


# ---------------------------------------------------------------------------------------------
# Memory figures

def slope_mib_per_min(points: list[tuple[float, float]]) -> Optional[float]:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute; None under two points."""
    pts = [(t, v) for t, v in points if v is not None]
    if len(pts) < 2:
        return None
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    den = sum((t - mt) ** 2 for t, _ in pts)
    if den <= 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in pts) / den * 60.0


def memory_figures(samples: list[dict], t_load: float, t_end: float, key: str) -> dict:
    """RSS at the start, max, end of the load window [t_load, t_end] (seconds) and the slope over its
    second half."""
    window = [s for s in samples if t_load - 1e-6 <= s["t_s"] <= t_end + 1e-6 and s.get(key) is not None]
    if not window:
        return {"start_mib": None, "max_mib": None, "end_mib": None, "slope_mib_per_min": None,
                "second_half_s": 0.0, "samples": 0}
    mid = (t_load + t_end) / 2
    half = [(s["t_s"], s[key]) for s in window if s["t_s"] >= mid]
    return {"start_mib": window[0][key], "max_mib": max(s[key] for s in window), "end_mib": window[-1][key],
            "slope_mib_per_min": None if (sl := slope_mib_per_min(half)) is None else round(sl, 3),
            "second_half_s": round(half[-1][0] - half[0][0], 3) if half else 0.0, "samples": len(window)}


def judge_memory(mem: dict, cache: dict, rest: dict, max_slope: float, slope_min_s: float,
                 minutes: float) -> tuple[list[str], bool]:
    """Failures of the memory figures (memory_figures of each process's RSS, of the server's prompt
    cache with its `limit_mib`, and of the server's RSS less the cache), and whether a slope was
    judged. The server's slope is its RSS less the cache's when the cache was read: the cache may
    fill up to its limit; beyond it, or RSS growth past it, fails."""
    failures: list[str] = []
    slope_judged = False
    judged = dict(mem)
    if rest["samples"]:
        judged["server"] = rest
        limit = cache["limit_mib"]
        if limit and limit != float("inf"):  # 0: the cache is off; its RSS is judged by its slope alone
            if cache["max_mib"] is not None and cache["max_mib"] > limit:
                failures.append(f"prompt cache {cache['max_mib']:.1f} MiB, over its limit of {limit:.0f} MiB")
        if limit and limit != float("inf") and rest["second_half_s"] >= slope_min_s:  # as long as a slope
            grown = (mem["server"]["max_mib"] or 0) - (mem["server"]["start_mib"] or 0)
            allowed = limit + max_slope * minutes  # the cache filling, and the heap's settling
            if grown > allowed:
                failures.append(f"server RSS grew {grown:.1f} MiB in the window, beyond the prompt cache's limit "
                                f"({limit:.0f} MiB) and {max_slope:g} MiB/min")
    for name, m in judged.items():
        if m["slope_mib_per_min"] is not None and m["second_half_s"] >= slope_min_s:
            slope_judged = True
            if m["slope_mib_per_min"] > max_slope:
                what = "RSS less its prompt cache" if m is rest else "RSS"
                failures.append(f"{name} {what} slope {m['slope_mib_per_min']:.2f} MiB/min over the second half "
                                f"(limit {max_slope:g})")
    return failures, slope_judged


def judge_shutdown(reqs: list[dict], t_term: float, bound: float) -> dict:
    """Outcomes of the requests in flight at SIGTERM; `unclean` lists what breaks the rules."""
    out = {"in_flight": len(reqs), "complete": 0, "http_error": 0, "closed_at_event_boundary": 0,
           "closed_before_answer": 0, "aborted": 0, "unclean": 0, "max_end_s": 0.0, "problems": []}
    for r in reqs:
        o = r.get("outcome")
        end = r.get("t_end")
        if end is not None:
            out["max_end_s"] = max(out["max_end_s"], round(end - t_term, 3))
        why = None
        if o is None or end is None:
            why = "no end"
        elif end - t_term > bound:
            why = f"ended {end - t_term:.1f} s after SIGTERM"
        elif o == "complete":
            out["complete"] += 1
        elif o == "aborted":
            out["aborted"] += 1
        elif o == "failed":
            out["http_error"] += 1
        elif o == "truncated" and r.get("cut") == "between chunks" and not r.get("partial_event") \
                and not r.get("reset"):
            out["closed_at_event_boundary"] += 1
        elif o == "lost" and r.get("cut") == "before the status line" and not r.get("reset"):
            out["closed_before_answer"] += 1
        else:
            why = f"{o}: {r.get('why')}"
        if why is not None:
            out["unclean"] += 1
            if len(out["problems"]) < 10:
                out["problems"].append(f"client {r.get('client')} {r.get('kind')}: {why}")
    return out


# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="soak.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--preset", default="small", help="test model preset (tiny, small, medium)")
    ap.add_argument("--model", help="GGUF model file (instead of --preset)")
    ap.add_argument("--clients", type=int, default=256, help="concurrent streaming clients")
    ap.add_argument("--minutes", type=float, default=5.0, help="length of the load window")
    ap.add_argument("--warmup-s", type=float, default=30.0, help="seconds of load before the window")
    ap.add_argument("--device", default="RPC0,CPU", help="--device of the server")
    ap.add_argument("--groups", type=int, default=2, help="--pipeline-groups of the server")
    ap.add_argument("-t", "--threads", type=int, default=1, help="-t of each process")
    ap.add_argument("--ts", default="1,1", help="-ts of the server ('' for none)")
    ap.add_argument("--slots", type=int, default=0, help="-np (default: clients rounded up to the groups)")
    ap.add_argument("--ctx", type=int, default=0,
                    help="a KV pool of this many cells per group (-c C --kv-unified), smaller than all clients need "
                         "at once: requests wait and are preempted (default: -c SLOTS*256, split, never full)")
    ap.add_argument("--server-args", default="", help="more server arguments")
    ap.add_argument("--rss-interval", type=float, default=2.0, help="seconds between memory samples")
    ap.add_argument("--max-slope", type=float, default=5.0,
                    help="largest accepted RSS slope over the window's second half, MiB/min, per process")
    ap.add_argument("--slope-min-s", type=float, default=60.0,
                    help="the slope is judged only when the second half spans this many seconds")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds a request may take")
    ap.add_argument("--shutdown-bound", type=float, default=30.0,
                    help="seconds after SIGTERM by which the server must exit and every client must be done")
    ap.add_argument("--abort-rate", type=float, default=0.02, help="share of requests that disconnect on purpose")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress-s", type=float, default=30.0, help="seconds between progress lines")
    ap.add_argument("--out", help="output folder (default bench/out/soak/<time>)")
    return ap


def model_and_vocab(a) -> tuple[str, tuple[int, int]]:
    from pipeline_cells import model_path, prompt_vocab  # noqa: PLC0415
    model = a.model or model_path(a.preset)
    return model, prompt_vocab(model)


def main(argv: Optional[list[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    if a.clients < 1 or a.minutes <= 0 or a.warmup_s < 0 or a.groups < 1:
        print(f"{PROG}: --clients and --groups must be at least 1, --minutes above 0", file=sys.stderr)
        return 2
    out_dir = a.out or os.path.join(HERE, "out", "soak", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    model, vocab = model_and_vocab(a)
    n_slots = a.slots or -(-a.clients // a.groups) * a.groups
    ctx_args = ["-c", str(a.ctx), "--kv-unified"] if a.ctx else ["-c", str(n_slots * PER_SLOT)]
    server_args = ["-t", str(a.threads), "--device", a.device, "-np", str(n_slots), *ctx_args,
                   "--pipeline-groups", str(a.groups)]
    if a.ts:
        server_args += ["-ts", a.ts]
    server_args += shlex.split(a.server_args)
    env = {**os.environ, "PYLLAMA_TRACE": ""}
    try:
        import uvloop  # noqa: PLC0415
        uvloop.install()
    except ImportError:
        pass

    def terminate(signum, frame):  # a SIGTERM to this program still stops the processes it started
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    rpc = server = None
    try:
        t0 = time.monotonic()
        rpc, endpoint = start_rpc_server(a.threads, os.path.join(out_dir, "rpc_server.log"), env)
        server_args = ["--rpc", endpoint, *server_args]
        server, port = start_server(model, server_args, os.path.join(out_dir, "server.log"), env)
        ready_s = time.monotonic() - t0
        print(f"{PROG}: {os.path.basename(model)}, {a.clients} clients, {n_slots} slots in {a.groups} groups over "
              f"{a.device}, warm-up {a.warmup_s:g} s, window {a.minutes:g} min; ready in {ready_s:.1f} s; "
              f"out {out_dir}", flush=True)
        run = Run(a, port, vocab, server, rpc, out_dir)
        shut = asyncio.run(run.main())
        rpc_stop = rpc.stop(a.shutdown_bound)
        server._log.close()
    except (RuntimeError, TimeoutError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        for p in (server, rpc):
            if p is not None:
                p.kill()
        return 1
    except BaseException:
        for p in (server, rpc):
            if p is not None:
                p.kill()
        raise

    t_load = run.t_load - run.t_start
    t_end = run.t_load_end - run.t_start
    window = max(run.t_load_end - run.t_load, 1e-9)
    mem = {name: memory_figures(run.samples, t_load, t_end, f"{name}_rss_mib") for name in ("server", "rpc")}
    # the server's prompt cache may grow up to its limit: the rest of its RSS is what must stay flat
    cache = {"limit_mib": None if run.cache_limit is None else run.cache_limit / 2**20,
             **memory_figures(run.samples, t_load, t_end, "server_cache_mib")}
    rest = memory_figures(run.samples, t_load, t_end, "server_rest_mib")
    fds = {name: {"start": next((s[f"{name}_fds"] for s in run.samples if s["t_s"] >= t_load - 1e-6), None),
                  "end": next((s[f"{name}_fds"] for s in reversed(run.samples) if s["t_s"] <= t_end + 1e-6), None)}
           for name in ("server", "rpc")}
    sd = judge_shutdown(run.shutdown_reqs, run.t_term, a.shutdown_bound)
    load = run.counts["load"]
    warm = run.counts["warmup"]
    failures = []
    for ph, c in (("warm-up", warm), ("load", load)):
        for k in ("invalid", "failed", "truncated", "lost"):
            if c[k]:
                failures.append(f"{c[k]} {k} request(s) in the {ph}")
    if load["complete"] == 0:
        failures.append("no request completed in the load window")
    if shut["health_before_term"]["status"] != 200:
        failures.append(f"/health before SIGTERM: {shut['health_before_term']}")
    if shut["server_killed"] or shut["server_exit_status"] != 0:
        failures.append(f"server exit status {shut['server_exit_status']}"
                        + (f" (killed after {a.shutdown_bound:g} s)" if shut["server_killed"] else ""))
    if shut["server_children_left"]:
        failures.append(f"server children left: {shut['server_children_left']}")
    if shut["clients_hung"]:
        failures.append(f"{shut['clients_hung']} client(s) still running {a.shutdown_bound:g} s after SIGTERM")
    if sd["unclean"]:
        failures.append(f"{sd['unclean']} request(s) in flight at SIGTERM ended uncleanly")
    if rpc_stop["killed"] or rpc_stop["exit_status"] != 0:
        failures.append(f"rpc server exit status {rpc_stop['exit_status']}"
                        + (" (killed)" if rpc_stop["killed"] else ""))
    if rpc_stop["children_left"]:
        failures.append(f"rpc server children left: {rpc_stop['children_left']}")
    mem_failures, slope_judged = judge_memory(mem, cache, rest, a.max_slope, a.slope_min_s, a.minutes)
    failures += mem_failures

    summary = {
        "model": model, "clients": a.clients, "slots": n_slots, "groups": a.groups, "device": a.device,
        "threads": a.threads, "server_args": server_args, "warmup_s": a.warmup_s, "minutes": a.minutes,
        "window_s": round(window, 3), "abort_rate": a.abort_rate, "seed": a.seed,
        "requests": {"warmup": warm, "load": load},
        "tokens_load": run.tokens["load"], "tokens_per_s": round(run.tokens["load"] / window, 2),
        "completed_in_window": run.completed_in["load"],
        "requests_per_s": round(run.completed_in["load"] / window, 3),
        "kinds_completed": run.kinds, "stop_types": run.stop_types, "scheduler": shut["scheduler"],
        "memory": mem, "prompt_cache": cache, "server_rss_less_cache": rest, "fds": fds, "max_slope_mib_per_min": a.max_slope, "slope_judged": slope_judged,
        "shutdown": {**shut, **sd, "rpc_server": rpc_stop},
        "failures": failures, "passed": not failures, "exit_status": 1 if failures else 0,
    }
    with open(os.path.join(out_dir, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
        fh.write("\n")
    with open(os.path.join(out_dir, "failures.jsonl"), "w") as fh:
        for f in run.failures:
            fh.write(json.dumps(f) + "\n")
    print(format_summary(summary))
    return summary["exit_status"]


def _f(x: Any, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def format_summary(s: dict) -> str:
    load, sd = s["requests"]["load"], s["shutdown"]
    lines = [
        f"{PROG}: {s['clients']} clients over {s['window_s']:.0f} s (after {s['warmup_s']:g} s warm-up)",
        f"  load requests    started {load['started']}, complete {load['complete']}, aborted on purpose "
        f"{load['aborted']}, failed {load['failed']}, invalid {load['invalid']}, truncated {load['truncated']}, "
        f"lost {load['lost']}",
        f"  throughput       {s['tokens_per_s']:.1f} tok/s ({s['tokens_load']} tokens), "
        f"{s['requests_per_s']:.2f} req/s",
        f"  completions      {s['kinds_completed']}  stops {s['stop_types']}",
        f"  scheduler        preemptions {s['scheduler']['preemptions']}, context shifts "
        f"{s['scheduler']['context_shifts']} (since the server started)",
    ]
    for name in ("server", "rpc"):
        m = s["memory"][name]
        f = s["fds"][name]
        lines.append(f"  RSS {name:6s}       start {_f(m['start_mib'])} MiB, max {_f(m['max_mib'])}, end "
                     f"{_f(m['end_mib'])}; slope over the second half ({m['second_half_s']:.0f} s) "
                     f"{_f(m['slope_mib_per_min'], '.2f')} MiB/min; fds {f['start']} -> {f['end']}")
    c, r = s["prompt_cache"], s["server_rss_less_cache"]
    lines.append(f"  prompt cache     start {_f(c['start_mib'])} MiB, max {_f(c['max_mib'])}, end {_f(c['end_mib'])} "
                 f"of a limit of {_f(c['limit_mib'], '.0f')} MiB (/metrics); server RSS less the cache: start "
                 f"{_f(r['start_mib'])}, end {_f(r['end_mib'])}, slope {_f(r['slope_mib_per_min'], '.2f')} MiB/min")
    lines += [
        f"  shutdown         SIGTERM with {sd['in_flight']} in flight: server exit {sd['server_exit_status']} after "
        f"{sd['server_exit_s']:.2f} s; in flight: {sd['complete']} complete, {sd['closed_at_event_boundary']} closed "
        f"at an event boundary, {sd['closed_before_answer']} closed before an answer, {sd['http_error']} HTTP "
        f"errors, {sd['aborted']} aborted on purpose, {sd['unclean']} unclean; clients done "
        f"{sd['clients_end_max_s']:.2f} s after SIGTERM",
        f"  rpc server       RSS after the server's exit {_f(sd['rpc_rss_after_server_exit_mib'])} MiB, fds "
        f"{sd['rpc_fds_after_server_exit']}; exit {sd['rpc_server']['exit_status']} after "
        f"{sd['rpc_server']['exit_s']:.2f} s",
        "  result           " + ("PASS" if s["passed"] else "FAIL: " + "; ".join(s["failures"])),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
