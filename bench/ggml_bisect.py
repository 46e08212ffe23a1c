"""Which layer's CPU kernels leave ggml's bits: the first k blocks on llama.cpp's rpc-server, the rest
on this CPU, against the whole model on this CPU (needs --peers).

    python bench/ggml_bisect.py --peers DIR --model M.gguf [--layers 1,2,4,8] [--prompt TEXT] [--steps 3]

pyllama's graph is the same in every run; only the device that computes each block changes. The
peer computes its blocks with ggml's own kernels (through the lowering, backend/ggml/lower.py), so
where the logits of a split equal the unsplit run's bit for bit, pyllama's CPU kernels gave ggml's
bits for those blocks; the first k whose logits differ names the block (k - 1) to look into. On a
model that amplifies a last-bit difference (a quantized one: the next activation rounds to other
8-bit blocks) a bit-level comparison is the only one that localises it. Each row prints, per step
(the prompt, then greedy decode steps of the unsplit run's tokens), the logits that differ and
the largest difference. Exits 1 when any split differs.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from peers import Peers  # noqa: E402
from pipeline_cells import GgmlRpcPeer  # noqa: E402
from pyllama.backend.cpu import CPUBackend  # noqa: E402
from pyllama.backend.ggml.backend import GGMLBackend, ggml_connection  # noqa: E402
from pyllama.ir.tensor import DType  # noqa: E402
from pyllama.runtime.context import Batch  # noqa: E402
from pyllama.runtime.engine import Engine  # noqa: E402


def run(model: str, peer: GgmlRpcPeer | None, k: int, n_blocks: int, prompt: str, steps: int,
        tokens: list[int] | None) -> tuple[list[np.ndarray], list[int]]:
    """The logits of the prompt and `steps` decode steps (of `tokens`, or greedy), with the first k
    blocks on the peer (k = 0: all on this CPU)."""
    if k == 0:
        engine = Engine(model, n_threads=1, backends=[CPUBackend(1)])
    else:
        engine = Engine(model, n_threads=1, backends=[GGMLBackend(ggml_connection(peer.endpoint), 0, "RPC0"),
                                                      CPUBackend(1)],
                        tensor_split=[k, n_blocks - k] if k < n_blocks else [1, 0])
    try:
        ctx = engine.new_context(512, 1, type_k=DType.F32, type_v=DType.F32)
        ids = engine.tokenizer.encode(prompt, add_special=True)
        out = [ctx.decode(Batch.for_sequence(ids, 0, 0)).logits[-1].copy()]
        chosen: list[int] = []
        pos = len(ids)
        for s in range(steps):
            t = tokens[s] if tokens is not None else int(out[-1].argmax())
            chosen.append(t)
            out.append(ctx.decode(Batch.for_sequence([t], pos, 0)).logits[-1].copy())
            pos += 1
        return out, chosen
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", required=True, help="llama.cpp's folder (bin/ggml-rpc-server)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", default="1,2,4,8", help="block counts to put on the peer (comma-separated)")
    ap.add_argument("--prompt", default="Q: What is 2+2?\nA:")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    peers = Peers.find(args.peers)
    if peers is None:
        print(f"ggml_bisect: no llama.cpp programs under {args.peers}/bin", file=sys.stderr)
        return 2
    from pyllama.models.model import Model  # noqa: PLC0415
    n_blocks = Model(args.model).hparams.n_layer
    peer = GgmlRpcPeer(peers, 1)
    bad = False
    try:
        base, tokens = run(args.model, None, 0, n_blocks, args.prompt, args.steps, None)
        for k in (int(v) for v in args.layers.split(",")):
            got, _ = run(args.model, peer, min(k, n_blocks), n_blocks, args.prompt, args.steps, tokens)
            differ = [int((a.view(np.uint32) != b.view(np.uint32)).sum()) for a, b in zip(base, got)]
            worst = [float(np.abs(a - b).max()) for a, b in zip(base, got)]
            bad |= any(differ)
            print(f"first {k} block(s) on the peer: logits differing per step {differ}, "
                  f"max |diff| {['%.2e' % w for w in worst]}", flush=True)
    finally:
        peer.stop()
        peers.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
