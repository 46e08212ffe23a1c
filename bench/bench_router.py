"""Router mode under load: several models behind one server, each in its own process.

    python bench/bench_router.py [--preset small] [--users 32] [--requests 8] [--ntg 16] [--idle 3]

Makes four models (a, b, c, d) in a temporary folder and starts `python -m pyllama.server
--models-dir DIR --models-max 3 --sleep-idle-seconds IDLE --models-memory BUDGET` (each model with as
many slots as users), the budget being three models' estimates plus room for the router itself. Models a, b and d are loaded first; d then
gets no request and must be put to sleep (its process stopped) after IDLE seconds. Phases, each a
closed loop of U users (one keep-alive connection each, R streamed /completion requests one after
the other, n_predict NTG, ignore_eos):

  alone a, alone b   every user on one model: that model's one-model latency
  mix                the users spread over a, b and c, request by request; c is not loaded when the
                     mix starts: its first request loads it on demand (the requests sent while it
                     loads are counted for failures, not for c's mix latency)
  alone c            c's one-model latency

Printed: failures (any request not answered 200 with all its tokens; must be 0), each model's
median latency in the mix over its median alone (target at most 1.5x), how long c's load took, d's
status, and the peak resident memory of the router and its model processes together against the
budget. Exit status 1 when a request failed, a ratio is above 1.5, d was not put to sleep or the
peak memory passed the budget."""
from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_util import ServerProcess, child_pids  # noqa: E402

MODELS = ("a", "b", "c", "d")
TARGET_RATIO = 1.5
ROUTER_ROOM = 100 << 20  # the router process itself (interpreter, HTTP layer), beyond the models
MiB = 1 << 20


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakRSS(threading.Thread):
    """Samples the resident memory of the router and its children together every 50 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, rss(self.pid) + sum(rss(c) for c in child_pids(self.pid)))
            self.done.wait(0.05)


def one_request(conn: http.client.HTTPConnection, model: str, prompt: str, ntg: int) -> dict:
    """A streamed /completion read to its end: latency, and the error if it failed."""
    body = json.dumps({"model": model, "prompt": prompt, "n_predict": ntg, "ignore_eos": True, "stream": True,
                       "temperature": 0, "cache_prompt": False})
    t0 = time.perf_counter()
    r = {"model": model, "error": None, "t0": t0}
    try:
        conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            r["error"] = f"HTTP {resp.status}: {resp.read()[:200]!r}"
        else:
            predicted = None
            for raw in resp:
                if raw.startswith(b"data: {"):
                    ev = json.loads(raw[6:])
                    if ev.get("stop"):
                        predicted = ev.get("tokens_predicted")
            if predicted != ntg:
                r["error"] = f"{predicted} tokens instead of {ntg}"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        r["error"] = f"{type(exc).__name__}: {exc}"
        conn.close()
    r["latency"] = time.perf_counter() - t0
    return r


def run_phase(port: int, users: int, requests: int, ntg: int, pick) -> list[dict]:
    """U users in a closed loop; pick(user, index) names each request's model."""
    results: list[dict] = []
    lock = threading.Lock()
    start = threading.Barrier(users)

    def user(u: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        start.wait()
        for i in range(requests):
            r = one_request(conn, pick(u, i), f"User {u} asks question {i}: tell me a story about", ntg)
            with lock:
                results.append(r)
        conn.close()

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def status(router: ServerProcess) -> dict[str, str]:
    _, body = router.request("GET", "/models")
    return {m["id"]: m["status"]["value"] for m in body["data"]}


def median_ms(results: list[dict], model: str) -> float:
    ok = [r["latency"] for r in results if r["model"] == model and not r["error"]]
    return statistics.median(ok) * 1e3 if ok else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", help="pyllama.models.make preset of the four models")
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8, help="requests per user and phase")
    ap.add_argument("--ntg", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--idle", type=int, default=3, help="--sleep-idle-seconds of the router")
    opts = ap.parse_args(argv)
    from pyllama.server.models.registry import estimate_memory  # noqa: PLC0415

    tmp = tempfile.mkdtemp(prefix="bench_router_")
    router = None
    try:
        for seed, name in enumerate(MODELS, 1):
            subprocess.run([sys.executable, "-m", "pyllama.models.make", "--preset", opts.preset, "--out",
                            os.path.join(tmp, f"{name}.gguf"), "--seed", str(seed)], check=True, capture_output=True)
        # as many slots as users: a model alone serves every user at once, as the mix does
        sizes = ["-c", str(256 * opts.users), "-np", str(opts.users)]
        estimate = estimate_memory(os.path.join(tmp, "a.gguf"), sizes)
        budget = 3 * estimate + ROUTER_ROOM
        router = ServerProcess("", "--models-dir", tmp, "--models-max", "3", "--sleep-idle-seconds", str(opts.idle),
                               "--models-memory", str(budget // MiB), *sizes).wait_ready()
        peak = PeakRSS(router.proc.pid)
        peak.start()
        for name in ("a", "b", "d"):
            assert router.post("/models/load", {"model": name})[0] == 200
        deadline = time.monotonic() + 120
        while any(status(router)[n] != "loaded" for n in ("a", "b", "d")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"models not loaded: {status(router)}")
            time.sleep(0.1)
        d_loaded = time.monotonic()
        d_slept: list[float] = []

        def watch_d() -> None:  # when d's status turns sleeping, seen by a client of /models
            while not d_slept and time.monotonic() < d_loaded + opts.idle + 120:
                if status(router)["d"] == "sleeping":
                    d_slept.append(time.monotonic() - d_loaded)
                time.sleep(0.2)

        watcher = threading.Thread(target=watch_d, daemon=True)
        watcher.start()
        U, R, N = opts.users, opts.requests, opts.ntg
        alone = {m: run_phase(router.port, U, R, N, lambda u, i, m=m: m) for m in ("a", "b")}
        watcher.join()
        d_status = status(router)["d"]
        assert status(router)["c"] == "unloaded"
        t_mix = time.monotonic()
        mix = run_phase(router.port, U, R, N, lambda u, i: ("a", "b", "c")[(u + i) % 3])
        mix_s = time.monotonic() - t_mix
        c_mix = sorted((r for r in mix if r["model"] == "c"), key=lambda r: r["t0"])
        c_first = c_mix[0]["latency"] if c_mix else 0.0
        # the c requests sent while c was loading waited for the load (reported apart): the mix's
        # latency of c is that of the requests sent once it served
        c_ready = c_mix[0]["t0"] + c_first if c_mix else 0.0
        mix = [r for r in mix if r["model"] != "c" or r["t0"] >= c_ready]
        n_waited = len(c_mix) - sum(1 for r in mix if r["model"] == "c")
        alone["c"] = run_phase(router.port, U, R, N, lambda u, i: "c")
        peak.done.set()
        peak.join()
        everything = [r for rs in alone.values() for r in rs] + mix + [r for r in c_mix if r["t0"] < c_ready]
        failures = [r for r in everything if r["error"]]

        print(f"router mode: 4 x '{opts.preset}' models ({os.path.getsize(os.path.join(tmp, 'a.gguf')) / MiB:.1f} "
              f"MiB each), --models-max 3, --sleep-idle-seconds {opts.idle}, children {' '.join(sizes)} -t 1; "
              f"{U} users x {R} streamed requests of {N} tokens per phase")
        print(f"{'phase':<10}{'model':<7}{'requests':>9}{'failures':>9}{'p50 ms':>9}{'mean ms':>9}")
        for label, rs, models in [("alone", alone["a"], "a"), ("alone", alone["b"], "b"), ("mix", mix, "abc"),
                                  ("alone", alone["c"], "c")]:
            for m in models:
                mine = [r for r in rs if r["model"] == m]
                ok = [r["latency"] for r in mine if not r["error"]]
                print(f"{label:<10}{m:<7}{len(mine):>9}{len(mine) - len(ok):>9}"
                      f"{statistics.median(ok) * 1e3 if ok else float('nan'):>9.0f}"
                      f"{statistics.mean(ok) * 1e3 if ok else float('nan'):>9.0f}")
        ratios = {m: median_ms(mix, m) / median_ms(alone[m], m) for m in ("a", "b", "c")}
        print("latency in the mix over alone (p50): " + ", ".join(f"{m} {x:.2f}x" for m, x in ratios.items())
              + f" (target <= {TARGET_RATIO}x)")
        print(f"on demand: c was loaded by its first request in the mix, which took {c_first * 1e3:.0f} ms (the load "
              f"included); {n_waited} c request(s) sent during the load are left out of the mix row; mix phase "
              f"{mix_s:.1f} s")
        print("idle: d loaded, then no request: " + (f"sleeping (its process stopped) {d_slept[0]:.1f} s after its "
                                                     "load" if d_slept else "never put to sleep")
              + f"; its status at the end '{d_status}'")
        print(f"failures: {len(failures)}" + (f" (first: {failures[0]['error']})" if failures else ""))
        print(f"peak RSS, router + model processes: {peak.peak / MiB:.0f} MiB; budget {budget / MiB:.0f} MiB "
              f"(--models-memory: 3 models of an estimated {estimate / MiB:.0f} MiB each, plus "
              f"{ROUTER_ROOM / MiB:.0f} MiB for the router)")
        ok = (not failures and all(x <= TARGET_RATIO for x in ratios.values()) and d_status == "sleeping"
              and peak.peak <= budget)
        return 0 if ok else 1
    finally:
        if router is not None:
            router.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
