"""Pipeline-group cells: one model split over a local CPU and rpc servers, 1..N groups side by side.

    python bench/pipeline_cells.py [--preset medium | --model PATH] [--orders 'CPU,RPC0;RPC0,CPU']
        [--groups 1,2,3,4] [--users 32,64,128] [--legs 3] [--npp 64] [--ntg 64] [-r 3] [-t 1]
        [--warmup 1] [--tensor-split even|auto|a,b] [--server-args '--kv-unified']
        [--types f32,q4_k_m] [--unsplit-threads 1,2] [--unsplit-groups 2] [--peers DIR [--llama-ngl N]]
        [--trace DIR] [--prio N] [--link DELAY_MS/RATE ... | --links 0/none,2/1gbit]
        [--netns [--rate 10gbit]] [--json OUT]

One rpc server (`python -m pyllama.rpc_server -t T`) per RPC<i> the orders name lives for the
whole run: an order names CPU and RPC0, or for a 3-stage split two rpc servers (`--orders
'RPC0,RPC1,CPU'`; an order that names RPC<i> names every RPC<j> below it). A cell is (device order,
groups, users); for each cell a fresh `python -m pyllama.server` is started with

    -m MODEL --rpc EP0[,EP1] --device ORDER -np NP -c NP*(npp+ntg+16) -t T -ts ... [--pipeline-groups G]

where NP is the user count rounded up to a multiple of G (`--pipeline-groups` is passed only when
G > 1: one group is the server's default). bench_users.run_bench drives it with that many
closed-loop users, then the server is stopped.

An arm is (order, groups), or (order, link, groups) with --link. For each user count the arms are
interleaved: leg 1 of every arm, then leg 2 of every arm, ..., so drifting machine noise is spread
over all arms. Per cell the table gives generated tokens/s (mean over legs and min..max), the ratio of that
mean to the groups=1 arm of the same order (and link) and users, and TPOT, TTFT median and p99 (means over
legs) and errors (sum). Then, per order, the best ratio of 2 groups over 1 and the user count it
was reached at. --json OUT writes the configuration, every leg (with bench_users' full report)
and every cell.

--tensor-split: `even` (default) passes equal proportions per device (1,1 or 1,1,1) so the layer
boundaries are the same in every cell; `auto` passes nothing (the server then splits by free memory, or by
measured speed with PYLLAMA_SPLIT_PROBE=1, docs/pipeline-groups.md); anything else is passed to -ts as
is, and must then have one value per device of every order.

--netns: the rpc server runs in its own network namespace (pyllama-peer-<pid>) behind a veth pair
(pl<pid>a here, 10.231.X.1/30; pl<pid>b there, 10.231.X.2/30) shaped by a tbf qdisc at --rate
on both ends, so the split crosses a link of known bandwidth rather than loopback; RPC1's namespace
and pair are pyllama-peer-<pid>-1 and pl<pid>a1/pl<pid>b1, on a subnet of their own. Needs root
(ip, tc). The namespaces and the veth pairs are always removed at exit.

--link DELAY_MS/RATE (given several times, or comma-separated: `--links 0/none,2/1gbit`): one more
split arm per value, for every order and groups value, whose server reaches each rpc server
through bench/link_shaper.py, a TCP relay that delays each direction by DELAY_MS and caps it at
RATE (tc units, e.g. 10gbit, 500mbit; none: no cap), for kernels without `tc netem`. One relay
process per link and rpc server lives for the whole run; the loopback arms stay as they were, and
the link arms interleave with them in every leg (named e.g. `pyllama split RPC0,CPU 2 groups link
2ms/1gbit`). The table then has a `link` column and its groups=1 ratio is taken within each link;
the best 2-over-1 is given per order and link; the ratios add, per link, 2 groups / 1 group and,
at every groups value, the split over the link / the same split on loopback. `0/none` is the
relay's own cost. With --netns the relays reach the rpc servers in their namespaces (the tbf rate
of the veth pair, then the relay's delay and rate). At --prio 1..3 the relays run one SCHED_FIFO
step above pyllama's threads (`chrt`): they stand for the network, which compute threads do not
hold up. Each link leg's thread counters include its relays' (`link`, `link1`).

More arms in the same legs (interleaved with the split cells):
- `--unsplit-threads 1,2`: pyllama.server in one process, no rpc, `-t` each value (the -t 2 / -t 1
  scaling, and the unsplit -t 2 that a 2-device split with 1 thread each is compared with);
- `--unsplit-groups 2`: pyllama.server in one process with 2 pipeline groups of `-t` threads each on
  the one CPU device (each group's host work overlaps the other's kernels);
- `--peers DIR` (or $PYLLAMA_PEERS; DIR/bin holds llama.cpp's programs): llama.cpp's split, one
  `ggml-rpc-server -t T` for the whole run and per cell `llama-server --rpc HOST:PORT -ngl N -t T`
  with the same blocks per process as pyllama's split (`--llama-ngl` to set N), and llama-server
  unsplit at each --unsplit-threads value. llama-server answers HTTP 500 on a share of requests
  against random-weight models: those cells count completed requests only (errors are reported,
  not failures). llama.cpp's split is compared with the 2-stage orders of CPU and RPC0 only: an
  order of more stages gets no llama.cpp arm (a note says so).
- `--types f32,q4_k_m`: every arm on each weight type (--preset models made by pyllama.models.make).
- `--trace DIR`: the split cells' server and each rpc server write traces (DIR/rpc-server.jsonl,
  DIR/rpc-server-RPC1.jsonl, ...); each split leg gets the devices' busy shares from
  `trace_tools/merge.py --summary` over its server's trace and those of the rpc servers its order
  names.
- `--prio N`: every pyllama server and rpc server with `--prio N` (thread priority, docs/server.md),
  llama-server with its own `--prio N`, ggml-rpc-server (which has no such flag) under `chrt` at
  the same level.
With any of these (or --link), a second table lists every cell (mean [min..max] over legs, completed/sent,
how often per second the compute threads of pyllama's processes (the server, each rpc server the
order names) were preempted in the measured
window (Linux; `bench/thread_stats.py`, the time-slicing `--prio` removes), the machine's cores
idle and stolen by the hypervisor over that window (/proc/stat: idle is the time no process wanted
a core, what a split's chain leaves unused), busy %), then the
ratios the scaling targets name (`docs/pipeline-groups.md`): -t2/-t1, 2 groups / 1 group, 2 groups / unsplit,
pyllama split / llama.cpp split (ratio of the means, [min..max] of the per-leg ratios).

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
from typing import Iterable, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # a checkout without an install
    sys.path.insert(0, ROOT)

from bench_users import run_bench  # noqa: E402
from link_shaper import LinkShaperProcess, link_name, parse_link  # noqa: E402
import thread_stats  # noqa: E402
from server_util import RPCServerProcess, ServerProcess  # noqa: E402

from pyllama.util.priority import LEVELS, LEVELS_HELP, policy_for  # noqa: E402

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


_RPC_DEVICE = re.compile(r"RPC(\d+)")


def rpc_indices(order: str) -> list[int]:
    """The rpc servers an order names, in its order: 'RPC1,RPC0,CPU' -> [1, 0]."""
    return [int(m.group(1)) for d in order.split(",") if (m := _RPC_DEVICE.fullmatch(d.strip()))]


def rpc_count(orders: Iterable[str]) -> int:
    """How many rpc servers the widest order needs (one per RPC<i>): 0 when none names one."""
    return max((max(rpc_indices(o), default=-1) + 1 for o in orders), default=0)


def rpc_arg(endpoints: Sequence[str], order: str) -> str:
    """The --rpc value of a cell of `order`: the endpoints of RPC0 .. the highest RPC<i> it names."""
    return ",".join(endpoints[:max(rpc_indices(order), default=-1) + 1])


def parse_orders(text: str) -> list[str]:
    """'CPU,RPC0;RPC0,CPU' -> ['CPU,RPC0', 'RPC0,CPU'] (devices upper-cased, spaces dropped). An
    order names CPU and rpc servers RPC0, RPC1, ... (one rpc server process each); one that names
    RPC<i> names every RPC<j> below it too, e.g. 'RPC0,RPC1,CPU' for a 3-stage split."""
    orders = []
    for part in text.split(";"):
        devs = [d.strip().upper() for d in part.split(",") if d.strip()]
        if not devs:
            continue
        for d in devs:
            if d != "CPU" and not _RPC_DEVICE.fullmatch(d):
                raise ValueError(f"--orders: device '{d}' (this harness has CPU and rpc servers RPC0, RPC1, ...)")
        if len(set(devs)) != len(devs):
            raise ValueError(f"--orders: '{part}' lists a device twice")
        order = ",".join(devs)
        idx = rpc_indices(order)
        if sorted(idx) != list(range(len(idx))):
            missing = min(set(range(max(idx) + 1)) - set(idx))
            raise ValueError(f"--orders: '{part}' names RPC{max(idx)} but not RPC{missing} "
                             "(an order's rpc servers are RPC0, RPC1, ... in turn)")
        orders.append(order)
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
    """The -ts value for an order: 'even' -> '1,1,...' (one per device), 'auto' -> None, else as given."""
    if tensor_split == "auto":
        return None
    if tensor_split == "even":
        return ",".join("1" for _ in order.split(","))
    return tensor_split


def check_tensor_split(tensor_split: str, orders: Iterable[str]) -> None:
    """Proportions given as they are must have one value per device of every split order."""
    if tensor_split in ("even", "auto"):
        return
    n = len(tensor_split.split(","))
    for o in orders:
        if len(o.split(",")) > 1 and len(o.split(",")) != n:
            raise ValueError(f"--tensor-split '{tensor_split}' has {n} values for the {len(o.split(','))} devices "
                             f"of {o} (even gives each order one per device)")


# Every request of the load has a prompt of its own (bench_users), so a prompt cache in host
# memory (on by default in both servers) would only copy out prompts that never come back: off in
# both, so that the cells measure the pipeline.
NO_PROMPT_CACHE = ["--cache-ram", "0"]


def server_args(order: str, endpoint: str, groups: int, users: int, npp: int, ntg: int,
                threads: int, tensor_split: str = "even", extra: Iterable[str] = ()) -> list[str]:
    """The pyllama.server arguments of one cell (after -m MODEL); `endpoint` is the --rpc value (the
    rpc servers' endpoints, comma-separated, `rpc_arg`). --pipeline-groups only when
    groups > 1 (one group is the server's default, and a server without the flag still runs the
    groups=1 arm); main() removes PYLLAMA_ARG_PIPELINE_GROUPS so the default really is 1."""
    n_slots = slots_for(users, groups)
    args = ["--device", order, "-np", str(n_slots), "-c", str(ctx_for(n_slots, npp, ntg)),
            "-t", str(threads), *NO_PROMPT_CACHE]
    if rpc_indices(order):
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


def summarize(leg_records: list[dict], orders: list[str], users: list[int], groups: list[int],
              links: Sequence[str] = ()) -> list[dict]:
    """Cells (order, link, groups, users) in table order, each aggregate()d over its legs, with
    `ratio`: tok/s mean over that of the groups=1 cell of the same order, link and users (None
    without one). `link` is None for loopback, else a --link arm's name; loopback comes first."""
    cells = []
    for order in orders:
        for link in [None, *(links if rpc_indices(order) else ())]:
            for u in users:
                row = []
                for g in groups:
                    legs = [r for r in leg_records if r["order"] == order and r["users"] == u and r["groups"] == g
                            and r.get("link") == link]
                    row.append({"order": order, "link": link, "groups": g, "users": u, **aggregate(legs)})
                base = next((c["tok_s_mean"] for c in row if c["groups"] == 1), None)
                for c in row:
                    c["ratio"] = (c["tok_s_mean"] / base if base and c["tok_s_mean"] is not None else None)
                cells.extend(row)
    return cells


def best_ratios(cells: list[dict], orders: list[str], groups: int = 2) -> dict[str, Optional[dict]]:
    """Per order (and per order and link, as 'ORDER link NAME', where cells have a link), the cell
    of `groups` groups with the highest ratio: {users, ratio, tok_s_mean}."""
    out: dict[str, Optional[dict]] = {}
    links = list(dict.fromkeys(c.get("link") for c in cells if c.get("link")))
    for order in orders:
        for link in [None, *links]:
            cand = [c for c in cells if c["order"] == order and c.get("link") == link and c["groups"] == groups
                    and c["ratio"] is not None]
            best = max(cand, key=lambda c: c["ratio"], default=None)
            key = order if link is None else f"{order} link {link}"
            out[key] = None if best is None else {"users": best["users"], "ratio": best["ratio"],
                                                  "tok_s_mean": best["tok_s_mean"]}
    return out


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(cells: list[dict]) -> str:
    """The split cells' table; a `link` column (loopback, or the --link arm's name) when any cell
    went over a shaped link."""
    with_link = any(c.get("link") for c in cells)
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
    right = {1, 2, 4, 5, 6, 7, 8}
    if with_link:
        head.insert(1, "link")
        for r, c in zip(rows, cells):
            r.insert(1, c.get("link") or "loopback")
        right = {i + 1 for i in right}
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]

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


# --- the other cells: pyllama unsplit, llama.cpp unsplit and split --------------------------------

SPLIT, UNSPLIT, LLAMA_SPLIT, LLAMA_UNSPLIT = "split", "unsplit", "llama-split", "llama-unsplit"
KIND_LABEL = {SPLIT: "pyllama split", UNSPLIT: "pyllama", LLAMA_SPLIT: "llama.cpp split", LLAMA_UNSPLIT: "llama.cpp"}
LLAMA_NOTE = ("llama.cpp cells count completed requests only: llama-server answers HTTP 500 on a share of "
              "requests against random-weight models")


def parse_types(text: str) -> list[str]:
    """'f32,q4_k_m' -> ['f32', 'q4_k_m']: weight types pyllama.models.make writes."""
    from pyllama.models.make import WTYPES  # noqa: PLC0415

    types = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not types:
        raise ValueError(f"--types '{text}' is empty")
    for t in types:
        if t not in WTYPES:
            raise ValueError(f"--types: unknown weight type '{t}' (choose from {', '.join(WTYPES)})")
    if len(set(types)) != len(types):
        raise ValueError(f"--types '{text}': a type is listed twice")
    return types


PINNED = {"name": "pinned", "delay_ms": 0.0, "rate_bit_s": None, "pinned": True}


def pin_peers(pids: Sequence[int], pinned: bool) -> None:
    """Each rpc server (every thread of it, those it starts later inherit the mask) on CPU 1 + its
    index, or back on every CPU of the machine."""
    n_cpu = os.cpu_count() or 1
    for i, pid in enumerate(pids):
        cpus = str((1 + i) % n_cpu) if pinned else f"0-{n_cpu - 1}"
        subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)


def parse_links(values: Optional[Iterable[str]]) -> list[dict]:
    """--link values (each DELAY_MS/RATE, or several comma-separated) -> [{name, delay_ms,
    rate_bit_s}] in the order given: '2/1gbit' -> name '2ms/1gbit'; 'none' as the rate: no cap."""
    links: list[dict] = []
    for value in values or ():
        for part in value.split(","):
            if not part.strip():
                continue
            try:
                delay, rate = parse_link(part)
            except ValueError as e:
                raise ValueError(f"--link: {e}") from None
            name = link_name(delay, rate)
            if any(lk["name"] == name for lk in links):
                raise ValueError(f"--link: {name} is listed twice")
            links.append({"name": name, "delay_ms": delay, "rate_bit_s": rate})
    return links


def relay_prefix(prio: int) -> list[str]:
    """The `chrt` command the link relays start under: at --prio 1..3 (SCHED_FIFO) one step above
    pyllama's threads, so that a relay (which stands for the network, not a program sharing the
    cores) hands bytes on as they come instead of waiting for a compute thread to block; otherwise
    nothing."""
    target = policy_for(prio)
    if target is None or target[0] != os.SCHED_FIFO:
        return []
    return ["chrt", "-f", str(target[1] + 1)]


def parse_thread_list(text: str, name: str) -> list[int]:
    """'1,2' -> [1, 2]; 'none' or '' -> []."""
    if text.strip().lower() in ("", "none"):
        return []
    return parse_int_list(text, name)


def make_arms(orders: list[str], groups: list[int], unsplit_threads: list[int], llama: bool,
              unsplit_groups: Iterable[int] = (), split_threads: int = 1, links: Sequence[str] = ()) -> list[dict]:
    """Every arm of a leg: the pyllama split cells (order x groups on loopback, then order x groups
    over each --link, by its name), pyllama unsplit at each thread
    count (and, per --unsplit-groups, unsplit with that many pipeline groups of the split's
    threads each: one device, the groups overlapping each other's host work), and with
    llama.cpp's programs its split (ggml-rpc-server + llama-server) and its unsplit server at each
    thread count."""
    arms: list[dict] = [{"kind": SPLIT, "order": o, "groups": g, **({"link": link} if link else {})}
                        for o in orders for link in [None, *(links if rpc_indices(o) else ())] for g in groups]
    arms += [{"kind": UNSPLIT, "threads": t} for t in unsplit_threads]
    arms += [{"kind": UNSPLIT, "threads": split_threads, "groups": g} for g in unsplit_groups if g > 1]
    if llama:
        arms.append({"kind": LLAMA_SPLIT})
        arms += [{"kind": LLAMA_UNSPLIT, "threads": t} for t in unsplit_threads]
    return arms


def full_schedule(types: list[str], arms: list[dict], users: Iterable[int], legs: int) -> list[dict]:
    """Every run in execution order: per weight type, per user count, leg 1 of every arm, then
    leg 2 of every arm, ... (so machine drift spreads over all arms alike)."""
    users = list(users)
    return [{**arm, "type": t, "users": u, "leg": leg}
            for t in types for u in users for leg in range(1, legs + 1) for arm in arms]


def unsplit_args(users: int, npp: int, ntg: int, threads: int, extra: Iterable[str] = (), groups: int = 1) -> list[str]:
    """pyllama.server in one process on the CPU: no rpc, -t threads, `groups` pipeline groups."""
    n_slots = slots_for(users, groups)
    args = ["-np", str(n_slots), "-c", str(ctx_for(n_slots, npp, ntg)), "-t", str(threads), *NO_PROMPT_CACHE]
    if groups > 1:
        args += ["--pipeline-groups", str(groups)]
    return args + list(extra)


def llama_args(users: int, npp: int, ntg: int, threads: int, endpoint: Optional[str] = None,
               ngl: Optional[int] = None) -> list[str]:
    """llama-server's arguments (after -m, --host, --port): unsplit, or with --rpc ENDPOINT -ngl N
    (the output layer and the last N-1 blocks on the rpc server, see `llama_ngl`)."""
    args = ["-np", str(users), "-c", str(ctx_for(users, npp, ntg)), "-t", str(threads), "-tb", str(threads),
            *NO_PROMPT_CACHE]
    if endpoint is not None:
        args += ["--rpc", endpoint, "-ngl", str(ngl if ngl is not None else 0)]
    return args


def prio_args(prio: int) -> list[str]:
    """`--prio N` for pyllama's programs and llama-server; nothing at the default level."""
    return ["--prio", str(prio)] if prio else []


def chrt_prefix(prio: int) -> list[str]:
    """The `chrt` command that starts ggml-rpc-server at pyllama's --prio level (it has no such
    flag; llama-server takes its own --prio)."""
    target = policy_for(prio)
    if target is None:
        return []
    policy, static = target
    return ["chrt", "-b" if policy == os.SCHED_BATCH else "-f", str(static)]


def split_blocks(n_layer: int, tensor_split: str, order: str) -> Optional[int]:
    """Blocks the last device (the one with the output layer) holds in a pyllama split cell of
    `order` under --tensor-split; None for auto (the server chose: `blocks_from_log` reads it)."""
    from pyllama.models.weights import split_layers  # noqa: PLC0415

    ts = split_arg(tensor_split, order)
    devs = order.split(",")
    if ts is None or len(devs) < 2:
        return None
    props = [float(x) for x in ts.split(",")]
    return split_layers(n_layer, props).count(len(devs) - 1)


_LAYERS = re.compile(r"layers: (.+?)\s*$", re.M)


def blocks_from_log(text: str) -> Optional[int]:
    """Blocks of the device with the output layer, from a pyllama server's load line
    ('layers: RPC0 0-6, CPU 7-11 + output' -> 5); None without such a line."""
    m = _LAYERS.findall(text)
    if not m:
        return None
    for part in m[-1].split(","):
        words = part.split()
        if len(words) >= 2 and "output" in words[2:]:
            if words[1] == "none":
                return 0
            lo, _, hi = words[1].partition("-")
            if lo.isdigit() and hi.isdigit():
                return int(hi) - int(lo) + 1
    return None


def llama_ngl(last_blocks: int) -> int:
    """llama-server's -ngl for a split with the same work per process as pyllama's: llama.cpp
    offloads the output layer first, then blocks from the last one down, so the rpc side takes
    the output layer and `last_blocks` blocks (the part pyllama's last device has) and the local
    CPU the first blocks (pyllama's first device's part). For the order CPU,RPC0 the placement is
    the same; for RPC0,CPU the same blocks run on the other process."""
    return last_blocks + 1


def parse_busy(summary: str) -> dict[str, float]:
    """Busy % per device from `trace_tools/merge.py --summary` (its device table: name, busy, idle,
    other busy, none busy, idle%, transfer); {} when the text has no such table."""
    out: dict[str, float] = {}
    lines = summary.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.split()[:2] == ["device", "busy"]), None)
    if start is None:
        return out
    for ln in lines[start + 1:]:
        w = ln.split()
        if len(w) < 7 or not w[5].endswith("%"):
            break
        try:
            out[w[0]] = round(100.0 - float(w[5].rstrip("%")), 1)
        except ValueError:
            break
    return out


def arm_key(r: dict) -> tuple:
    """What identifies an arm within a (type, users) block."""
    k = r["kind"]
    if k == SPLIT:
        return (k, r["order"], r["groups"]) + ((r["link"],) if r.get("link") else ())
    if k == UNSPLIT and r.get("groups", 1) > 1:
        return (k, r["threads"], r["groups"])
    if k in (UNSPLIT, LLAMA_UNSPLIT):
        return (k, r["threads"])
    return (k,)


def arm_label(key: tuple) -> str:
    k = key[0]
    if k == SPLIT:
        return (f"{KIND_LABEL[k]} {key[1]} {key[2]} group{'s' if key[2] > 1 else ''}"
                + (f" link {key[3]}" if len(key) > 3 else ""))
    if k == UNSPLIT and len(key) > 2:
        return f"{KIND_LABEL[k]} -t {key[1]} {key[2]} groups"
    if k in (UNSPLIT, LLAMA_UNSPLIT):
        return f"{KIND_LABEL[k]} -t {key[1]}"
    return KIND_LABEL[k]


def all_cells(records: list[dict]) -> list[dict]:
    """One cell per (type, users, arm), in first-run order, each aggregate()d over its legs, with
    the mean busy % per device of the legs that were traced."""
    keys: list[tuple] = []
    for r in records:
        k = (r["type"], r["users"], arm_key(r))
        if k not in keys:
            keys.append(k)
    cells = []
    for t, u, ak in keys:
        legs = [r for r in records if r["type"] == t and r["users"] == u and arm_key(r) == ak]
        cell = {"type": t, "users": u, "arm": arm_label(ak), "key": list(ak), **aggregate(legs)}
        cell["completed"] = sum(int((r.get("bench") or {}).get("requests_done") or 0) for r in legs)
        cell["requests"] = sum(int((r.get("bench") or {}).get("requests") or 0) for r in legs)
        busy: dict[str, list[float]] = {}
        for r in legs:
            for dev, pct in (r.get("busy_pct") or {}).items():
                busy.setdefault(dev, []).append(pct)
        cell["busy_pct"] = {d: round(statistics.fmean(v), 1) for d, v in busy.items()}
        rates = [x for x in (preempt_rate(r.get("thread_stats")) for r in legs) if x is not None]
        cell["preempted_per_s"] = round(statistics.fmean(rates), 1) if rates else None
        for share in ("idle", "stolen"):
            got = [r["machine_pct"][share] for r in legs if r.get("machine_pct")]
            cell[f"{share}_pct"] = round(statistics.fmean(got), 1) if got else None
        cells.append(cell)
    return cells


def paired_ratio(records: list[dict], t: str, users: int, num: tuple, den: tuple) -> Optional[dict]:
    """tok/s of arm `num` over arm `den` (same type and users): the ratio of the means, and the
    min..max of the per-leg ratios (legs are interleaved, so leg i of both ran side by side)."""
    def by_leg(key: tuple) -> dict[int, float]:
        return {r["leg"]: r["gen_tok_s"] for r in records
                if r["type"] == t and r["users"] == users and arm_key(r) == key and r.get("gen_tok_s")}
    a, b = by_leg(num), by_leg(den)
    if not a or not b:
        return None
    legs = sorted(set(a) & set(b))
    per_leg = [a[i] / b[i] for i in legs]
    return {"ratio": statistics.fmean(a.values()) / statistics.fmean(b.values()),
            "min": min(per_leg) if per_leg else None, "max": max(per_leg) if per_leg else None,
            "legs": len(per_leg)}


def target_ratios(records: list[dict], types: list[str], users: list[int], orders: list[str],
                 groups: list[int], threads: list[int], split_threads: int,
                 unsplit_groups: Iterable[int] = (), links: Sequence[str] = ()) -> list[dict]:
    """The ratios the targets name, per weight type and user count, where both arms ran:
    pyllama -t2/-t1 (and llama.cpp's, the ceiling two threads give here), 2 groups / 1 group,
    2 groups / pyllama unsplit at the split's total threads, pyllama 2 groups / llama.cpp split;
    and per --link arm (by name) its 2 groups / 1 group and, at every groups value, the split
    over that link / the same split on loopback."""
    rows = []
    hi_t = max(threads) if threads else None
    lo_t = min(threads) if threads else None
    g2 = 2 if 2 in groups else (max(groups) if groups else None)
    for t in types:
        for u in users:
            pairs: list[tuple[str, tuple, tuple]] = []
            for ug in (g for g in unsplit_groups if g > 1):
                pairs.append((f"pyllama -t {split_threads} {ug} groups / -t {split_threads}",
                              (UNSPLIT, split_threads, ug), (UNSPLIT, split_threads)))
                if hi_t is not None:
                    pairs.append((f"pyllama -t {split_threads} {ug} groups / -t {hi_t}",
                                  (UNSPLIT, split_threads, ug), (UNSPLIT, hi_t)))
            if hi_t is not None and lo_t is not None and hi_t != lo_t:
                pairs.append((f"pyllama -t {hi_t} / -t {lo_t}", (UNSPLIT, hi_t), (UNSPLIT, lo_t)))
                pairs.append((f"llama.cpp -t {hi_t} / -t {lo_t}", (LLAMA_UNSPLIT, hi_t), (LLAMA_UNSPLIT, lo_t)))
            for o in orders:
                if g2 is not None and g2 != 1 and 1 in groups:
                    pairs.append((f"{o}: {g2} groups / 1 group", (SPLIT, o, g2), (SPLIT, o, 1)))
                n_dev = len(o.split(","))
                # a group per stage is the split's own target cell; against every unsplit -t that
                # ran, as a 3-stage split on a 2-core machine is judged against -t 2
                for g in sorted({g for g in (g2, n_dev) if g is not None and g in groups}):
                    for ut in sorted({n_dev * split_threads, *threads}):
                        pairs.append((f"{o}: {g} group(s) / pyllama unsplit -t {ut}",
                                      (SPLIT, o, g), (UNSPLIT, ut)))
                if g2 is not None:
                    if n_dev == 2:  # llama.cpp's split: one ggml-rpc-server, two stages
                        pairs.append((f"{o}: pyllama split {g2} group(s) / llama.cpp split",
                                      (SPLIT, o, g2), (LLAMA_SPLIT,)))
                    for ug in (g for g in unsplit_groups if g > 1):
                        pairs.append((f"{o}: {g2} group(s) / pyllama unsplit -t {split_threads} {ug} groups",
                                      (SPLIT, o, g2), (UNSPLIT, split_threads, ug)))
                for link in links:
                    if g2 is not None and g2 != 1 and 1 in groups:
                        pairs.append((f"{o} link {link}: {g2} groups / 1 group",
                                      (SPLIT, o, g2, link), (SPLIT, o, 1, link)))
                    for g in groups:
                        pairs.append((f"{o} {g} group(s): link {link} / loopback", (SPLIT, o, g, link), (SPLIT, o, g)))
            for name, num, den in pairs:
                r = paired_ratio(records, t, u, num, den)
                if r is not None:
                    rows.append({"type": t, "users": u, "name": name, **r})
    return rows


def format_cells(cells: list[dict]) -> str:
    head = ["type", "users", "arm", "tok/s mean [min..max]", "legs", "done/sent", "TPOT ms", "TTFT med ms",
            "preempted/s", "idle %", "stolen %", "busy %"]
    rows = []
    for c in cells:
        tok = "-" if c["tok_s_mean"] is None else \
            f"{c['tok_s_mean']:.1f} [{c['tok_s_min']:.1f}..{c['tok_s_max']:.1f}]"
        busy = ", ".join(f"{d} {p:.0f}" for d, p in c.get("busy_pct", {}).items()) or "-"
        rows.append([c["type"], str(c["users"]), c["arm"], tok, str(c["legs"]), f"{c['completed']}/{c['requests']}",
                     _num(c["tpot_ms"], ".1f"), _num(c["ttft_ms_median"], ".1f"),
                     _num(c.get("preempted_per_s"), ".0f"), _num(c.get("idle_pct"), ".1f"),
                     _num(c.get("stolen_pct"), ".1f"), busy])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    right = {1, 3, 4, 5, 6, 7, 8, 9, 10}

    def line(r: list[str]) -> str:
        return " | ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths)))

    return "\n".join([line(head), "-+-".join("-" * w for w in widths)] + [line(r) for r in rows])


def format_ratios(rows: list[dict]) -> str:
    if not rows:
        return "ratios: none (an arm of each pair is missing)"
    out = ["ratios (of the cell means; [min..max] of the per-leg ratios):"]
    for r in rows:
        spread = "" if r["min"] is None else f" [{r['min']:.2f}..{r['max']:.2f}]"
        out.append(f"  {r['type']} {r['users']} users: {r['name']}: {r['ratio']:.2f}x{spread}")
    return "\n".join(out)


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
    """A pyllama.server for one cell (bench/server_util.ServerProcess, which drains its output)."""

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
    """An rpc server in its own network namespace behind a rate-limited veth pair. `index` tells
    the rpc servers of one run apart (RPC<index>): the first's names are pyllama-peer-<pid> and
    pl<pid>a/pl<pid>b, the others' end in -<index> and <index>. Set up one after the other: each
    takes a subnet the ones before it left free."""

    LISTEN = re.compile(r"^listening on (\S+):(\d+)\s*$")

    def __init__(self, rate: str, threads: int, extra: Sequence[str] = (), index: int = 0) -> None:
        pid = os.getpid()
        self.extra = list(extra)
        self.rate = rate
        self.burst = tbf_burst(rate)
        self.latency = TBF_LATENCY
        self.threads = threads
        self.index = index
        tag = "" if index == 0 else str(index)
        self.ns = f"pyllama-peer-{pid}" + (f"-{index}" if index else "")
        self.host_if, self.peer_if = f"pl{pid}a{tag}", f"pl{pid}b{tag}"
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
               "--host", self.peer_ip, "--port", "0", "-t", str(self.threads), *self.extra]
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


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, tail) -> None:
    """Until GET /health answers 200 (llama-server answers 503 while it loads)."""
    import http.client  # noqa: PLC0415
    import urllib.parse  # noqa: PLC0415

    u = urllib.parse.urlsplit(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}: {tail()}")
        try:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
            conn.request("GET", "/health")
            status = conn.getresponse().status
            conn.close()
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"not ready after {timeout:.0f} s: {tail()}")


def _stop_proc(proc: Optional[subprocess.Popen], timeout: float = 30) -> Optional[int]:
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class LlamaServer:
    """llama.cpp's llama-server from the peers folder, on a free loopback port."""

    live: "set[LlamaServer]" = set()

    def __init__(self, peers, model: str, args: list[str], ready_timeout: float) -> None:
        from server_util import free_port  # noqa: PLC0415

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = peers.popen("llama-server", "-m", model, "--host", "127.0.0.1", "--port", str(self.port), *args,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.drain = _Drain(self.proc.stdout, keep=400)
        LlamaServer.live.add(self)
        try:
            _wait_http(self.url, self.proc, ready_timeout, lambda: self.drain.tail(10))
        except BaseException:
            self.stop()
            raise

    def log_tail(self, n: int = 20) -> str:
        return self.drain.tail(n)

    def stop(self) -> Optional[int]:
        code = _stop_proc(self.proc)
        LlamaServer.live.discard(self)
        return code


class GgmlRpcPeer:
    """llama.cpp's ggml-rpc-server (-t threads) on a free loopback port, for the whole run."""

    def __init__(self, peers, threads: int, timeout: float = 60, wrap: Sequence[str] = (), args: Sequence[str] = (),
                 env: Optional[dict] = None) -> None:
        import socket  # noqa: PLC0415

        from server_util import free_port  # noqa: PLC0415

        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = peers.popen("ggml-rpc-server", "-H", "127.0.0.1", "-p", str(self.port), "-t", str(threads),
                                *args, wrap=wrap, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.drain = _Drain(self.proc.stdout)
        deadline = time.monotonic() + timeout
        while True:  # it prints nothing we can rely on: ready once the port takes a connection
            if self.proc.poll() is not None:
                raise RuntimeError(f"ggml-rpc-server exited {self.proc.returncode}: {self.drain.tail(10)}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("ggml-rpc-server did not start listening") from None
                time.sleep(0.1)

    def stop(self) -> Optional[int]:
        return _stop_proc(self.proc)


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

def add_server_bench_options(ap, legs: int) -> None:
    """The options of a bench that serves one GGUF file with pyllama and llama-server side by side
    (bench/prompt_cache.py, bench/slot_restore.py); `model_and_vocab` reads them."""
    ap.add_argument("--model")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--type", default="q4_k_m")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--legs", type=int, default=legs)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--peers", help="llama.cpp's programs (DIR/bin); default $PYLLAMA_PEERS")
    ap.add_argument("--json")


def model_and_vocab(args) -> tuple[str, int]:
    """The GGUF file the options name (made for --preset/--type) and its vocabulary size."""
    from pyllama.models.gguf_file import GGUFFile  # noqa: PLC0415

    path = args.model or model_path(args.preset, args.type)
    return path, len(GGUFFile(path).get("tokenizer.ggml.tokens"))


def model_path(preset: str, wtype: str = "f32") -> str:
    """bench/out/models/PRESET-WTYPE.gguf, made once with pyllama.models.make."""
    from pyllama.models.make import make_model  # noqa: PLC0415

    out = os.path.join(HERE, "out", "models")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{preset}-{wtype}.gguf")
    if not os.path.exists(path):
        tmp = os.path.join(out, f".{preset}-{wtype}.{os.getpid()}.tmp.gguf")
        try:
            make_model(preset, tmp, wtype=wtype)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def model_layers(model: str) -> int:
    from pyllama.models.gguf_file import read_metadata  # noqa: PLC0415

    md = read_metadata(model)
    return int(md.get(f"{md.get('general.architecture', 'llama')}.block_count") or 0)


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


def _trace_name(run: dict) -> str:
    order = run.get("order", "").replace(",", "-")
    link = f"-link{run['link'].replace('/', '_')}" if run.get("link") else ""
    return f"{run['type']}-{run['kind']}-{order}{link}-g{run.get('groups', 0)}-u{run['users']}-leg{run['leg']}.jsonl"


def busy_shares(server_trace: str, peer_traces: "str | Sequence[str]",
                timeout: float = 600) -> tuple[dict[str, float], str]:
    """Busy % per device of one traced cell, from trace_tools/merge.py --summary over the server's
    trace and those of the rpc servers it used (and the summary's text)."""
    peers = [peer_traces] if isinstance(peer_traces, str) else list(peer_traces)
    cmd = [sys.executable, os.path.join(ROOT, "trace_tools", "merge.py"), server_trace, *peers, "--summary"]
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {}, "merge.py --summary timed out"
    text = r.stdout if r.returncode == 0 else (r.stdout + r.stderr)[-2000:]
    return parse_busy(text), text


COMPUTE_THREADS = ("decode-", "kernel-pool", "rpc-exec-")  # the OS names of the compute threads


def thread_summary(before: dict, after: dict, labels: dict[int, str], window_s: float) -> dict:
    """Per process (by label) of a cell's measured window, from two thread_stats snapshots: CPU
    and run-queue wait seconds of all its threads, and of its compute threads (decode-N,
    kernel-pool, rpc-exec-*) the wait share and how often they were preempted (the time-slicing
    that stretches a split's stages, docs/pipeline-groups.md "Thread priority")."""
    rows = thread_stats.difference(before, after, min_cpu_ms=0.0)
    out: dict = {"window_s": round(window_s, 3)}
    for pid, label in labels.items():
        mine = [r for r in rows if r.pid == pid]
        comp = [r for r in mine if r.name.startswith(COMPUTE_THREADS)]
        c_cpu, c_wait = sum(r.cpu_ms for r in comp), sum(r.wait_ms for r in comp)
        out[label] = {"cpu_s": round(sum(r.cpu_ms for r in mine) / 1e3, 3),
                      "wait_s": round(sum(r.wait_ms for r in mine) / 1e3, 3),
                      "compute_wait_pct": round(100.0 * c_wait / (c_cpu + c_wait), 1) if c_cpu + c_wait else 0.0,
                      "compute_preempted": sum(r.involuntary for r in comp)}
    return out


def preempt_rate(stats: Optional[dict]) -> Optional[float]:
    """Preemptions of the compute threads per second of the window, every process of the cell
    (a thread_summary)."""
    if not stats or not stats.get("window_s"):
        return None
    return sum(v["compute_preempted"] for v in stats.values() if isinstance(v, dict)) / stats["window_s"]


def run_cell(model: str, endpoint: str, run: dict, a, vocab: tuple[int, int], log, ctx: Optional[dict] = None) -> dict:
    """Start the cell's server (pyllama or llama-server), bench it, stop it. Never raises for a
    server that fails. `endpoint` is a split cell's --rpc value. `ctx` carries the run's shared
    state: peers, the llama.cpp rpc endpoint, the trace folder and the rpc servers' traces and
    pids (by RPC index), the --link relays' endpoints and pids (by link name, then RPC index),
    llama.cpp's -ngl."""
    ctx = ctx or {}
    kind = run.get("kind", SPLIT)
    extra = shlex.split(a.server_args) + prio_args(a.prio)
    pinned = kind == SPLIT and bool((ctx.get("links") or {}).get(run.get("link"), {}).get("pinned"))
    if pinned:
        extra = extra + ["-C", "0x1"]
        pin_peers([p for p in (ctx.get("peer_pids") or []) if p], True)
    try:
        return _run_cell(model, endpoint, run, a, vocab, log, ctx, kind, extra)
    finally:
        if pinned:
            pin_peers([p for p in (ctx.get("peer_pids") or []) if p], False)


def _run_cell(model: str, endpoint: str, run: dict, a, vocab: tuple[int, int], log, ctx: dict, kind: str,
              extra: list[str]) -> dict:
    trace_path = None
    if kind == SPLIT:
        args = server_args(run["order"], endpoint, run["groups"], run["users"], a.npp, a.ntg, a.threads,
                           a.tensor_split, extra)
        if ctx.get("trace_dir"):
            trace_path = os.path.join(ctx["trace_dir"], _trace_name(run))
            args += ["--trace", trace_path]
        n_slots = slots_for(run["users"], run["groups"])
    elif kind == UNSPLIT:
        args = unsplit_args(run["users"], a.npp, a.ntg, run["threads"], extra, run.get("groups", 1))
        n_slots = slots_for(run["users"], run.get("groups", 1))
    elif kind == LLAMA_UNSPLIT:
        args = llama_args(run["users"], a.npp, a.ntg, run["threads"])
        n_slots = run["users"]
    else:
        ngl = ctx.get("llama_ngl")
        args = llama_args(run["users"], a.npp, a.ntg, a.threads, ctx.get("llama_endpoint"), ngl)
        n_slots = run["users"]
    llama = kind in (LLAMA_SPLIT, LLAMA_UNSPLIT)
    rec = {**run, "np": n_slots, "ctx": ctx_for(n_slots, a.npp, a.ntg),
           "server_args": ["-m", model, *args], "start_error": None, "server_exit": None,
           "gen_tok_s": None, "tpot_ms": None, "ttft_ms_median": None, "ttft_ms_p99": None,
           "errors": 0, "short": 0, "exit_status": 0, "failures": [], "bench": None}
    t0 = time.monotonic()
    try:
        server = LlamaServer(ctx["peers"], model, args + prio_args(a.prio), a.ready_timeout) if llama else \
            CellServer(model, args, a.ready_timeout)
    except Exception as e:  # noqa: BLE001 - a server that does not start is a failed cell
        msg = str(e).strip().splitlines()
        rec["start_error"] = " ".join(msg[-3:]) if msg else type(e).__name__
        rec["errors"] = run["users"] * a.requests
        rec["exit_status"] = 1
        rec["failures"] = [f"server did not start: {rec['start_error']}"]
        log(f"  server did not start: {rec['start_error']}")
        return rec
    rec["ready_s"] = round(time.monotonic() - t0, 3)
    # pyllama's processes: their threads' counters over the measured window (Linux)
    labels = {} if llama or not sys.platform.startswith("linux") else {server.sp.proc.pid: "server"}
    if labels and kind == SPLIT:
        relays = (ctx.get("links") or {}).get(run.get("link"), {}).get("pids") or []
        for i in rpc_indices(run["order"]):
            pids = ctx.get("peer_pids") or []
            if i < len(pids) and pids[i]:
                labels[pids[i]] = "rpc" if i == 0 else f"rpc{i}"
            if i < len(relays):  # the relay of a --link arm: its CPU time over the window
                labels[relays[i]] = "link" if i == 0 else f"link{i}"
    before: dict = {}
    t_window = [0.0]
    cpu_window: list[list[int]] = []

    def window_start() -> None:
        if sys.platform.startswith("linux"):
            cpu_window.append(thread_stats.read_cpu_times())
        try:
            before.update(thread_stats.snapshot(list(labels)))
        except thread_stats.ProcessGone:
            return  # the bench reports the server that went away
        t_window[0] = time.monotonic()

    try:
        rep = run_bench(server.url, run["users"], a.requests, a.npp, a.ntg, warmup=a.warmup,
                        timeout=a.timeout, seed=a.seed, vocab=vocab, on_window_start=window_start)
        if cpu_window:  # the machine's idle share: what a split's chain leaves unused
            try:
                shares = thread_stats.machine_shares(cpu_window[0], thread_stats.read_cpu_times())
            except thread_stats.ProcessGone:
                shares = None
            if shares is not None:  # None: a window shorter than a clock tick
                rec["machine_pct"] = {k: round(v, 1) for k, v in shares.items()}
        if before:
            try:
                rec["thread_stats"] = thread_summary(before, thread_stats.snapshot(list(labels)), labels,
                                                time.monotonic() - t_window[0])
            except thread_stats.ProcessGone:
                pass
    finally:
        rec["server_exit"] = server.stop()
    rec["bench"] = rep
    for k in ("gen_tok_s", "tpot_ms", "ttft_ms_median", "ttft_ms_p99", "errors", "short", "exit_status",
              "failures"):
        rec[k] = rep[k]
    if llama and rep["requests_done"] > 0 and rep["exit_status"] != 0:
        # HTTP 500s against random-weight models: the tokens/s count completed requests only
        rec["exit_status"], rec["failures"] = 0, []
    rec["server_log_tail"] = server.log_tail()
    if kind == SPLIT:
        blocks = blocks_from_log(getattr(server.sp, "stderr_text", ""))
        if blocks is not None:
            rec["last_blocks"] = blocks
    peer_traces = [ctx["peer_traces"][i] for i in rpc_indices(run.get("order", ""))
                   if i < len(ctx.get("peer_traces") or [])]
    if trace_path and peer_traces:
        rec["busy_pct"], rec["trace_summary"] = busy_shares(trace_path, peer_traces)
    return rec


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pipeline_cells.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=None)
    ap.add_argument("--preset", default="medium", help="test model preset (made once under bench/out/models)")
    ap.add_argument("--model", metavar="PATH", help="GGUF model (overrides --preset)")
    ap.add_argument("--orders", default="CPU,RPC0;RPC0,CPU",
                    help="device orders, ';'-separated, of CPU and rpc servers RPC0, RPC1, ... (one rpc server "
                         "process each), e.g. 'RPC0,CPU;RPC0,RPC1,CPU'")
    ap.add_argument("--groups", default="1,2,3,4", help="pipeline group counts")
    ap.add_argument("--users", default="32,64,128", help="concurrent user counts")
    ap.add_argument("--legs", type=int, default=3, help="legs (repeats) per arm, interleaved")
    ap.add_argument("--npp", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--ntg", type=int, default=64, help="generated tokens per request")
    ap.add_argument("-r", "--requests", type=int, default=3,
                    help="measured requests per user (at 1, a leg is mostly its ramp and tail: the last "
                    "steps of a leg carry few rows)")
    ap.add_argument("-t", "--threads", type=int, default=1, help="compute threads of the server and the rpc server")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted requests per user before the window")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt token ids")
    ap.add_argument("--timeout", type=float, default=600, help="HTTP socket timeout per operation, seconds")
    ap.add_argument("--ready-timeout", type=float, default=600, help="seconds a server may take to load")
    ap.add_argument("--tensor-split", default="even",
                    help="even: -ts 1,1 or 1,1,1 (fixed layer boundaries); auto: no -ts (the server's split by "
                         "measured speed); or proportions a,b passed as they are (one per device of every order)")
    ap.add_argument("--server-args", default="", metavar="'ARGS'",
                    help="more pyllama.server arguments for every cell, e.g. '--kv-unified'")
    ap.add_argument("--prio", type=int, default=0, choices=sorted(LEVELS),
                    help="--prio of every pyllama server and rpc server (docs/server.md) and of llama-server; "
                         f"ggml-rpc-server is started under chrt at the same level ({LEVELS_HELP})")
    ap.add_argument("--link", "--links", action="append", dest="link", metavar="DELAY_MS/RATE",
                    help="one more split arm per value whose server reaches each rpc server through "
                         "bench/link_shaper.py: DELAY_MS one way and RATE each way (tc units, none: no cap), e.g. "
                         "2/1gbit; may be given several times or comma-separated (0/none,2/1gbit)")
    ap.add_argument("--pin", action="store_true",
                    help="one more split arm per (order, groups), named link 'pinned': the server on CPU 0 "
                         "(-C 0x1) and each rpc server on a CPU of its own (taskset, CPU 1 + its index) for the "
                         "cell, on loopback; the other arms run on every CPU")
    ap.add_argument("--netns", action="store_true", help="rpc server in its own network namespace (root)")
    ap.add_argument("--rate", default="10gbit", help="tbf rate of the veth pair with --netns")
    ap.add_argument("--types", default="f32", help="weight types of the --preset models, e.g. f32,q4_k_m "
                    "(each made once under bench/out/models; ignored with --model)")
    ap.add_argument("--unsplit-threads", default="none", metavar="T,T",
                    help="thread counts of the unsplit cells (one process, no rpc), e.g. 1,2; none: no such cell")
    ap.add_argument("--unsplit-groups", default="none", metavar="G,G",
                    help="also run pyllama unsplit with G pipeline groups of -t threads each (one device, e.g. 2); "
                         "none: no such cell")
    ap.add_argument("--peers", metavar="DIR",
                    help="llama.cpp's programs (DIR/bin: ggml-rpc-server, llama-server; default $PYLLAMA_PEERS): "
                         "adds llama.cpp's split (ggml-rpc-server -t T + llama-server --rpc -ngl N -t T, the same "
                         "blocks per process as pyllama's split) and its unsplit server at --unsplit-threads")
    ap.add_argument("--llama-ngl", type=int, metavar="N",
                    help="llama.cpp split: -ngl N (default: 1 + the blocks the last device holds in the pyllama "
                         "split cells of RPC0,CPU: the rpc side then runs those blocks and the output layer)")
    ap.add_argument("--trace", metavar="DIR",
                    help="trace the pyllama split cells (server and rpc server) into DIR and report each "
                         "device's busy share from trace_tools/merge.py --summary")
    ap.add_argument("--json", metavar="OUT", help="write everything, every leg included, as JSON")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        orders = parse_orders(a.orders)
        groups = parse_int_list(a.groups, "groups")
        users = parse_int_list(a.users, "users")
        unsplit_threads = parse_thread_list(a.unsplit_threads, "unsplit-threads")
        unsplit_groups = parse_thread_list(a.unsplit_groups, "unsplit-groups")
        types = parse_types(a.types) if not a.model else ["model"]
        if a.legs < 1 or a.npp < 1 or a.ntg < 1 or a.requests < 1 or a.threads < 0 or a.warmup < 0:
            raise ValueError("--legs, --npp, --ntg and -r must be at least 1; -t and --warmup at least 0")
        if a.llama_ngl is not None and a.llama_ngl < 0:
            raise ValueError("--llama-ngl must be at least 0")
        shlex.split(a.server_args)
        check_tensor_split(a.tensor_split, orders)
        links = parse_links(a.link)
        if a.pin:
            links.append(dict(PINNED))
        if links and not rpc_count(orders):
            raise ValueError("--link: no order names an rpc server")
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
    peers = None
    if a.peers or os.environ.get("PYLLAMA_PEERS"):
        from peers import Peers  # noqa: PLC0415

        folder = a.peers or os.environ["PYLLAMA_PEERS"]
        missing = [p for p in ("llama-server", "ggml-rpc-server") if not os.path.isfile(os.path.join(folder, "bin", p))]
        if missing:
            print(f"{PROG}: --peers {folder}: no {' or '.join('bin/' + m for m in missing)}", file=sys.stderr)
            return 1
        peers = Peers(folder)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    models: dict[str, str] = {}
    if a.model:
        if not os.path.isfile(a.model):
            print(f"{PROG}: --model {a.model}: no such file", file=sys.stderr)
            return 1
        models["model"] = a.model
    else:
        try:
            for t in types:
                models[t] = model_path(a.preset, t)
        except ValueError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 1
    vocabs = {t: prompt_vocab(m) for t, m in models.items()}
    link_names = [lk["name"] for lk in links]
    arms = make_arms(orders, groups, unsplit_threads, peers is not None, unsplit_groups, a.threads, link_names)
    # llama.cpp's split is one ggml-rpc-server and llama-server: it is compared with the 2-stage
    # orders of CPU and RPC0 only
    two_stage = [o for o in orders if sorted(o.split(",")) == ["CPU", "RPC0"]]
    if peers is not None and len(two_stage) < len(orders):
        wider = [o for o in orders if o not in two_stage]
        log(f"llama.cpp split: run as 2 stages (CPU and one ggml-rpc-server) only; no llama.cpp arm for "
            f"{'; '.join(wider)}" + ("" if two_stage else ", so none at all"))
        if not two_stage:
            arms = [r for r in arms if r["kind"] != LLAMA_SPLIT]
    runs = full_schedule(types, arms, users, a.legs)
    if os.environ.pop(GROUPS_ENV, None) is not None:
        log(f"ignoring {GROUPS_ENV} from the environment: every cell sets its own group count")
    trace_dir = None
    if a.trace:
        trace_dir = os.path.abspath(a.trace)
        os.makedirs(trace_dir, exist_ok=True)

    install_signal_handlers()
    netns_peers: list[NetnsPeer] = []
    rpcs: list[RPCServerProcess] = []
    relays: list[LinkShaperProcess] = []
    llama_rpc: Optional[GgmlRpcPeer] = None
    records: list[dict] = []
    t_start = time.time()
    endpoints: list[str] = []   # RPC<i>'s endpoint at index i

    def cleanup() -> None:
        ignore_signals()
        for server in list(CellServer.live):
            server.stop()
        for server in list(LlamaServer.live):
            server.stop()
        for relay in relays:
            relay.stop()
        for rpc in rpcs:
            rpc.stop()
        if llama_rpc is not None:
            llama_rpc.stop()
        for peer in netns_peers:
            peer.teardown()
        if peers is not None:
            peers.close()
        restore_signals()

    shared: dict = {"peers": peers, "trace_dir": trace_dir, "peer_traces": [], "peer_pids": [], "links": {}}
    n_rpc = rpc_count(r["order"] for r in runs if r["kind"] == SPLIT)
    try:
        for i in range(n_rpc):  # one rpc server per RPC<i>, for the whole run
            peer_args = ["-t", str(a.threads)] + prio_args(a.prio)
            if trace_dir:
                shared["peer_traces"].append(os.path.join(trace_dir, "rpc-server.jsonl" if i == 0 else
                                                          f"rpc-server-RPC{i}.jsonl"))
                peer_args += ["--trace", shared["peer_traces"][-1]]
            if a.netns:
                peer = NetnsPeer(a.rate, a.threads, prio_args(a.prio), index=i)
                netns_peers.append(peer)
                atexit.register(peer.teardown)
                try:
                    peer.setup()
                    endpoints.append(peer.start_rpc())
                    shared["peer_pids"].append(peer.proc.pid)  # `ip netns exec` runs the server in its own process
                except RuntimeError as e:
                    print(f"{PROG}: --netns: {e}", file=sys.stderr)
                    return 1
                log(f"RPC{i}: rpc server in namespace {peer.ns} at {endpoints[-1]}, veth {peer.host_if}/{peer.peer_if} "
                    f"tbf {a.rate}")
            else:
                rpc = RPCServerProcess(*peer_args)
                rpcs.append(rpc)
                shared["peer_pids"].append(rpc.proc.pid)
                atexit.register(rpc.stop)
                endpoints.append(rpc.endpoint)
                log(f"RPC{i}: rpc server at {rpc.endpoint}")
        for lk in links:  # per --link, a relay in front of each rpc server, for the whole run
            if lk.get("pinned"):  # no relay: the rpc servers themselves, pinned while the cell runs
                shared["links"][lk["name"]] = {"endpoints": list(endpoints), "pids": [], "pinned": True}
                continue
            mine: dict = {"endpoints": [], "pids": []}
            for i, ep in enumerate(endpoints):
                try:
                    relay = LinkShaperProcess(ep, lk["delay_ms"], lk["rate_bit_s"], wrap=relay_prefix(a.prio))
                except (OSError, RuntimeError) as e:
                    print(f"{PROG}: --link {lk['name']}: {e}", file=sys.stderr)
                    return 1
                relays.append(relay)
                atexit.register(relay.stop)
                mine["endpoints"].append(relay.endpoint)
                mine["pids"].append(relay.pid)
                log(f"RPC{i} over link {lk['name']}: relay at {relay.endpoint}")
            shared["links"][lk["name"]] = mine
        if any(r["kind"] == LLAMA_SPLIT for r in runs):
            llama_rpc = GgmlRpcPeer(peers, a.threads, wrap=chrt_prefix(a.prio))
            shared["llama_endpoint"] = llama_rpc.endpoint
            log(f"ggml-rpc-server at {llama_rpc.endpoint}")
        log(f"models {models}; {len(runs)} runs: {len(arms)} arms ({', '.join(arm_label(arm_key(r)) for r in arms)}), "
            f"users {users}, {a.legs} legs, npp {a.npp}, ntg {a.ntg}, -r {a.requests}, -t {a.threads}, --prio {a.prio}")
        for i, run in enumerate(runs, 1):
            log(f"[{i}/{len(runs)}] {run['type']} {arm_label(arm_key(run))} users {run['users']} leg {run['leg']}")
            if run["kind"] == LLAMA_SPLIT:
                ngl = a.llama_ngl
                if ngl is None:  # the part of the last device in this type's pyllama split cells
                    ref = "RPC0,CPU" if "RPC0,CPU" in orders else two_stage[0]
                    seen = [r["last_blocks"] for r in records if r["type"] == run["type"] and r["kind"] == SPLIT
                            and r["order"] == ref and r.get("last_blocks") is not None]
                    n_layer = model_layers(models[run["type"]])
                    last = seen[-1] if seen else split_blocks(n_layer, a.tensor_split, ref)
                    ngl = llama_ngl(n_layer // 2 if last is None else last)
                shared["llama_ngl"] = ngl
            rpc_value = "" if run["kind"] != SPLIT else \
                rpc_arg(shared["links"][run["link"]]["endpoints"] if run.get("link") else endpoints, run["order"])
            rec = run_cell(models[run["type"]], rpc_value, run, a, vocabs[run["type"]], log, shared)
            records.append(rec)
            if rec["start_error"] is None:
                done = (rec.get("bench") or {}).get("requests_done")
                log(f"  {_num(rec['gen_tok_s'], '.1f')} tok/s, TPOT {_num(rec['tpot_ms'], '.1f')} ms, "
                    f"TTFT median {_num(rec['ttft_ms_median'], '.1f')} ms, errors {rec['errors']}, "
                    f"completed {done}" + (f", busy {rec['busy_pct']}" if rec.get("busy_pct") else "")
                    + (f", compute threads preempted {preempt_rate(rec['thread_stats']):.0f}/s"
                       if rec.get("thread_stats") else "")
                    + (f", cores idle {rec['machine_pct']['idle']:.1f}% (stolen {rec['machine_pct']['stolen']:.1f}%)"
                       if rec.get("machine_pct") else "")
                    + ("" if rec["exit_status"] == 0 else "  FAIL: " + "; ".join(rec["failures"])))
    finally:
        cleanup()

    split_records = [r for r in records if r["kind"] == SPLIT]
    cells = []
    for t in types:
        cells += [{"type": t, **c} for c in summarize([r for r in split_records if r["type"] == t], orders, users, groups,
                                                      link_names)]
    best = best_ratios(cells, orders, 2) if len(types) == 1 else {}
    every = all_cells(records)
    ratios = target_ratios(records, types, users, orders, groups, unsplit_threads, a.threads, unsplit_groups,
                           link_names)
    print(f"pipeline cells: {', '.join(os.path.basename(m) for m in models.values())}, npp {a.npp}, ntg {a.ntg}, "
          f"-r {a.requests}, -t {a.threads}, {a.legs} legs per arm, "
          + ("rpc " if n_rpc < 2 else f"{n_rpc} rpc servers ")
          + (f"in netns behind tbf {a.rate}" if a.netns else "on loopback")
          + (f"; and over links {', '.join(link_names)} (bench/link_shaper.py)" if links else ""))
    if split_records:
        print(format_table(cells))
        print()
        if len(types) == 1:
            print(format_best(best, 2))
    if len(every) > len(cells) or len(types) > 1 or trace_dir or links:
        print()
        print(format_cells(every))
        print()
        print(format_ratios(ratios))
        if peers is not None:
            print(LLAMA_NOTE)
    failed = [r for r in records if r["exit_status"] != 0 or (r["errors"] and r["kind"] not in (LLAMA_SPLIT, LLAMA_UNSPLIT))]
    for r in failed[:10]:
        where = (f"{r['order']} groups {r['groups']}" if r["kind"] == SPLIT and len(arm_key(r)) == 3
                 else arm_label(arm_key(r)))
        print(f"FAIL {where} users {r['users']} leg {r['leg']}: " + "; ".join(r["failures"] or [f"{r['errors']} errors"]))
    status = 1 if failed else 0
    if a.json:
        doc = {
            "config": {k: getattr(a, k) for k in vars(a)}, "models": models, "model": next(iter(models.values())),
            "prompt_vocab": {t: list(v) for t, v in vocabs.items()},
            "orders": orders, "groups": groups, "users": users, "types": types, "unsplit_threads": unsplit_threads,
            "arms": arms, "rpc_endpoint": endpoints[0] if endpoints else "", "rpc_endpoints": endpoints,
            "netns": netns_peers[0].describe() if netns_peers else None,
            "netns_peers": [p.describe() for p in netns_peers],
            "links": [{**lk, **shared["links"].get(lk["name"], {})} for lk in links],
            "started": t_start, "wall_s": round(time.time() - t_start, 3),
            "schedule": runs, "legs": records, "cells": cells, "all_cells": every, "ratios": ratios,
            "best_2_over_1": best, "exit_status": status, "llama_note": LLAMA_NOTE if peers is not None else None,
        }
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
            fh.write("\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
