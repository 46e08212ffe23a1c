"""Decode and prompt throughput of the engine per weight type, and llama.cpp's on the same files.

    python bench/bench_decode.py [--presets medium] [--types f32,f16,q8_0,q4_0,q4_k_m,q5_k_m]
        [--model PATH ...] [--threads 1,2] [--batches 1,8,32] [--steps 16] [--prompt 512]
        [--legs 1] [--peers DIR | --no-peers] [--json OUT]

Every cell runs in a fresh process, so its resident memory is its own: the models made with
pyllama.models.make (cached under bench/out/models) or given with --model, at each thread count.
A cell measures tokens/s of batched decode at each batch size (B sequences, one token each per
step, greedy sampling included), prompt tokens/s for a --prompt-token prompt, resident memory after
loading and after the run, the weights as stored, the weight bytes a decode step reads (every
weight but the embedding table, which is read by rows; all of it when it is also the output
matrix), and the share of a decode step spent in Python rather than in kernels. "model RSS" is what loading
the model added to the process (resident memory after loading minus before: the metadata, the
tokenizer, the weights' pages and copies), "weights RSS" what loading the weights alone added
(after minus before Engine.load(): the weights' pages read in place and their copies), each set
against the file's size.

Given a folder of llama.cpp's programs (--peers DIR or $PYLLAMA_PEERS: a folder with
bin/llama-batched-bench, e.g. a llama.cpp build directory), `llama-batched-bench` runs on the same file with the same threads right after
each pyllama cell, and the table prints pyllama / llama.cpp. A peer that cannot run on this
machine is reported with its reason and the column is left empty. Cells of a leg run in the same
order; with --legs N the figure is the mean over the legs and the spread is printed beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from peers import Peers  # noqa: E402

DEFAULT_TYPES = "f32,f16,q8_0,q4_0,q4_k_m,q5_k_m"


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def model_path(preset: str, wtype: str) -> str:
    from pyllama.models.make import make_model  # noqa: PLC0415
    out = os.path.join(HERE, "out", "models")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{preset}-{wtype}.gguf")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        make_model(preset, path, wtype=wtype)
        print(f"# made {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def file_figures(path: str) -> dict:
    """Tensor bytes in the file, and the weight bytes one decode step reads."""
    from pyllama.models.gguf_file import GGUFFile  # noqa: PLC0415
    f = GGUFFile(path)
    total = sum(int(t.raw.nbytes) for t in f.tensors.values())
    embd = f.tensors.get("token_embd.weight")
    tied = "output.weight" not in f.tensors
    per_step = total - (int(embd.raw.nbytes) if embd is not None and not tied else 0)
    types: dict[str, int] = {}
    for t in f.tensors.values():
        if len(t.shape) > 1:
            types[t.qtype.name] = types.get(t.qtype.name, 0) + 1
    return {"file_MiB": os.path.getsize(path) / 2**20, "tensor_MiB": total / 2**20,
            "read_per_step_MiB": per_step / 2**20, "weight_types": types}


class KernelClock:
    """Wall time inside the CPU backend's bound kernel calls (the rest of a step is Python)."""

    def __init__(self) -> None:
        self.total = 0.0

    def install(self) -> None:
        from pyllama.backend import cpu as cpu_backend  # noqa: PLC0415
        clock = self
        orig_prepare = cpu_backend.CPUBackend._prepare

        def timed_prepare(backend, graph):
            def timed(step):
                def run() -> None:
                    t0 = time.perf_counter()
                    step()
                    clock.total += time.perf_counter() - t0
                return run
            return [timed(s) for s in orig_prepare(backend, graph)]

        cpu_backend.CPUBackend._prepare = timed_prepare  # type: ignore[method-assign]


def run_cell(path: str, batches: list[int], n_threads: int, steps: int, n_prompt: int) -> dict:
    """One model at one thread count, in this process (the parent runs it as a child)."""
    from pyllama.runtime.context import Batch  # noqa: PLC0415
    from pyllama.runtime.engine import Engine  # noqa: PLC0415
    from pyllama.batching.sampling import BatchSampler, SamplingParams, SequenceSampler  # noqa: PLC0415
    clock = KernelClock()
    clock.install()
    rss0 = rss_mib()
    engine = Engine(path, n_threads=n_threads, load=False)  # metadata and tokenizer, no weights yet
    rss_meta = rss_mib()
    engine.load()
    hp = engine.model.hparams
    bmax = max(batches)
    ctx_per_seq = max(n_prompt, 32 + steps + 8)
    ctx = engine.new_context(ctx_per_seq * bmax, bmax, n_batch=max(32 * bmax, n_prompt), n_ubatch=512)
    res: dict = {"params_M": engine.model.n_params() / 1e6,
                 "weights_MiB": sum(engine.weights.bytes_per_backend.values()) / 2**20,
                 "kv_MiB": sum(ctx.kv_bytes.values()) / 2**20,
                 "rss_start_MiB": rss0, "rss_meta_MiB": rss_meta, "rss_loaded_MiB": rss_mib()}
    rng = np.random.default_rng(0)
    prompt = rng.integers(300, hp.n_vocab, n_prompt).tolist()
    times = []
    for _ in range(3):  # the first run warms up
        ctx.seq_rm(0)
        t0 = time.perf_counter()
        ctx.decode(Batch.for_sequence(prompt, 0, 0))
        times.append(time.perf_counter() - t0)
    ctx.seq_rm(0)
    res["pp_tok_s"] = n_prompt / min(times[1:])
    sampler = BatchSampler(hp.n_vocab, bmax)
    greedy = SamplingParams(temperature=0.0)
    for b in batches:
        ctx.clear()
        seqs = list(range(b))
        prompts = [rng.integers(300, hp.n_vocab, 32).tolist() for _ in seqs]
        out = ctx.decode(Batch.concat([Batch.for_sequence(p, 0, s) for p, s in zip(prompts, seqs)]))
        samplers = [SequenceSampler(greedy) for _ in seqs]
        pos = np.full(b, 32, dtype=np.int32)
        ids = sampler.sample(out.logits, samplers).ids.copy()
        out = ctx.decode(Batch(ids, pos, seqs, np.ones(b, bool)))  # warm-up step
        pos += 1
        clock.total = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            k0 = time.perf_counter()
            ids = sampler.sample(out.logits, samplers).ids.copy()
            clock.total += time.perf_counter() - k0  # the sampling kernel counts as kernel time
            out = ctx.decode(Batch(ids, pos, seqs, np.ones(b, bool)))
            pos += 1
        dt = time.perf_counter() - t0
        res[f"tg_b{b}_tok_s"] = b * steps / dt
        res[f"tg_b{b}_python_share"] = max(0.0, 1.0 - clock.total / dt)
    res["rss_end_MiB"] = rss_mib()
    engine.close()
    return res


def child(path: str, batches: list[int], n_threads: int, steps: int, n_prompt: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--cell", path, "--batches", ",".join(map(str, batches)),
           "-t", str(n_threads), "--steps", str(steps), "--prompt", str(n_prompt)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


_BB_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|([^\n]*)$", re.M)


def llama_cpp_cell(peers: Peers, path: str, batches: list[int], n_threads: int, steps: int,
                   n_prompt: int) -> dict:
    """llama-batched-bench on the same file: decode tok/s per batch (S_TG) and prompt tok/s (S_PP)."""
    ctx = max(n_prompt + 8, (32 + steps + 8) * max(batches))
    try:
        tg = peers.run("llama-batched-bench", "-m", path, "-t", str(n_threads), "-c", str(ctx), "-b", "2048",
                       "-ub", "512", "-npp", "32", "-ntg", str(steps), "-npl", ",".join(map(str, batches)))
        pp = peers.run("llama-batched-bench", "-m", path, "-t", str(n_threads), "-c", str(ctx), "-b", "2048",
                       "-ub", "512", "-npp", str(n_prompt), "-ntg", "1", "-npl", "1")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        reason = str(exc).splitlines()[0]
        if "exited -4" in reason:
            reason += " (SIGILL: built for instructions this CPU lacks)"
        return {"error": reason}
    out: dict = {}
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    for m in _BB_ROW.finditer(tg):
        cols = [c.strip() for c in m.group(5).split("|")]
        out[f"tg_b{int(m.group(3))}_tok_s"] = float(cols[3])
    for m in _BB_ROW.finditer(pp):
        cols = [c.strip() for c in m.group(5).split("|")]
        out["pp_tok_s"] = float(cols[1])
    return out


def _fmt(x: Optional[float], spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def _mean_spread(values: list[float]) -> tuple[Optional[float], str]:
    if not values:
        return None, ""
    mean = sum(values) / len(values)
    return mean, (f" [{min(values):.0f}-{max(values):.0f}]" if len(values) > 1 else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="medium", help="presets made by pyllama.models.make, comma-separated")
    ap.add_argument("--types", default=DEFAULT_TYPES, help="weight types of the made models, comma-separated")
    ap.add_argument("--model", action="append", default=[], help="a GGUF file to bench as well (repeatable)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("-t", dest="one_thread", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per batch size")
    ap.add_argument("--prompt", type=int, default=512, help="prompt length for prompt processing")
    ap.add_argument("--legs", type=int, default=1, help="interleaved repetitions of every cell")
    ap.add_argument("--peers", help="llama.cpp's programs (a folder with bin/llama-batched-bench); default $PYLLAMA_PEERS")
    ap.add_argument("--no-peers", action="store_true", help="skip llama.cpp")
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    if args.cell:
        print(json.dumps(run_cell(args.cell, batches, args.one_thread or 0, args.steps, args.prompt)))
        return 0
    threads = [int(x) for x in args.threads.split(",")]
    models = [(f"{p}-{t}", model_path(p, t)) for p in args.presets.split(",") if p for t in args.types.split(",") if t]
    models += [(os.path.basename(m), m) for m in args.model]
    peers = None if args.no_peers else Peers.find(args.peers)
    files = {name: file_figures(path) for name, path in models}
    records: list[dict] = []
    for leg in range(args.legs):
        for name, path in models:
            for nt in threads:
                rec = {"leg": leg, "model": name, "threads": nt, "pyllama": child(path, batches, nt, args.steps, args.prompt)}
                if peers is not None:
                    rec["llama.cpp"] = llama_cpp_cell(peers, path, batches, nt, args.steps, args.prompt)
                records.append(rec)
                print(f"# leg {leg} {name} -t {nt}: {json.dumps(rec)}", flush=True)
    print(f"# machine: {os.cpu_count()} cores; llama.cpp: "
          f"{peers.bin if peers else 'not found'}; {args.legs} leg(s); decode steps {args.steps}, prompt {args.prompt}")
    metrics = ["pp_tok_s"] + [f"tg_b{b}_tok_s" for b in batches]
    print("\nmodel | t | " + " | ".join(m.replace("_tok_s", "") + " tok/s (x llama.cpp)" for m in metrics)
          + " | python share b1")
    for name, _ in models:
        for nt in threads:
            cells = [r for r in records if r["model"] == name and r["threads"] == nt]
            line = [name, str(nt)]
            for m in metrics:
                ours, spread = _mean_spread([r["pyllama"][m] for r in cells if m in r["pyllama"]])
                theirs, _ = _mean_spread([r["llama.cpp"][m] for r in cells if m in r.get("llama.cpp", {})])
                ratio = f" ({ours / theirs:.2f}x)" if ours and theirs else ""
                line.append(f"{_fmt(ours)}{spread}{ratio}")
            share, _ = _mean_spread([r["pyllama"]["tg_b1_python_share"] * 100 for r in cells
                                     if "tg_b1_python_share" in r["pyllama"]])
            line.append(_fmt(share) + "%")
            errors = {r["pyllama"].get("error") or r.get("llama.cpp", {}).get("error") for r in cells} - {None}
            print(" | ".join(line) + (f"  # {'; '.join(errors)}" if errors else ""))
    print("\nmodel | weight types | file MiB | tensor MiB | read per step MiB | stored weights MiB | KV MiB | "
          "RSS loaded MiB | RSS end MiB | model RSS MiB | model RSS / file | weights RSS MiB | weights RSS / file")
    for name, _ in models:
        f = files[name]
        cells = [r["pyllama"] for r in records if r["model"] == name and "rss_end_MiB" in r["pyllama"]]
        if not cells:
            continue
        c = cells[-1]
        types = ",".join(f"{k}x{v}" for k, v in sorted(f["weight_types"].items()))
        print(f"{name} | {types} | {f['file_MiB']:.1f} | {f['tensor_MiB']:.1f} | {f['read_per_step_MiB']:.1f} | "
              f"{c['weights_MiB']:.1f} | {c['kv_MiB']:.1f} | {c['rss_loaded_MiB']:.0f} | {c['rss_end_MiB']:.0f} | "
              f"{c['rss_loaded_MiB'] - c['rss_start_MiB']:.0f} | "
              f"{(c['rss_loaded_MiB'] - c['rss_start_MiB']) / f['file_MiB']:.2f} | "
              + (f"{c['rss_loaded_MiB'] - c['rss_meta_MiB']:.0f} | "
                 f"{(c['rss_loaded_MiB'] - c['rss_meta_MiB']) / f['file_MiB']:.2f}" if "rss_meta_MiB" in c else "- | -"))
    base: dict[int, Optional[dict]] = {}
    for nt in threads:  # the f32 cells' means, the baseline of the "vs f32" lines
        f32 = [r["pyllama"] for r in records if r["model"].endswith("-f32") and r["threads"] == nt
               and "tg_b1_tok_s" in r["pyllama"]]
        base[nt] = {f"tg_b{b}_tok_s": float(np.mean([c[f"tg_b{b}_tok_s"] for c in f32])) for b in batches} if f32 else None
    for name, _ in models:
        for nt in threads:
            if base[nt] is None or name.endswith("-f32"):
                continue
            cells = [r["pyllama"] for r in records if r["model"] == name and r["threads"] == nt
                     and "tg_b1_tok_s" in r["pyllama"]]
            if cells:
                parts = [f"b{b} {np.mean([c[f'tg_b{b}_tok_s'] for c in cells]) / base[nt][f'tg_b{b}_tok_s']:.2f}x"
                         for b in batches]
                print(f"# {name} -t {nt} vs f32: " + ", ".join(parts))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"files": files, "records": records}, fh, indent=1)
    if peers is not None:
        peers.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
