"""CUDA backend checks for a GPU machine (bench/gpu_check.sh runs all three).

    python bench/cuda_bench.py compare [--preset medium] [--wtype f16] [--json OUT]
    python bench/cuda_bench.py decode  [--preset medium] [--wtype f16] [--batches 1,8,32] [--bandwidth 4.8e12] [--json OUT]
    python bench/cuda_bench.py split   [--preset medium] [--wtype f16] --out DIR

compare: the logits of a 64-token prompt (every row) and of 16 greedy steps from the CUDA
backend against the CPU backend: relative error, max abs difference, argmax agreement and the
top-2 gaps where they disagree.
decode: tokens/s of batched greedy decode at each batch size (logits read back and sampled on the
host, and with the sampler on the device), against the memory-bandwidth limit: the bytes of
weights one decode step reads (every matrix, once) over the device's bandwidth.
split: the server with its first layers on an `rpc_server --device CUDA0` and the rest on its CPU,
both traced, serving two greedy completions; writes the trace files and the merged per-step
summary (trace_tools/merge.py).
Models are made with pyllama.models.make and cached under bench/out/models.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from pyllama.runtime.context import Batch  # noqa: E402
from pyllama.runtime.engine import Engine  # noqa: E402
from pyllama.models.make import make_model  # noqa: E402
from pyllama.batching.sampling import BatchSampler, SamplingParams, SequenceSampler  # noqa: E402


def model_path(preset: str, wtype: str) -> str:
    out = os.path.join(HERE, "out", "models")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{preset}-{wtype}.gguf")
    if not os.path.exists(path):
        make_model(preset, path, wtype=wtype)
    return path


def cuda_engine(path: str) -> Engine:
    from pyllama.backend.cuda import open_backend  # noqa: PLC0415
    return Engine(path, n_threads=0, backends=[open_backend("CUDA0")])


def greedy_run(engine: Engine, prompt: list[int], steps: int) -> tuple[np.ndarray, list[np.ndarray], list[int]]:
    ctx = engine.new_context(1024)
    batch = Batch(np.array(prompt), np.arange(len(prompt)), np.zeros(len(prompt), int), np.ones(len(prompt), bool))
    out = ctx.decode(batch)
    prompt_logits = out.logits.copy()
    step_logits, ids = [], []
    row = prompt_logits[-1]
    for i in range(steps):
        t = int(row.argmax())
        ids.append(t)
        row = ctx.decode(Batch.for_sequence([t], len(prompt) + i, 0)).logits[0].copy()
        step_logits.append(row)
    ctx.free()
    return prompt_logits, step_logits, ids


def cmd_compare(args) -> dict:
    path = model_path(args.preset, args.wtype)
    rng = np.random.default_rng(0)
    cpu = Engine(path, n_threads=0)
    prompt = rng.integers(300, cpu.model.hparams.n_vocab, 64).tolist()
    c_prompt, c_steps, c_ids = greedy_run(cpu, prompt, 16)
    cpu.close()
    gpu = cuda_engine(path)
    g_prompt, g_steps, g_ids = greedy_run(gpu, prompt, 16)
    gpu.close()

    def stats(a: np.ndarray, b: np.ndarray) -> dict:
        a2, b2 = np.atleast_2d(a).astype(np.float64), np.atleast_2d(b).astype(np.float64)
        top2 = np.sort(b2, axis=1)[:, -2:]
        agree = a2.argmax(1) == b2.argmax(1)
        return {"rel_err": float(np.linalg.norm(a2 - b2) / np.linalg.norm(b2)),
                "max_abs": float(np.abs(a2 - b2).max()),
                "argmax_agree": float(agree.mean()),
                "gap_where_disagree": [float(g) for g in (top2[:, 1] - top2[:, 0])[~agree]]}

    res = {"preset": args.preset, "wtype": args.wtype,
           "prompt_rows": stats(g_prompt, c_prompt),
           "greedy_steps_same_ids": g_ids == c_ids, "cpu_ids": c_ids, "cuda_ids": g_ids}
    first_diff = next((i for i, (a, b) in enumerate(zip(g_ids, c_ids)) if a != b), None)
    n = len(c_ids) if first_diff is None else first_diff  # logits are comparable while the tokens agree
    if n:
        res["greedy_steps"] = stats(np.stack(g_steps[:n]), np.stack(c_steps[:n]))
    print(json.dumps(res, indent=1))
    return res


def weight_bytes_per_step(engine: Engine) -> int:
    """Bytes of weights one decode step reads: every stored tensor once, except the embedding
    table when it is not also the output matrix (only its rows are looked up)."""
    w = engine.weights
    seen, total = set(), 0
    for name, t in w.tensors.items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        if name == "token_embd" and w.tensors.get("output") is not t:
            continue
        total += t.nbytes
    return total


def cmd_decode(args) -> dict:
    path = model_path(args.preset, args.wtype)
    engine = cuda_engine(path)
    hp = engine.model.hparams
    batches = [int(b) for b in args.batches.split(",")]
    bmax = max(batches)
    ctx = engine.new_context(256 * bmax, bmax, n_batch=max(64 * bmax, 512), n_ubatch=512)
    step_bytes = weight_bytes_per_step(engine)
    res: dict = {"preset": args.preset, "wtype": args.wtype, "params_M": engine.model.n_params() / 1e6,
                 "device": engine.backends[0].device_info().description,
                 "weights_MiB": sum(engine.weights.bytes_per_backend.values()) / 2**20,
                 "weight_bytes_per_step": step_bytes, "bandwidth_B_s": args.bandwidth,
                 "roofline_step_us": step_bytes / args.bandwidth * 1e6, "batches": {}}
    rng = np.random.default_rng(0)
    sampler = BatchSampler(hp.n_vocab, bmax, 1)
    greedy = SamplingParams(temperature=0.0)
    for b in batches:
        row: dict = {}
        for mode in ("host", "device"):
            ctx.clear()
            seqs = list(range(b))
            prompts = [rng.integers(300, hp.n_vocab, 32).tolist() for _ in seqs]
            out = ctx.decode(Batch.concat([Batch.for_sequence(p, 0, s) for p, s in zip(prompts, seqs)]))
            samplers = [SequenceSampler(greedy) for _ in seqs]
            ids = sampler.sample(out.logits, samplers).ids.copy()
            pos = np.full(b, 32, dtype=np.int32)

            def step(ids: np.ndarray) -> np.ndarray:
                batch = Batch(ids, pos, np.array(seqs), np.ones(b, bool))
                if mode == "host":
                    return sampler.sample(ctx.decode(batch).logits, samplers).ids.copy()
                o = ctx.decode(batch, sampler.pack(samplers), sampler.device_spec())
                return sampler.unpack(o.sampled).ids.copy()

            for _ in range(3):  # warm-up: plans bound, scratch grown
                ids = step(ids)
                pos += 1
            t0 = time.perf_counter()
            for _ in range(args.steps):
                ids = step(ids)
                pos += 1
            dt = (time.perf_counter() - t0) / args.steps
            row[f"{mode}_sampling_tok_s"] = b / dt
            row[f"{mode}_sampling_step_ms"] = dt * 1e3
        row["roofline_tok_s"] = b / (res["roofline_step_us"] * 1e-6)
        row["share_of_roofline"] = row["device_sampling_tok_s"] / row["roofline_tok_s"]
        res["batches"][b] = row
    engine.close()
    print(f"# {res['device']}; {args.preset} {args.wtype}: {res['params_M']:.0f} M weights, "
          f"{step_bytes / 2**20:.1f} MiB read per step; at {args.bandwidth / 1e12:.1f} TB/s that is "
          f"{res['roofline_step_us']:.1f} us per step")
    print("batch | host sampling tok/s | device sampling tok/s | step ms (device) | roofline tok/s | share")
    for b, r in res["batches"].items():
        print(f"{b} | {r['host_sampling_tok_s']:.1f} | {r['device_sampling_tok_s']:.1f} | "
              f"{r['device_sampling_step_ms']:.2f} | {r['roofline_tok_s']:.0f} | {r['share_of_roofline']:.3f}")
    return res


def _free_port() -> int:
    import socket  # noqa: PLC0415
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cmd_split(args) -> dict:
    """The server with its first layers on an rpc_server --device CUDA0 and the rest on its CPU,
    both traced, serving greedy completions; the merged trace has one row per decode step."""
    import signal  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415
    path = model_path(args.preset, args.wtype)
    os.makedirs(args.out, exist_ok=True)
    peer_trace = os.path.join(args.out, "trace-rpc-server.jsonl")
    server_trace = os.path.join(args.out, "trace-server.jsonl")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    peer = subprocess.Popen([sys.executable, "-m", "pyllama.rpc_server", "--port", "0", "--device", "CUDA0",
                             "--trace", peer_trace], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env)
    server = None
    texts = []
    try:
        line = peer.stderr.readline()
        if "listening on" not in line:
            raise SystemExit(f"rpc_server did not start: {line}{peer.stderr.read()}")
        endpoint = line.rsplit(" ", 1)[1].strip()
        port = _free_port()
        server = subprocess.Popen([sys.executable, "-m", "pyllama.server", "-m", path, "--port", str(port),
                                   "--rpc", endpoint, "--device", "RPC0,CPU", "--trace", server_trace],
                                  stdout=subprocess.DEVNULL, stderr=open(os.path.join(args.out, "server.log"), "w"),
                                  env=env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as rep:
                    if rep.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start (see {args.out}/server.log)")
            time.sleep(0.2)
        for prompt in ("The quick brown fox", "Once upon a time"):
            body = json.dumps({"prompt": prompt, "n_predict": args.n, "temperature": 0}).encode()
            req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as rep:
                texts.append(json.loads(rep.read())["content"])
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
        peer.terminate()
        peer.wait(60)
    merged = subprocess.run([sys.executable, os.path.join(ROOT, "trace_tools", "merge.py"), server_trace,
                             peer_trace, "--chrome", os.path.join(args.out, "split.chrome.json"), "--summary",
                             "--csv", os.path.join(args.out, "split-steps.csv")],
                            capture_output=True, text=True, env=env)
    with open(os.path.join(args.out, "split-summary.txt"), "w") as fh:
        fh.write(merged.stdout + merged.stderr)
    spans = []
    with open(peer_trace) as fh:
        for line in fh:
            ev = json.loads(line)
            if ev.get("c") == "dev":
                spans.append(ev)
    res = {"texts": texts, "gpu_spans": len(spans),
           "gpu_busy_us_per_span": float(np.mean([e["t1"] - e["t0"] for e in spans])) if spans else None,
           "merge_rc": merged.returncode}
    print(merged.stdout + merged.stderr)
    print(json.dumps(res))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["compare", "decode", "split"])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--wtype", default="f16", help="weight type of the test model (f32, f16, bf16, q8_0, q4_0)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="device memory bandwidth, bytes/s (H200: 4.8e12)")
    ap.add_argument("-n", type=int, default=16, help="tokens per completion of the split run")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "cuda"), help="output folder of the split run")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    res = {"compare": cmd_compare, "decode": cmd_decode, "split": cmd_split}[args.command](args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
