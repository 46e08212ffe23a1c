"""Slot save and restore (`--slot-save-path`): what a restore costs against computing the prompt.

    python bench/slot_restore.py [--model PATH | --preset medium --type q4_k_m] [--lengths 512,2048]
        [-t 1] [--legs 3] [--peers DIR] [--json OUT]

Per arm one server on the same GGUF file (`-np 1 -c LONGEST+64 --slot-save-path TMP`), and per leg
and prompt length: a prompt of that many random token ids with n_predict 1 (its `prompt_ms`), POST
/slots/0?action=save, erase, restore, then the same prompt again, which must find it cached
(`cache_n`). Arms: pyllama (the file's KV rows written back), pyllama given the same tokens in a
tokens-only file of the first format (computed into the slot on restore, as before KV rows were
saved), and with --peers llama.cpp's llama-server. Printed per arm and length: prompt ms, save ms,
restore ms (means over legs), file MiB, and prompt ms / restore ms. Servers bind 127.0.0.1 on free
ports and are stopped here; the files go to a temporary folder that is removed.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from peers import Peers  # noqa: E402
from pipeline_cells import LlamaServer, add_server_bench_options, model_and_vocab  # noqa: E402
from server_util import ServerProcess  # noqa: E402


def post(url: str, path: str, body: dict, timeout: float = 600) -> dict:
    """The JSON answer of a POST to a llama-server compatible server; anything but 200 raises."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def tokens_only(src: str, dst: str) -> None:
    """The first format's file (tokens only) holding the tokens of pyllama's file `src`."""
    from pyllama.server import slot_file  # noqa: PLC0415

    with open(src, "rb") as f:
        data = f.read()
    at = len(slot_file.MAGIC)
    end = data.index(b"\n", at)
    header = json.loads(data[at:end])
    n = header["n_tokens"]
    head = {"n_vocab": header["n_vocab"], "model": header["model"], "n_tokens": n}
    with open(dst, "wb") as f:
        f.write(slot_file.MAGIC_V1 + json.dumps(head).encode() + b"\n" + data[end + 1:end + 1 + 4 * n])


def one(url: str, folder: str, prompt: list[int], name: str, v1: bool) -> dict:
    first = post(url, "/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True,
                                      "id_slot": 0})
    saved = post(url, "/slots/0?action=save", {"filename": name})
    size = os.path.getsize(os.path.join(folder, name))
    if v1:
        tokens_only(os.path.join(folder, name), os.path.join(folder, "v1-" + name))
        name = "v1-" + name
    post(url, "/slots/0?action=erase", {})
    restored = post(url, "/slots/0?action=restore", {"filename": name})
    again = post(url, "/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True,
                                      "id_slot": 0})
    post(url, "/slots/0?action=erase", {})
    return {"prompt_ms": first["timings"]["prompt_ms"], "save_ms": saved["timings"]["save_ms"],
            "restore_ms": restored["timings"]["restore_ms"], "file_bytes": size,
            "n_restored": restored["n_restored"], "cache_n_after": again["timings"].get("cache_n", 0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_bench_options(ap, legs=3)
    ap.add_argument("--lengths", default="512,2048")
    args = ap.parse_args()
    path, vocab = model_and_vocab(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(args.seed)
    prompts = {n: [1] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in lengths}
    arms = [("pyllama", "pyllama", False), ("pyllama, tokens-only file", "pyllama", True)]
    peers = Peers.find(args.peers)
    if peers is not None:
        arms.append(("llama-server", "llama", False))
    folder = tempfile.mkdtemp(prefix="slot-restore-")
    common = ["-np", "1", "-c", str(-(-(max(lengths) + 64) // 256) * 256), "-t", str(args.threads),
              "--slot-save-path", folder, "--cache-ram", "0"]
    results: dict[tuple[str, int], list[dict]] = {(a, n): [] for a, _, _ in arms for n in lengths}
    print(f"# {os.path.basename(path)}: prompts of {lengths} tokens, -t {args.threads}, {args.legs} legs", flush=True)
    try:
        for leg in range(args.legs):
            for arm, kind, v1 in arms:
                server = (ServerProcess(path, *common).wait_ready(300) if kind == "pyllama"
                          else LlamaServer(peers, path, common, 300))
                try:
                    for n in lengths:
                        r = one(server.url, folder, prompts[n], f"s{n}.bin", v1)
                        if r["n_restored"] != n or r["cache_n_after"] < n - 1:
                            raise RuntimeError(f"{arm}: restored {r['n_restored']} of {n}, then {r['cache_n_after']} "
                                               "cached")
                        results[(arm, n)].append(r)
                        print(f"leg {leg + 1} {arm} {n}: prompt {r['prompt_ms']:.1f} ms, save {r['save_ms']:.1f} ms, "
                              f"restore {r['restore_ms']:.1f} ms, file {r['file_bytes'] / 2**20:.1f} MiB", flush=True)
                finally:
                    server.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if peers is not None:
            peers.close()
    print("\narm | prompt tokens | prompt ms | save ms | restore ms [min..max] | file MiB | prompt ms / restore ms")
    for arm, _, _ in arms:
        for n in lengths:
            rs = results[(arm, n)]
            p = statistics.mean(r["prompt_ms"] for r in rs)
            restore = [r["restore_ms"] for r in rs]
            print(f"{arm} | {n} | {p:.1f} | {statistics.mean(r['save_ms'] for r in rs):.1f} | "
                  f"{statistics.mean(restore):.1f} [{min(restore):.1f}..{max(restore):.1f}] | "
                  f"{rs[0]['file_bytes'] / 2**20:.1f} | {p / statistics.mean(restore):.1f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": {f"{a}|{n}": v for (a, n), v in results.items()}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
