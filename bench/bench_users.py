"""Closed-loop concurrent users against a llama-server compatible HTTP server.

    python bench/bench_users.py --url http://127.0.0.1:8080 -u USERS -r REQUESTS_PER_USER \\
        --npp N --ntg M [--warmup K] [--json OUT] [--timeout S] \\
        [--vocab-lo 300 --vocab-hi 1000] [--seed S]

U users, each one thread with one keep-alive connection, send R requests each, one after the
other (closed loop: the next request leaves when the previous response has ended). Every request
is `POST /completion` with a prompt of exactly N random token ids (seeded per user and request,
drawn from [vocab-lo, vocab-hi)), `n_predict` M, `ignore_eos`, greedy sampling, no prompt cache,
streamed as Server-Sent Events. Before the measured window each user sends K warm-up requests
(not counted); all users then meet at a barrier, and the measured window runs from the barrier to
the end of the last measured response.

Reported: requests done, errors (first few messages), short responses (tokens_predicted != M),
wall time of the window, aggregate generated tokens/s, prompt tokens/s, requests/s, TPOT (mean
over requests of the decode time per token after the first), TTFT median and p99. The server's
own counters (`GET /metrics`: llamacpp:tokens_predicted_total, llamacpp:prompt_tokens_total) are
read before and after the window and compared with what the client counted.

Exit status 1 when any measured request failed or was short, or the server's generated-token
counter disagrees with the client; 0 otherwise.

Importable: run_bench(...) -> dict (the --json document), parse_prometheus(text) -> dict.
Standard library only: this talks to the server over HTTP and imports nothing of pyllama.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse
from typing import Callable, Optional

METRIC_PREDICTED = "llamacpp:tokens_predicted_total"
METRIC_PROMPT = "llamacpp:prompt_tokens_total"
MAX_MESSAGES = 5          # error / short messages kept in the report
SETTLE_S = 2.0            # how long to wait for the server's counters to catch up
SETTLE_POLL_S = 0.05


# ---------------------------------------------------------------------------------------------
# Prometheus text format

def _split_sample(line: str) -> tuple[str, str, str] | None:
    """'name{labels} value [ts]' -> (name, '{labels}' or '', rest); None when malformed."""
    i = 0
    n = len(line)
    while i < n and line[i] not in "{ \t":
        i += 1
    name = line[:i]
    if not name:
        return None
    labels = ""
    if i < n and line[i] == "{":
        j = i + 1
        in_quotes = False
        while j < n:
            c = line[j]
            if in_quotes:
                if c == "\\":
                    j += 1          # skip the escaped character
                elif c == '"':
                    in_quotes = False
            elif c == '"':
                in_quotes = True
            elif c == "}":
                break
            j += 1
        if j >= n:
            return None             # unterminated label set
        labels = line[i:j + 1]
        i = j + 1
    return name, labels, line[i:]


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition as {key: value}.

    A sample without labels is keyed by its bare name (`llamacpp:prompt_tokens_total`); one with
    labels by `name{labels}` exactly as written (`http_requests_total{code="200"}`), and an
    empty label set `name{}` is keyed both ways. `# HELP` / `# TYPE` / other comments and blank or
    malformed lines are skipped; an optional timestamp after the value is ignored; `+Inf`, `-Inf`
    and `NaN` parse to the corresponding floats.
    """
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = _split_sample(line)
        if parts is None:
            continue
        name, labels, rest = parts
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if labels and labels != "{}":
            out[name + labels] = value
        else:
            if labels:
                out[name + labels] = value
            out[name] = value
    return out


def metric_value(metrics: dict[str, float], name: str) -> float | None:
    """The bare sample `name`, else the sum of its labelled samples, else None."""
    if name in metrics:
        return metrics[name]
    prefix = name + "{"
    vals = [v for k, v in metrics.items() if k.startswith(prefix)]
    return sum(vals) if vals else None


# ---------------------------------------------------------------------------------------------
# HTTP

class _Target:
    def __init__(self, url: str, timeout: float) -> None:
        if "://" not in url:
            url = "http://" + url
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme {u.scheme!r} in {url!r}")
        if not u.hostname:
            raise ValueError(f"no host in URL {url!r}")
        self.scheme = u.scheme
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        self.timeout = timeout

    def connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def path(self, p: str) -> str:
        return self.prefix + p


def _error_message(body: bytes) -> str:
    """The message of a llama-server error document, else the body itself (shortened)."""
    msg = body.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(msg)
        err = doc.get("error") if isinstance(doc, dict) else None
        if isinstance(err, dict) and err.get("message"):
            msg = str(err["message"])
        elif isinstance(err, str):
            msg = err
    except ValueError:
        pass
    if len(msg) > 200:
        msg = msg[:200] + "..."
    return msg


def _error_text(status: int, body: bytes) -> str:
    msg = _error_message(body)
    return f"HTTP {status}: {msg}" if msg else f"HTTP {status}"


def read_metrics(target: _Target) -> tuple[dict[str, float] | None, str | None]:
    """(samples, None) or (None, why they are unavailable)."""
    conn = target.connect()
    try:
        conn.request("GET", target.path("/metrics"))
        resp = conn.getresponse()
        body = resp.read()
        if resp.status in (404, 501):
            return None, f"GET /metrics returned {resp.status} (server started without metrics?)"
        if resp.status != 200:
            return None, "GET /metrics: " + _error_text(resp.status, body)
        return parse_prometheus(body.decode("utf-8", "replace")), None
    except (OSError, http.client.HTTPException) as e:
        return None, f"GET /metrics failed: {type(e).__name__}: {e}"
    finally:
        conn.close()


def make_prompt(seed: int, user: int, phase: str, index: int, npp: int,
                vocab: tuple[int, int]) -> list[int]:
    """npp token ids from [vocab[0], vocab[1]), the same for the same (seed, user, phase, index)."""
    rng = random.Random(f"bench_users/{seed}/{user}/{phase}/{index}")
    lo, hi = vocab
    return [rng.randrange(lo, hi) for _ in range(npp)]


def one_request(conn: http.client.HTTPConnection, target: _Target, prompt: list[int],
                ntg: int) -> dict:
    """Send one streamed /completion on conn and read it to the end. Never raises.

    Result keys: t_send, t_first (first event with content or tokens), t_last (the stop event),
    t_end (response fully read), status, stop (a stop event arrived), tokens_predicted,
    tokens_evaluated, content_events, stream_tokens, stop_type, error (None or a message).
    """
    body = json.dumps({
        "prompt": prompt,
        "n_predict": ntg,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
        "cache_prompt": False,
    }).encode()
    r: dict = {"t_send": time.perf_counter(), "t_first": None, "t_last": None, "t_end": None,
               "status": None, "stop": False, "tokens_predicted": None, "tokens_evaluated": None,
               "content_events": 0, "stream_tokens": 0, "stop_type": None, "error": None}
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    try:
        try:
            conn.request("POST", target.path("/completion"), body=body, headers=headers)
        except (BrokenPipeError, ConnectionResetError):
            # the server closed this keep-alive connection after the previous response (llama-server
            # does after an error event): nothing was received, so send it again on a new one
            conn.close()
            r["t_send"] = time.perf_counter()
            conn.request("POST", target.path("/completion"), body=body, headers=headers)
        resp = conn.getresponse()
        r["status"] = resp.status
        if resp.status != 200:
            r["error"] = _error_text(resp.status, resp.read())
            r["t_end"] = time.perf_counter()
            return r
        while True:
            raw = resp.readline()
            if not raw:
                break
            now = time.perf_counter()
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not line or line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if field == "error":
                if r["error"] is None:
                    r["error"] = "stream error: " + _error_message(value.encode())
                continue
            if field != "data" or value == "[DONE]":
                continue
            try:
                ev = json.loads(value)
            except ValueError:
                if r["error"] is None:
                    r["error"] = f"bad SSE data: {value[:120]!r}"
                continue
            if not isinstance(ev, dict):
                continue
            if "error" in ev and r["error"] is None:
                r["error"] = "stream error: " + _error_message(value.encode())
                continue
            toks = ev.get("tokens")
            n_toks = len(toks) if isinstance(toks, list) else 0
            if ev.get("content") or n_toks:
                if r["t_first"] is None:
                    r["t_first"] = now
                r["content_events"] += 1
                r["stream_tokens"] += n_toks
            if ev.get("stop") and not r["stop"]:
                r["stop"] = True
                r["t_last"] = now
                r["tokens_predicted"] = ev.get("tokens_predicted")
                r["tokens_evaluated"] = ev.get("tokens_evaluated")
                r["stop_type"] = ev.get("stop_type")
        r["t_end"] = time.perf_counter()
        if r["error"] is None:
            if not r["stop"]:
                ctype = resp.getheader("Content-Type", "")
                r["error"] = "stream ended without a stop event" + (
                    f" (Content-Type {ctype})" if "event-stream" not in ctype else "")
            elif not isinstance(r["tokens_predicted"], int):
                r["error"] = "stop event without tokens_predicted"
    except (OSError, http.client.HTTPException) as e:
        # socket.timeout is an OSError; a dead keep-alive connection is RemoteDisconnected
        r["t_end"] = time.perf_counter()
        r["error"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        conn.close()  # the next request reconnects
    return r


# ---------------------------------------------------------------------------------------------
# The benchmark

def _pct(data: list[float], q: int) -> float | None:
    if not data:
        return None
    if len(data) == 1:
        return data[0]
    return statistics.quantiles(data, n=100, method="inclusive")[q - 1]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 3)


def _settled_metrics(target: _Target, base: dict[str, float] | None,
                     expect_predicted: int | None,
                     settle_s: float) -> tuple[dict[str, float] | None, str | None]:
    """Read /metrics; when base and an expected delta are known, re-read for up to settle_s
    until the tokens_predicted delta reaches it (a server may count a request just after
    sending its last event)."""
    m, why = read_metrics(target)
    if m is None or base is None or expect_predicted is None:
        return m, why
    b = metric_value(base, METRIC_PREDICTED)
    deadline = time.perf_counter() + settle_s
    while True:
        a = metric_value(m, METRIC_PREDICTED)
        if a is None or b is None or a - b >= expect_predicted or time.perf_counter() >= deadline:
            return m, why
        time.sleep(SETTLE_POLL_S)
        m2, why2 = read_metrics(target)
        if m2 is None:
            return m, why
        m = m2


def run_bench(url: str, users: int, requests: int, npp: int, ntg: int, warmup: int = 1,
              timeout: float = 600, seed: int = 0,
              vocab: tuple[int, int] = (300, 1000),
              on_window_start: Optional[Callable[[], None]] = None) -> dict:
    """Run the closed-loop benchmark and return the report (the --json document).
    `on_window_start` is called once, after the warm-up and just before the measured window
    opens (e.g. to read counters of the server's process over exactly that window)."""
    if users < 1 or requests < 1 or npp < 1 or ntg < 1 or warmup < 0:
        raise ValueError("users, requests, npp and ntg must be >= 1 and warmup >= 0")
    lo, hi = int(vocab[0]), int(vocab[1])
    if not 0 <= lo < hi:
        raise ValueError(f"empty token id range [{lo}, {hi})")
    target = _Target(url, timeout)

    m_start, m_why = read_metrics(target)
    warm_results: list[list[dict]] = [[] for _ in range(users)]
    results: list[list[dict]] = [[] for _ in range(users)]
    shared: dict = {"t0": None, "m_before": None, "m_before_why": m_why}
    crashes: list[str] = []

    def at_barrier() -> None:
        # runs once, in the last user to arrive, before anyone is released
        try:
            if m_start is not None:
                warm = [r for rs in warm_results for r in rs]
                expect = None
                if all(r["error"] is None for r in warm):
                    expect = sum(r["tokens_predicted"] for r in warm)
                m, why = _settled_metrics(target, m_start, expect, SETTLE_S)
                shared["m_before"], shared["m_before_why"] = m, why
        except Exception as e:  # never break the barrier: the users must still run
            shared["m_before_why"] = f"reading /metrics failed: {type(e).__name__}: {e}"
        if on_window_start is not None:
            try:
                on_window_start()
            except Exception as e:  # noqa: BLE001 - the caller's reading; the users must still run
                crashes.append(f"on_window_start: {type(e).__name__}: {e}")
        shared["t0"] = time.perf_counter()

    barrier = threading.Barrier(users, action=at_barrier)

    def user(u: int) -> None:
        conn = target.connect()
        try:
            try:
                for i in range(warmup):
                    warm_results[u].append(one_request(
                        conn, target, make_prompt(seed, u, "warmup", i, npp, (lo, hi)), ntg))
            finally:
                barrier.wait()
            for i in range(requests):
                r = one_request(conn, target, make_prompt(seed, u, "run", i, npp, (lo, hi)), ntg)
                r["user"], r["index"] = u, i
                results[u].append(r)
        except Exception as e:  # a harness bug, not a server failure: report it, fail the run
            crashes.append(f"user {u}: {type(e).__name__}: {e}")
        finally:
            conn.close()

    threads = [threading.Thread(target=user, args=(u,), name=f"bench-user-{u}", daemon=True)
               for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    t0 = shared["t0"] if shared["t0"] is not None else time.perf_counter()
    flat = sorted((r for rs in results for r in rs), key=lambda r: (r["user"], r["index"]))
    t_end = max((r["t_end"] for r in flat if r["t_end"] is not None), default=t0)
    wall = max(t_end - t0, 1e-9)

    done = [r for r in flat if r["error"] is None]
    errors = [r for r in flat if r["error"] is not None]
    short = [r for r in done if r["tokens_predicted"] != ntg]
    ok = [r for r in done if r["tokens_predicted"] == ntg]
    gen_tokens = sum(r["tokens_predicted"] for r in done)
    prompt_done = npp * len(done)
    ttfts = [r["t_first"] - r["t_send"] for r in done if r["t_first"] is not None]
    tpots = [(r["t_last"] - r["t_first"]) / (r["tokens_predicted"] - 1)
             for r in done if r["t_first"] is not None and r["tokens_predicted"] >= 2]
    stop_types: dict[str, int] = {}
    for r in done:
        k = str(r["stop_type"])
        stop_types[k] = stop_types.get(k, 0) + 1
    warm_flat = [r for rs in warm_results for r in rs]

    # server counters over the window
    client_predicted = sum(r["tokens_predicted"] for r in flat if isinstance(r["tokens_predicted"], int))
    prompt_sent = npp * sum(1 for r in flat if r["status"] is not None)
    counters: dict = {"available": False, "reason": None,
                      "tokens_predicted_server": None, "tokens_predicted_client": client_predicted,
                      "tokens_predicted_match": None,
                      "prompt_tokens_server": None, "prompt_tokens_sent": prompt_sent,
                      "prompt_tokens_match": None, "prompt_tokens_note": None}
    m_before = shared["m_before"]
    if m_before is None:
        counters["reason"] = shared["m_before_why"] or "no /metrics reading before the window"
    else:
        expect = client_predicted if not errors else None
        m_after, why = _settled_metrics(target, m_before, expect, SETTLE_S)
        if m_after is None:
            counters["reason"] = why
        else:
            vals = {}
            for name in (METRIC_PREDICTED, METRIC_PROMPT):
                a, b = metric_value(m_after, name), metric_value(m_before, name)
                vals[name] = None if a is None or b is None else a - b
            if vals[METRIC_PREDICTED] is None:
                counters["reason"] = f"/metrics has no {METRIC_PREDICTED}"
            else:
                counters["available"] = True
                dp = int(round(vals[METRIC_PREDICTED]))
                counters["tokens_predicted_server"] = dp
                counters["tokens_predicted_match"] = dp == client_predicted
                if vals[METRIC_PROMPT] is None:
                    counters["prompt_tokens_note"] = f"/metrics has no {METRIC_PROMPT}"
                else:
                    dq = int(round(vals[METRIC_PROMPT]))
                    counters["prompt_tokens_server"] = dq
                    counters["prompt_tokens_match"] = dq == prompt_sent
                    if dq < prompt_sent:
                        counters["prompt_tokens_note"] = ("server processed fewer prompt tokens "
                                                          "than sent (cached prompt reused?)")
                    elif dq > prompt_sent:
                        counters["prompt_tokens_note"] = ("server counted more prompt tokens than "
                                                          "sent (other clients, or BOS added?)")

    failures = []
    if crashes or len(flat) != users * requests:
        failures.append(f"only {len(flat)} of {users * requests} requests were sent"
                        + (f" ({crashes[0]})" if crashes else ""))
    if errors:
        failures.append(f"{len(errors)} request(s) failed")
    if short:
        failures.append(f"{len(short)} short response(s)")
    if counters["tokens_predicted_match"] is False:
        failures.append("server tokens_predicted counter disagrees with the client")

    def detail(r: dict) -> dict:
        return {
            "user": r["user"], "index": r["index"], "status": r["status"],
            "t_send_s": round(r["t_send"] - t0, 6),
            "ttft_ms": _ms(None if r["t_first"] is None else r["t_first"] - r["t_send"]),
            "latency_ms": _ms(None if r["t_last"] is None else r["t_last"] - r["t_send"]),
            "tokens_predicted": r["tokens_predicted"], "tokens_evaluated": r["tokens_evaluated"],
            "content_events": r["content_events"], "stream_tokens": r["stream_tokens"],
            "stop_type": r["stop_type"], "error": r["error"],
        }

    return {
        "url": url, "users": users, "requests_per_user": requests, "npp": npp, "ntg": ntg,
        "warmup": warmup, "seed": seed, "vocab": [lo, hi], "timeout_s": timeout,
        "requests": users * requests,
        "requests_sent": len(flat),
        "requests_done": len(done),
        "requests_ok": len(ok),
        "errors": len(errors),
        "error_messages": [f"user {r['user']} req {r['index']}: {r['error']}" for r in errors[:MAX_MESSAGES]],
        "short": len(short),
        "short_messages": [f"user {r['user']} req {r['index']}: tokens_predicted "
                           f"{r['tokens_predicted']} != {ntg} (stop_type {r['stop_type']})"
                           for r in short[:MAX_MESSAGES]],
        "warmup_requests": len(warm_flat),
        "warmup_errors": sum(1 for r in warm_flat if r["error"] is not None),
        "wall_s": round(wall, 6),
        "gen_tokens": gen_tokens,
        "gen_tok_s": gen_tokens / wall,
        "prompt_tokens": prompt_done,
        "prompt_tok_s": prompt_done / wall,
        "req_s": len(done) / wall,
        "tpot_ms": _ms(statistics.fmean(tpots)) if tpots else None,
        "ttft_ms_median": _ms(statistics.median(ttfts)) if ttfts else None,
        "ttft_ms_p99": _ms(_pct(ttfts, 99)),
        "ttft_ms_mean": _ms(statistics.fmean(ttfts)) if ttfts else None,
        "content_events": sum(r["content_events"] for r in done),
        "stream_tokens": sum(r["stream_tokens"] for r in done),
        "tokens_evaluated": sum(r["tokens_evaluated"] for r in done
                                if isinstance(r["tokens_evaluated"], int)),
        "stop_types": stop_types,
        "counters": counters,
        "passed": not failures,
        "failures": failures,
        "exit_status": 1 if failures else 0,
        "per_request": [detail(r) for r in flat],
    }


# ---------------------------------------------------------------------------------------------
# Output

def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_report(rep: dict) -> str:
    c = rep["counters"]
    lines = [
        f"bench_users  {rep['url']}  users {rep['users']}  requests/user {rep['requests_per_user']}"
        f"  npp {rep['npp']}  ntg {rep['ntg']}  warmup {rep['warmup']}  seed {rep['seed']}",
        f"  requests done      {rep['requests_done']} / {rep['requests']}"
        f"  (warm-up {rep['warmup_requests']}, {rep['warmup_errors']} failed)",
        f"  errors             {rep['errors']}",
    ]
    lines += [f"    {m}" for m in rep["error_messages"]]
    lines.append(f"  short responses    {rep['short']}")
    lines += [f"    {m}" for m in rep["short_messages"]]
    lines += [
        f"  wall time          {rep['wall_s']:.3f} s",
        f"  generated tok/s    {rep['gen_tok_s']:.2f}  ({rep['gen_tokens']} tokens)",
        f"  prompt tok/s       {rep['prompt_tok_s']:.2f}  ({rep['prompt_tokens']} tokens)",
        f"  requests/s         {rep['req_s']:.3f}",
        f"  TPOT               {_f(rep['tpot_ms'])} ms",
        f"  TTFT median / p99  {_f(rep['ttft_ms_median'])} / {_f(rep['ttft_ms_p99'])} ms",
        f"  stream check       {rep['content_events']} content events, {rep['stream_tokens']} "
        f"streamed tokens, {rep['gen_tokens']} tokens_predicted",
    ]
    if c["available"]:
        lines.append(f"  server counters    {METRIC_PREDICTED} +{c['tokens_predicted_server']}"
                     f" vs client {c['tokens_predicted_client']}: "
                     + ("match" if c["tokens_predicted_match"] else "MISMATCH"))
        if c["prompt_tokens_server"] is not None:
            lines.append(f"                     {METRIC_PROMPT} +{c['prompt_tokens_server']}"
                         f" vs sent {c['prompt_tokens_sent']}: "
                         + ("match" if c["prompt_tokens_match"] else "differ"))
        if c["prompt_tokens_note"]:
            lines.append(f"                     ({c['prompt_tokens_note']})")
    else:
        lines.append(f"  server counters    skipped: {c['reason']}")
    lines.append("  result             " + ("PASS" if rep["passed"]
                                           else "FAIL: " + "; ".join(rep["failures"])))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL")
    ap.add_argument("-u", "--users", type=int, required=True, help="concurrent users")
    ap.add_argument("-r", "--requests", type=int, required=True, help="measured requests per user")
    ap.add_argument("--npp", type=int, required=True, help="prompt tokens per request (exact)")
    ap.add_argument("--ntg", type=int, required=True, help="generated tokens per request (n_predict)")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted requests per user before the barrier")
    ap.add_argument("--json", metavar="OUT", help="write the report as JSON to OUT")
    ap.add_argument("--timeout", type=float, default=600, help="socket timeout per operation, seconds")
    ap.add_argument("--vocab-lo", type=int, default=300, help="lowest prompt token id")
    ap.add_argument("--vocab-hi", type=int, default=1000, help="prompt token ids are < this")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt token ids")
    args = ap.parse_args(argv)
    try:
        rep = run_bench(args.url, args.users, args.requests, args.npp, args.ntg,
                        warmup=args.warmup, timeout=args.timeout, seed=args.seed,
                        vocab=(args.vocab_lo, args.vocab_hi))
    except ValueError as e:
        print(f"bench_users: {e}", file=sys.stderr)
        return 1
    print(format_report(rep))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rep, fh, indent=1)
            fh.write("\n")
    return rep["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
