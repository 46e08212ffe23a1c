"""python -m pyllama.generate end to end: greedy text and token ids, determinism, -n semantics."""
from __future__ import annotations

import os
import subprocess
import sys

from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.generate import generate_tokens
from pyllama.batching.sampling import SamplingParams


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyllama.generate", *args], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def test_greedy_tokens_match_the_engine(tiny_model):
    proc = run("-m", tiny_model, "-p", "The cat sat on", "-n", "12", "--temp", "0", "--tokens", "--ignore-eos", "-t", "1")
    assert proc.returncode == 0, proc.stderr
    ids = [int(x) for x in proc.stdout.split()]
    assert len(ids) == 12
    engine = Engine(tiny_model, n_threads=1)
    ctx = engine.new_context(512)
    prompt = engine.tokenizer.encode("The cat sat on")
    # independent greedy loop on the engine: argmax of each step's logits
    out = ctx.decode(Batch.for_sequence(prompt, 0, 0))
    expect = []
    for i in range(12):
        t = int(out.logits[0].argmax())
        expect.append(t)
        out = ctx.decode(Batch.for_sequence([t], len(prompt) + i, 0))
    assert ids == expect


def test_text_output_is_the_detokenized_ids(tiny_model):
    a = run("-m", tiny_model, "-p", "Hello", "-n", "10", "--temp", "0", "--ignore-eos")
    b = run("-m", tiny_model, "-p", "Hello", "-n", "10", "--temp", "0", "--ignore-eos", "--tokens")
    assert a.returncode == 0 and b.returncode == 0
    engine = Engine(tiny_model, n_threads=1)
    assert a.stdout.rstrip("\n") == engine.tokenizer.decode([int(x) for x in b.stdout.split()])


def test_seeded_sampling_is_reproducible(tiny_model):
    args = ("-m", tiny_model, "-p", "Once", "-n", "16", "--temp", "1.0", "--seed", "42", "--tokens", "--ignore-eos")
    first, second = run(*args), run(*args)
    assert first.returncode == 0 and first.stdout == second.stdout
    other = run(*args[:-4], "--seed", "7", "--tokens", "--ignore-eos")
    assert other.stdout != first.stdout


def test_flags_read_from_environment(tiny_model):
    proc = run("-p", "Hi", "--temp", "0", "--tokens", "--ignore-eos",
               env={"PYLLAMA_ARG_MODEL": tiny_model, "PYLLAMA_ARG_N_PREDICT": "3"})
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.split()) == 3
    proc = run("-p", "Hi", "-n", "2", "--temp", "0", "--tokens", "--ignore-eos",
               env={"PYLLAMA_ARG_MODEL": tiny_model, "PYLLAMA_ARG_N_PREDICT": "5"})
    assert len(proc.stdout.split()) == 2  # the command line wins


def test_unlimited_stops_at_full_context(tiny_model):
    engine = Engine(tiny_model, n_threads=1)
    ctx = engine.new_context(24)
    prompt = engine.tokenizer.encode("abc")
    out = list(generate_tokens(ctx, engine.tokenizer, prompt, -1, SamplingParams(temperature=0), ignore_eos=True))
    # every position of the context is filled; the token sampled from the last one is still emitted
    assert len(out) == 24 - len(prompt) + 1


def test_n_zero_generates_nothing(tiny_model):
    proc = run("-m", tiny_model, "-p", "Hi", "-n", "0", "--tokens")
    assert proc.returncode == 0 and proc.stdout.strip() == ""


def test_on_off_flags_read_from_environment(monkeypatch):
    from pyllama.util.cli import Parser
    import argparse

    def parse(*argv):
        p = Parser(prog="x")
        p.add_argument("--thing", action=argparse.BooleanOptionalAction, default=None)
        return p.parse_args(list(argv)).thing

    assert parse() is None
    monkeypatch.setenv("PYLLAMA_ARG_THING", "0")
    assert parse() is False
    monkeypatch.setenv("PYLLAMA_ARG_THING", "on")
    assert parse() is True
    assert parse("--no-thing") is False  # the command line wins
