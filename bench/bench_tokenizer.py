"""Tokenizer speed: a cold 4 KB encode per vocabulary, and building the 50k-token BPE.

    python bench/bench_tokenizer.py [--reps 3]

Uses llama.cpp's test vocabularies in tests/data/vocab. For each (SPM llama, GPT-2 BPE) it encodes
two 4 KB texts on a freshly built tokenizer (nothing of the text cached yet): the vocabulary's
test inputs repeated, and ~600 distinct made-up words (no help from a word cache). It also builds
the GPT-2 tokenizer from its metadata. Each figure is the best of --reps, printed with the budget
the server's latency needs (a 4 KB prompt tokenized in under 100 ms, a model's tokenizer built in
under 1 s) and the ratio to it; exit status 1 when a figure is over its budget.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pyllama.models.gguf_file import read_metadata  # noqa: E402
from pyllama.tokenizer import load_tokenizer  # noqa: E402

VOCAB_DIR = ROOT / "tests" / "data" / "vocab"
SEPARATOR = "\n__ggml_vocab_test__\n"
VOCABS = ["ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf"]
ENCODE_BUDGET_S = 0.1
BUILD_BUDGET_S = 1.0


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def samples(name: str) -> dict[str, str]:
    inputs = (VOCAB_DIR / (name + ".inp")).read_text(encoding="utf-8").split(SEPARATOR)
    text = "".join(inputs)
    text = (text * (4096 // len(text.encode()) + 1)).encode()[:4096].decode("utf-8", "ignore")
    words = " ".join(f"w{i * 7919 % 100003}x{i}" for i in range(600)).encode()[:4096].decode()
    return {"test inputs": text, "distinct words": words}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    over = 0
    print(f"{'what':<62} {'best ms':>9} {'budget ms':>10} {'of budget':>10}")

    def row(what: str, best: float, budget: float) -> None:
        nonlocal over
        over += best > budget
        print(f"{what:<62} {best * 1e3:>9.1f} {budget * 1e3:>10.0f} {best / budget:>10.2f}")

    for name in VOCABS:
        md = read_metadata(VOCAB_DIR / name)
        for label, text in samples(name).items():
            best = min(timed(load_tokenizer(md, str(VOCAB_DIR / name)).encode, text) for _ in range(args.reps))
            row(f"{name}: 4 KB cold encode, {label}", best, ENCODE_BUDGET_S)
    md = read_metadata(VOCAB_DIR / "ggml-vocab-gpt-2.gguf")
    best = min(timed(load_tokenizer, md) for _ in range(args.reps))
    row(f"build the {len(md['tokenizer.ggml.tokens'])}-token BPE", best, BUILD_BUDGET_S)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
