"""Pipeline-group cells: one model split over a local CPU and an rpc server, 1..N groups side by side.

    python bench/pipeline_cells.py [--preset medium | --model PATH] [--orders 'CPU,RPC0;RPC0,CPU']
        [--groups 1,2,3,4] [--users 32,64,128] [--legs 3] [--npp 64] [--ntg 64] [-r 1] [-t 1]
        [--warmup 1] [--tensor-split even|auto|a,b] [--server-args '--kv-unified']
        [--netns [--rate 10gbit]] [--json OUT]

One rpc server (`python -m pyllama.rpc_server -t T`) lives for the whole run. A cell is
(device order, groups, users); for each cell a fresh `python -m pyllama.server` is started with

    -m MODEL --rpc ENDPOINT --device ORDER -np NP -c NP*(npp+ntg+16) -t T -ts ... [--pipeline-groups G]

where NP is the user count rounded up to a multiple of G (`--pipeline-groups` is passed only when
G > 1: one group is the server's default). bench_users.run_bench drives it with that many
closed-loop users, then the server is stopped.

An arm is (order, groups). For each order and user count the arms are interleaved: leg 1 of every
groups value, then leg 2 of every groups value, ..., so drifting machine noise is spread over all
arms. Per cell the table gives generated tokens/s (mean over legs and min..max), the ratio of that
mean to the groups=1 arm of the same order and users, and TPOT, TTFT median and p99 (means over
legs) and errors (sum). Then, per order, the best ratio of 2 groups over 1 and the user count it
was reached at. --json OUT writes the configuration, every leg (with bench_users' full report)
and every cell.

--tensor-split: `even` (default) passes equal proportions per device so the layer boundary is the
same in every cell (the default split follows free memory, which moves between runs); `auto`
passes nothing; anything else is passed to -ts as is.

--netns: the rpc server runs in its own network namespace (pyllama-peer-<pid>) behind a veth pair
(pl<pid>a here, 10.231.X.1/30; pl<pid>b there, 10.231.X.2/30) shaped by a tbf qdisc at --rate
on both ends, so the split crosses a link of known bandwidth rather than loopback. Needs root
(ip, tc). The namespace and the veth pair are always removed at exit.

Exit status 1 when any cell had errors (a failed request, a short response, a server that did
not start, a token counter mismatch); 0 otherwise.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Iterable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, os.path.join(ROOT, "tests"), ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_users import run_bench  # noqa: E402
from server_util import RPCServerProcess, ServerProcess  # noqa: E402

CTX_SLACK = 16            # KV positions per slot beyond npp + ntg
DEFAULT_VOCAB = (300, 1000)
TBF_LATENCY = "50ms"
PROG = "pipeline_cells"
GROUPS_ENV = "PYLLAMA_ARG_PIPELINE_GROUPS"


# ---------------------------------------------------------------------------------------------
# Pure parts: parsing, the schedule, server arguments, aggregation, formatting

def parse_int_list(text: str, name: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; every value >= 1, no duplicates (order kept)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name} '{text}': expected comma-separated integers") from None
    if not values:
        raise ValueError(f"--{name} is empty")
    if any(v < 1 for v in values):
        raise ValueError(f"--{name} '{text}': every value must be at least 1")
    if len(set(values)) != len(values):
        raise ValueError(f"--{name} '{text}': a value is listed twice")
    return values


def parse_orders(text: str) -> list[str]:
    """'CPU,RPC0;RPC0,CPU' -> ['CPU,RPC0', 'RPC0,CPU'] (devices upper-cased, spaces dropped)."""
    orders = []
    for part in text.split(";"):
        devs = [d.strip().upper() for d in part.split(",") if d.strip()]
        if not devs:
            continue
        for d in devs:
            if d not in ("CPU", "RPC0"):
                raise ValueError(f"--orders: device '{d}' (this harness has CPU and one rpc server, RPC0)")
        if len(set(devs)) != len(devs):
            raise ValueError(f"--orders: '{part}' lists a device twice")
        orders.append(",".join(devs))
    if not orders:
        raise ValueError(f"--orders '{text}' is empty")
    if len(set(orders)) != len(orders):
        raise ValueError(f"--orders '{text}': an order is listed twice")
    return orders


def schedule(orders: Iterable[str], groups: Iterable[int], users: Iterable[int], legs: int) -> list[dict]:
    """Every run in execution order: per order, per user count, leg 1 of every groups value, then
    leg 2 of every groups value, ... Each entry: {order, users, leg (1-based), groups}."""
    groups = list(groups)
    runs = []
    for order in orders:
        for u in users:
            for leg in range(1, legs + 1):
                for g in groups:
                    runs.append({"order": order, "users": u, "leg": leg, "groups": g})
    return runs


def slots_for(users: int, groups: int) -> int:
    """-np: the user count rounded up to a multiple of the group count."""
    return -(-users // groups) * groups


def ctx_for(n_slots: int, npp: int, ntg: int) -> int:
    """-c: every slot keeps npp + ntg + CTX_SLACK positions."""
    return n_slots * (npp + ntg + CTX_SLACK)


def split_arg(tensor_split: str, order: str) -> Optional[str]:
    """The -ts value for an order: 'even' -> '1,1,...', 'auto' -> None, else as given."""
    if tensor_split == "auto":
        return None
    if tensor_split == "even":
        return ",".join("1" for _ in order.split(","))
    return tensor_split


def server_args(order: str, endpoint: str, groups: int, users: int, npp: int, ntg: int,
                threads: int, tensor_split: str = "even", extra: Iterable[str] = ()) -> list[str]:
    """The pyllama.server arguments of one cell (after -m MODEL). --pipeline-groups only when
    groups > 1 (one group is the server's default, and a server without the flag still runs the
    groups=1 arm); main() removes PYLLAMA_ARG_PIPELINE_GROUPS so the default really is 1."""
    n_slots = slots_for(users, groups)
    args = ["--device", order, "-np", str(n_slots), "-c", str(ctx_for(n_slots, npp, ntg)),
            "-t", str(threads)]
    if "RPC0" in order.split(","):
        args[:0] = ["--rpc", endpoint]
    ts = split_arg(tensor_split, order)
    if ts is not None and len(order.split(",")) > 1:
        args += ["-ts", ts]
    if groups > 1:
        args += ["--pipeline-groups", str(groups)]
    return args + list(extra)


def _mean(values: Iterable[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def aggregate(legs: list[dict]) -> dict:
    """One cell from its legs (each with gen_tok_s, tpot_ms, ttft_ms_median, ttft_ms_p99, errors,
    short; a value may be None when the leg produced none). tok/s: mean, min, max over the legs
    that have one; TPOT and TTFT: means; errors and short: sums."""
    tok = [lg["gen_tok_s"] for lg in legs if lg.get("gen_tok_s") is not None]
    return {
        "legs": len(legs),
        "tok_s_mean": statistics.fmean(tok) if tok else None,
        "tok_s_min": min(tok) if tok else None,
        "tok_s_max": max(tok) if tok else None,
        "tpot_ms": _mean(lg.get("tpot_ms") for lg in legs),
        "ttft_ms_median": _mean(lg.get("ttft_ms_median") for lg in legs),
        "ttft_ms_p99": _mean(lg.get("ttft_ms_p99") for lg in legs),
        "errors": sum(int(lg.get("errors") or 0) for lg in legs),
        "short": sum(int(lg.get("short") or 0) for lg in legs),
        "failed_legs": sum(1 for lg in legs if lg.get("exit_status", 0) != 0),
    }


def summarize(leg_records: list[dict], orders: list[str], users: list[int], groups: list[int]) -> list[dict]:
    """Cells (order, groups, users) in table order, each aggregate()d over its legs, with `ratio`:
    tok/s mean over that of the groups=1 cell of the same order and users (None without one)."""
    cells = []
    for order in orders:
        for u in users:
            row = []
            for g in groups:
                legs = [r for r in leg_records if r["order"] == order and r["users"] == u and r["groups"] == g]
                row.append({"order": order, "groups": g, "users": u, **aggregate(legs)})
            base = next((c["tok_s_mean"] for c in row if c["groups"] == 1), None)
            for c in row:
                c["ratio"] = (c["tok_s_mean"] / base if base and c["tok_s_mean"] is not None else None)
            cells.extend(row)
    return cells


def best_ratios(cells: list[dict], orders: list[str], groups: int = 2) -> dict[str, Optional[dict]]:
    """Per order, the cell of `groups` groups with the highest ratio: {users, ratio, tok_s_mean}."""
    out: dict[str, Optional[dict]] = {}
    for order in orders:
        cand = [c for c in cells if c["order"] == order and c["groups"] == groups and c["ratio"] is not None]
        best = max(cand, key=lambda c: c["ratio"], default=None)
        out[order] = None if best is None else {"users": best["users"], "ratio": best["ratio"],
                                                "tok_s_mean": best["tok_s_mean"]}
    return out


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(cells: list[dict]) -> str:
    head = ["order", "groups", "users", "tok/s mean [min..max]", "ratio", "TPOT ms", "TTFT med ms",
            "TTFT p99 ms", "errors"]
    rows = []
    for c in cells:
        tok = "-" if c["tok_s_mean"] is None else \
            f"{c['tok_s_mean']:.1f} [{c['tok_s_min']:.1f}..{c['tok_s_max']:.1f}]"
        err = str(c["errors"]) + (f" (+{c['short']} short)" if c.get("short") else "")
        rows.append([c["order"], str(c["groups"]), str(c["users"]), tok,
                     "-" if c["ratio"] is None else f"{c['ratio']:.2f}x",
                     _num(c["tpot_ms"], ".1f"), _num(c["ttft_ms_median"], ".1f"),
                     _num(c["ttft_ms_p99"], ".1f"), err])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    right = {1, 2, 4, 5, 6, 7, 8}

    def line(r: list[str]) -> str:
        return " | ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths)))

    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def format_best(best: dict[str, Optional[dict]], groups: int = 2) -> str:
    lines = []
    for order, b in best.items():
        if b is None:
            lines.append(f"{order}: {groups} groups over 1: not measured")
        else:
            lines.append(f"{order}: {groups} groups over 1: best {b['ratio']:.2f}x at {b['users']} users "
                         f"({b['tok_s_mean']:.1f} tok/s)")
    return "\n".join(lines)


def pick_subnet(pid: int, used: Iterable[int]) -> int:
    """X of 10.231.X.0/30: from the pid, skipping third octets already in use on this machine."""
    used = set(used)
    for i in range(256):
        x = (pid + i) % 256
        if x not in used:
            return x
    raise RuntimeError("every 10.231.X.0/30 subnet is in use")


def tbf_burst(rate: str) -> str:
    """A tbf burst for RATE (tc units: bit, kbit, mbit, gbit, tbit; bps, kbps, ... are bytes/s):
    4 ms of traffic, at least 64 KiB (one GSO packet)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*", rate.lower())
    if not m:
        raise ValueError(f"--rate '{rate}': expected e.g. 10gbit, 500mbit")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    bytes_s = value if m.group(3) == "bps" else value / 8
    if bytes_s <= 0:
        raise ValueError(f"--rate '{rate}': must be positive")
    return str(max(int(bytes_s * 0.004), 65536))


# ---------------------------------------------------------------------------------------------
# Processes

class _Drain:
    """Reads a pipe to its end on a thread (a full pipe would stall the child); keeps the tail."""

    def __init__(self, stream, keep: int = 200) -> None:
        self.lines: list[str] = []
        self.keep = keep
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream) -> None:
        try:
            for line in stream:
                self.lines.append(line)
                if len(self.lines) > 2 * self.keep:
                    del self.lines[:-self.keep]
        except (OSError, ValueError):
            pass

    def tail(self, n: int = 20) -> str:
        return "".join(self.lines[-n:])


class CellServer:
    """A pyllama.server for one cell (tests/server_util.ServerProcess, which drains its output)."""

    live: "set[CellServer]" = set()   # stopped by main()'s cleanup if a signal cut a stop() short

    def __init__(self, model: str, args: list[str], ready_timeout: float) -> None:
        self.sp = ServerProcess(model, *args)
        CellServer.live.add(self)
        try:
            self.sp.wait_ready(timeout=ready_timeout)
        except BaseException:  # a signal while loading must not leave the server behind
            self.stop()
            raise

    @property
    def url(self) -> str:
        return self.sp.url

    def log_tail(self) -> str:
        return self.sp.log_tail()

    def stop(self) -> Optional[int]:
        code = self.sp.stop(timeout=60)
        CellServer.live.discard(self)
        return code


def _run_quiet(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)


class NetnsPeer:
    """An rpc server in its own network namespace behind a rate-limited veth pair."""

    LISTEN = re.compile(r"^listening on (\S+):(\d+)\s*$")

    def __init__(self, rate: str, threads: int) -> None:
        pid = os.getpid()
        self.rate = rate
        self.burst = tbf_burst(rate)
        self.latency = TBF_LATENCY
        self.threads = threads
        self.ns = f"pyllama-peer-{pid}"
        self.host_if, self.peer_if = f"pl{pid}a", f"pl{pid}b"
        self.x = pick_subnet(pid, self._used_subnets())
        self.host_ip, self.peer_ip = f"10.231.{self.x}.1", f"10.231.{self.x}.2"
        self.proc: Optional[subprocess.Popen] = None
        self.drain: Optional[_Drain] = None
        self.endpoint = ""
        self._lock = threading.Lock()
        self._done = False

    @staticmethod
    def _used_subnets() -> set[int]:
        r = _run_quiet(["ip", "-o", "-4", "addr", "show"])
        return {int(m.group(1)) for m in re.finditer(r"\b10\.231\.(\d+)\.\d+/", r.stdout)}

    def _ip(self, *cmd: str) -> None:
        r = _run_quiet(list(cmd))
        if r.returncode != 0:
            raise RuntimeError(f"'{' '.join(cmd)}' failed: {(r.stderr or r.stdout).strip()}")

    def describe(self) -> dict:
        return {"namespace": self.ns, "veth": [self.host_if, self.peer_if],
                "addresses": [f"{self.host_ip}/30", f"{self.peer_ip}/30"], "rate": self.rate,
                "burst_bytes": int(self.burst), "latency": self.latency, "endpoint": self.endpoint}

    def setup(self) -> None:
        tbf = ["root", "tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
        self._ip("ip", "netns", "add", self.ns)
        self._ip("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if)
        self._ip("ip", "link", "set", self.peer_if, "netns", self.ns)
        self._ip("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        self._ip("ip", "link", "set", self.host_if, "up")
        self._ip("ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.peer_ip}/30", "dev", self.peer_if)
        self._ip("ip", "netns", "exec", self.ns, "ip", "link", "set", self.peer_if, "up")
        self._ip("ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
        self._ip("tc", "qdisc", "add", "dev", self.host_if, *tbf)
        self._ip("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.peer_if, *tbf)

    def start_rpc(self, timeout: float = 60) -> str:
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = ["ip", "netns", "exec", self.ns, sys.executable, "-m", "pyllama.rpc_server",
               "--host", self.peer_ip, "--port", "0", "-t", str(self.threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        log: list[str] = []
        result: dict = {}

        def read() -> None:
            for line in self.proc.stderr:
                log.append(line)
                m = self.LISTEN.match(line.strip())
                if m:
                    result["port"] = int(m.group(2))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if "port" not in result:
            raise RuntimeError("rpc_server in the namespace did not start: " + "".join(log[-10:]).strip())
        self.drain = _Drain(self.proc.stderr)
        self.endpoint = f"{self.peer_ip}:{result['port']}"
        return self.endpoint

    def teardown(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # deleting the namespace destroys the end inside it, which takes the pair with it
        _run_quiet(["ip", "netns", "del", self.ns])
        if _run_quiet(["ip", "link", "show", self.host_if]).returncode == 0:
            _run_quiet(["ip", "link", "del", self.host_if])


def _on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def install_signal_handlers() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        try:
            signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # not the main thread
            pass


def ignore_signals() -> None:
    """While tearing down: a second ^C must not interrupt the cleanup."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (ValueError, OSError):
            pass


def restore_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (ValueError, OSError):
            pass
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except (ValueError, OSError):
        pass


# ---------------------------------------------------------------------------------------------
# The run

def model_path(preset: str) -> str:
    from pyllama.models.make import make_model  # noqa: PLC0415

    out = os.path.join(HERE, "out", "models")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{preset}-f32.gguf")
    if not os.path.exists(path):
        tmp = os.path.join(out, f".{preset}-f32.{os.getpid()}.tmp.gguf")
        try:
            make_model(preset, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def prompt_vocab(model: str) -> tuple[int, int]:
    """bench_users' default prompt token range, clamped to the model's vocabulary."""
    from pyllama.models.gguf_file import read_metadata  # noqa: PLC0415

    md = read_metadata(model)
    n_vocab = len(md.get("tokenizer.ggml.tokens") or [])
    if not n_vocab:
        arch = md.get("general.architecture", "llama")
        n_vocab = int(md.get(f"{arch}.vocab_size") or DEFAULT_VOCAB[1])
    lo, hi = DEFAULT_VOCAB
    hi = min(hi, n_vocab)
    if hi <= lo:
        lo = 0
    return lo, hi


def run_cell(model: str, endpoint: str, run: dict, a, vocab: tuple[int, int], log) -> dict:
    """Start the cell's server, bench it, stop it. Never raises for a server that fails."""
    args = server_args(run["order"], endpoint, run["groups"], run["users"], a.npp, a.ntg, a.threads,
                       a.tensor_split, shlex.split(a.server_args))
    rec = {**run, "np": slots_for(run["users"], run["groups"]),
           "ctx": ctx_for(slots_for(run["users"], run["groups"]), a.npp, a.ntg),
           "server_args": ["-m", model, *args], "start_error": None, "server_exit": None,
           "gen_tok_s": None, "tpot_ms": None, "ttft_ms_median": None, "ttft_ms_p99": None,
           "errors": 0, "short": 0, "exit_status": 0, "failures": [], "bench": None}
    t0 = time.monotonic()
    try:
        server = CellServer(model, args, a.ready_timeout)
    except Exception as e:  # noqa: BLE001 - a server that does not start is a failed cell
        msg = str(e).strip().splitlines()
        rec["start_error"] = " ".join(msg[-3:]) if msg else type(e).__name__
        rec["errors"] = run["users"] * a.requests
        rec["exit_status"] = 1
        rec["failures"] = [f"server did not start: {rec['start_error']}"]
        log(f"  server did not start: {rec['start_error']}")
        return rec
    rec["ready_s"] = round(time.monotonic() - t0, 3)
    try:
        rep = run_bench(server.url, run["users"], a.requests, a.npp, a.ntg, warmup=a.warmup,
                        timeout=a.timeout, seed=a.seed, vocab=vocab)
    finally:
        rec["server_exit"] = server.stop()
    rec["bench"] = rep
    for k in ("gen_tok_s", "tpot_ms", "ttft_ms_median", "ttft_ms_p99", "errors", "short", "exit_status",
              "failures"):
        rec[k] = rep[k]
    rec["server_log_tail"] = server.log_tail()
    return rec


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pipeline_cells.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=None)
    ap.add_argument("--preset", default="medium", help="test model preset (made once under bench/out/models)")
    ap.add_argument("--model", metavar="PATH", help="GGUF model (overrides --preset)")
    ap.add_argument("--orders", default="CPU,RPC0;RPC0,CPU", help="device orders, ';'-separated")
    ap.add_argument("--groups", default="1,2,3,4", help="pipeline group counts")
    ap.add_argument("--users", default="32,64,128", help="concurrent user counts")
    ap.add_argument("--legs", type=int, default=3, help="legs (repeats) per arm, interleaved")
    ap.add_argument("--npp", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--ntg", type=int, default=64, help="generated tokens per request")
    ap.add_argument("-r", "--requests", type=int, default=1, help="measured requests per user")
    ap.add_argument("-t", "--threads", type=int, default=1, help="compute threads of the server and the rpc server")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted requests per user before the window")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt token ids")
    ap.add_argument("--timeout", type=float, default=600, help="HTTP socket timeout per operation, seconds")
    ap.add_argument("--ready-timeout", type=float, default=600, help="seconds a server may take to load")
    ap.add_argument("--tensor-split", default="even", help="even: -ts 1,1 (a fixed layer boundary); auto: no -ts (by free memory); "
                         "or proportions a,b passed as they are")
    ap.add_argument("--server-args", default="", metavar="'ARGS'",
                    help="more pyllama.server arguments for every cell, e.g. '--kv-unified'")
    ap.add_argument("--netns", action="store_true", help="rpc server in its own network namespace (root)")
    ap.add_argument("--rate", default="10gbit", help="tbf rate of the veth pair with --netns")
    ap.add_argument("--json", metavar="OUT", help="write everything, every leg included, as JSON")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        orders = parse_orders(a.orders)
        groups = parse_int_list(a.groups, "groups")
        users = parse_int_list(a.users, "users")
        if a.legs < 1 or a.npp < 1 or a.ntg < 1 or a.requests < 1 or a.threads < 0 or a.warmup < 0:
            raise ValueError("--legs, --npp, --ntg and -r must be at least 1; -t and --warmup at least 0")
        shlex.split(a.server_args)
        if a.netns:
            tbf_burst(a.rate)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    if a.netns:
        if os.geteuid() != 0:
            print(f"{PROG}: --netns needs root (it creates a network namespace, a veth pair and tc qdiscs); "
                  "run as root or drop --netns", file=sys.stderr)
            return 1
        import shutil  # noqa: PLC0415
        missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
        if missing:
            print(f"{PROG}: --netns needs {' and '.join(missing)} (iproute2)", file=sys.stderr)
            return 1

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    model = a.model
    if model:
        if not os.path.isfile(model):
            print(f"{PROG}: --model {model}: no such file", file=sys.stderr)
            return 1
    else:
        try:
            model = model_path(a.preset)
        except ValueError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 1
    vocab = prompt_vocab(model)
    runs = schedule(orders, groups, users, a.legs)
    if os.environ.pop(GROUPS_ENV, None) is not None:
        log(f"ignoring {GROUPS_ENV} from the environment: every cell sets its own group count")

    install_signal_handlers()
    peer: Optional[NetnsPeer] = None
    rpc: Optional[RPCServerProcess] = None
    records: list[dict] = []
    t_start = time.time()

    def cleanup() -> None:
        ignore_signals()
        for server in list(CellServer.live):
            server.stop()
        if rpc is not None:
            rpc.stop()
        if peer is not None:
            peer.teardown()
        restore_signals()

    try:
        if a.netns:
            peer = NetnsPeer(a.rate, a.threads)
            atexit.register(peer.teardown)
            try:
                peer.setup()
                endpoint = peer.start_rpc()
            except RuntimeError as e:
                print(f"{PROG}: --netns: {e}", file=sys.stderr)
                return 1
            log(f"rpc server in namespace {peer.ns} at {endpoint}, veth {peer.host_if}/{peer.peer_if} "
                f"tbf {a.rate}")
        else:
            rpc = RPCServerProcess("-t", str(a.threads))
            atexit.register(rpc.stop)
            endpoint = rpc.endpoint
            log(f"rpc server at {endpoint}")
        log(f"model {model}; {len(runs)} runs: orders {orders}, groups {groups}, users {users}, "
            f"{a.legs} legs, npp {a.npp}, ntg {a.ntg}, -r {a.requests}, -t {a.threads}")
        for i, run in enumerate(runs, 1):
            log(f"[{i}/{len(runs)}] {run['order']} groups {run['groups']} users {run['users']} leg {run['leg']}")
            rec = run_cell(model, endpoint, run, a, vocab, log)
            records.append(rec)
            if rec["start_error"] is None:
                log(f"  {_num(rec['gen_tok_s'], '.1f')} tok/s, TPOT {_num(rec['tpot_ms'], '.1f')} ms, "
                    f"TTFT median {_num(rec['ttft_ms_median'], '.1f')} ms, errors {rec['errors']}"
                    + ("" if rec["exit_status"] == 0 else "  FAIL: " + "; ".join(rec["failures"])))
    finally:
        cleanup()

    cells = summarize(records, orders, users, groups)
    best = best_ratios(cells, orders, 2)
    print(f"pipeline cells: {os.path.basename(model)}, npp {a.npp}, ntg {a.ntg}, -r {a.requests}, "
          f"-t {a.threads}, {a.legs} legs per arm, rpc "
          + (f"in netns behind tbf {a.rate}" if a.netns else "on loopback"))
    print(format_table(cells))
    print()
    print(format_best(best, 2))
    failed = [r for r in records if r["exit_status"] != 0 or r["errors"]]
    for r in failed[:10]:
        print(f"FAIL {r['order']} groups {r['groups']} users {r['users']} leg {r['leg']}: "
              + "; ".join(r["failures"] or [f"{r['errors']} errors"]))
    status = 1 if failed else 0
    if a.json:
        doc = {
            "config": {k: getattr(a, k) for k in vars(a)}, "model": model, "prompt_vocab": list(vocab),
            "orders": orders, "groups": groups, "users": users, "rpc_endpoint": endpoint,
            "netns": peer.describe() if peer is not None else None,
            "started": t_start, "wall_s": round(time.time() - t_start, 3),
            "schedule": runs, "legs": records, "cells": cells,
            "best_2_over_1": best, "exit_status": status,
        }
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
            fh.write("\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
