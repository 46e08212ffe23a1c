"""Server metrics (pyllama.obs.metrics): llama-server's /metrics names, types and values."""
from __future__ import annotations

import math
import re
import threading

import pytest

from pyllama.obs.metrics import Metrics

COUNTERS = {
    "llamacpp:prompt_tokens_total", "llamacpp:prompt_seconds_total",
    "llamacpp:tokens_predicted_total", "llamacpp:tokens_predicted_seconds_total",
    "llamacpp:n_decode_total", "llamacpp:n_tokens_max", "llamacpp:n_preemptions_total",
    "llamacpp:n_context_shifts_total", "llamacpp:spec_decode_num_draft_tokens_total",
    "llamacpp:spec_decode_num_accepted_tokens_total", "llamacpp:spec_decode_num_drafts_total",
}
GAUGES = {
    "llamacpp:n_busy_slots_per_decode", "llamacpp:prompt_tokens_seconds",
    "llamacpp:predicted_tokens_seconds", "llamacpp:kv_cache_usage_ratio",
    "llamacpp:kv_cache_tokens", "llamacpp:requests_processing", "llamacpp:requests_deferred",
}

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(
    rf"^(?P<name>{_NAME})"
    r"(?:\{(?P<labels>[^}]*)\})?"
    r"[ \t]+(?P<value>\S+)"
    r"(?:[ \t]+(?P<ts>-?\d+))?$"
)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(?:,|$)')


def parse_prometheus(text: str):
    """A small parser of the text exposition format 0.0.4.

    Returns (samples, helps, types): samples is a list of (name, labels dict, float value).
    Raises AssertionError on any line it does not understand.
    """
    samples: list[tuple[str, dict, float]] = []
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    assert text.endswith("\n"), "exposition must end with a newline"
    for line in text.split("\n")[:-1]:
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] == "HELP":
                assert re.fullmatch(_NAME, parts[2]), line
                assert parts[2] not in helps, f"duplicate HELP: {line}"
                helps[parts[2]] = parts[3] if len(parts) > 3 else ""
            elif len(parts) >= 3 and parts[1] == "TYPE":
                assert len(parts) == 4 and parts[3] in (
                    "counter", "gauge", "histogram", "summary", "untyped"), line
                assert parts[2] not in types, f"duplicate TYPE: {line}"
                assert not any(s[0] == parts[2] for s in samples), f"TYPE after samples: {line}"
                types[parts[2]] = parts[3]
            continue
        m = _SAMPLE.match(line)
        assert m, f"unparseable sample line: {line!r}"
        labels: dict[str, str] = {}
        if m.group("labels"):
            rest = m.group("labels")
            pos = 0
            while pos < len(rest):
                lm = _LABEL.match(rest, pos)
                assert lm, f"bad labels in {line!r}"
                labels[lm.group(1)] = lm.group(2)
                pos = lm.end()
        raw = m.group("value")
        value = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}.get(raw)
        if value is None:
            value = float(raw)  # raises on garbage
        samples.append((m.group("name"), labels, value))
    return samples, helps, types


def render(m: Metrics, **kw) -> str:
    args = dict(requests_processing=2, requests_deferred=1, kv_cache_usage_ratio=0.25,
                kv_cache_tokens=512)
    args.update(kw)
    return m.render(**args)


def values(text: str) -> dict[str, float]:
    samples, _, _ = parse_prometheus(text)
    out = {}
    for name, labels, value in samples:
        assert not labels
        assert name not in out, f"duplicate sample {name}"
        out[name] = value
    return out


def test_fresh_metrics_are_zero_without_division_errors():
    m = Metrics()
    snap = m.snapshot()
    assert all(v == 0 for v in snap.values()), snap
    v = values(render(m, requests_processing=0, requests_deferred=0, kv_cache_usage_ratio=0.0,
                      kv_cache_tokens=0))
    assert set(v) == COUNTERS | GAUGES
    assert all(x == 0 for x in v.values())


def test_values_after_updates():
    m = Metrics()
    m.on_prompt(100, 0.5)
    m.on_prompt(50, 0.25)
    m.on_prediction(10, 1.0)
    m.on_prediction(30, 1.0)
    m.on_decode(1)
    m.on_decode(3)
    m.on_decode(2)
    snap = m.snapshot()
    assert snap["prompt_tokens_total"] == 150
    assert snap["prompt_seconds_total"] == pytest.approx(0.75)
    assert snap["tokens_predicted_total"] == 40
    assert snap["tokens_predicted_seconds_total"] == pytest.approx(2.0)
    assert snap["n_decode_total"] == 3
    assert snap["n_busy_slots_per_decode"] == pytest.approx(2.0)
    assert snap["prompt_tokens_seconds"] == pytest.approx(200.0)
    assert snap["predicted_tokens_seconds"] == pytest.approx(20.0)

    v = values(render(m, extra={"n_groups": 2, "rpc bytes/s": 1.5}))
    assert v["llamacpp:prompt_tokens_total"] == 150
    assert v["llamacpp:prompt_seconds_total"] == pytest.approx(0.75)
    assert v["llamacpp:tokens_predicted_total"] == 40
    assert v["llamacpp:tokens_predicted_seconds_total"] == pytest.approx(2.0)
    assert v["llamacpp:n_decode_total"] == 3
    assert v["llamacpp:n_busy_slots_per_decode"] == pytest.approx(2.0)
    assert v["llamacpp:prompt_tokens_seconds"] == pytest.approx(200.0)
    assert v["llamacpp:predicted_tokens_seconds"] == pytest.approx(20.0)
    assert v["llamacpp:kv_cache_usage_ratio"] == pytest.approx(0.25)
    assert v["llamacpp:kv_cache_tokens"] == 512
    assert v["llamacpp:requests_processing"] == 2
    assert v["llamacpp:requests_deferred"] == 1
    assert v["llamacpp:n_groups"] == 2
    assert v["llamacpp:rpc_bytes_s"] == 1.5


def test_zero_seconds_and_zero_tokens():
    m = Metrics()
    m.on_prompt(5, 0.0)          # a phase too quick to time: no division by zero, no inf
    m.on_prediction(0, 0.3)      # time but no tokens: throughput 0
    snap = m.snapshot()
    assert snap["prompt_tokens_seconds"] == 0
    assert snap["predicted_tokens_seconds"] == 0
    assert snap["n_busy_slots_per_decode"] == 0
    v = values(render(m))
    assert all(math.isfinite(x) for x in v.values())


def test_help_and_type_for_every_metric():
    m = Metrics()
    m.on_decode(4)
    text = render(m, extra={"pipeline_groups": 4})
    samples, helps, types = parse_prometheus(text)
    names = {s[0] for s in samples}
    assert names == COUNTERS | GAUGES | {"llamacpp:pipeline_groups"}
    assert set(helps) == names and all(helps[n] for n in names)
    assert set(types) == names
    for n in COUNTERS:
        assert types[n] == "counter", n
    for n in GAUGES | {"llamacpp:pipeline_groups"}:
        assert types[n] == "gauge", n
    # HELP and TYPE come right before each metric's sample
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("#"):
            name = line.split()[0]
            assert lines[i - 2].startswith(f"# HELP {name} ")
            assert lines[i - 1] == f"# TYPE {name} {types[name]}"


def test_llama_server_help_texts():
    _, helps, _ = parse_prometheus(render(Metrics()))
    assert helps["llamacpp:prompt_tokens_total"] == "Number of prompt tokens processed."
    assert helps["llamacpp:kv_cache_usage_ratio"] == "KV-cache usage. 1 means 100 percent usage."


def test_value_formatting():
    m = Metrics()
    m.on_prompt(3, 1.0 / 3.0)
    text = render(m, kv_cache_usage_ratio=float("nan"), kv_cache_tokens=10 ** 6)
    assert "\nllamacpp:prompt_tokens_total 3\n" in text
    assert "\nllamacpp:kv_cache_tokens 1000000\n" in text
    assert "\nllamacpp:kv_cache_usage_ratio NaN\n" in text
    v = values(text)
    assert v["llamacpp:prompt_seconds_total"] == 1.0 / 3.0  # repr round-trips exactly
    assert v["llamacpp:prompt_tokens_seconds"] == pytest.approx(9.0)


def test_extra_name_collisions_rejected():
    with pytest.raises(ValueError):
        render(Metrics(), extra={"kv_cache_tokens": 1})
    with pytest.raises(ValueError):
        render(Metrics(), extra={"a-b": 1, "a_b": 2})


def test_concurrent_updates_from_8_threads():
    m = Metrics()
    n_threads, n_iter = 8, 5000
    start = threading.Barrier(n_threads + 2, timeout=60)  # workers, reader, this thread
    stop = threading.Event()

    def worker(k: int) -> None:
        start.wait()
        for _ in range(n_iter):
            m.on_prompt(k + 1, 0.001)
            m.on_prediction(2, 0.002)
            m.on_decode(k % 4)

    def reader() -> None:  # rendering concurrently must never see a broken state
        start.wait()
        while not stop.is_set():
            values(render(m))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    rt = threading.Thread(target=reader)
    for t in threads:
        t.start()
    rt.start()
    start.wait()
    for t in threads:
        t.join()
    stop.set()
    rt.join()

    snap = m.snapshot()
    assert snap["prompt_tokens_total"] == n_iter * sum(k + 1 for k in range(n_threads))
    assert snap["prompt_seconds_total"] == pytest.approx(n_threads * n_iter * 0.001)
    assert snap["tokens_predicted_total"] == n_threads * n_iter * 2
    assert snap["tokens_predicted_seconds_total"] == pytest.approx(n_threads * n_iter * 0.002)
    assert snap["n_decode_total"] == n_threads * n_iter
    assert snap["n_busy_slots_total"] == n_iter * sum(k % 4 for k in range(n_threads))
    assert snap["n_busy_slots_per_decode"] == pytest.approx(1.5)
    assert snap["predicted_tokens_seconds"] == pytest.approx(1000.0)


def test_parser_rejects_garbage():
    for bad in ["llamacpp:x\n", "1abc 2\n", "x{a=b} 1\n", "x notanumber\n", "x 1"]:
        with pytest.raises((AssertionError, ValueError)):
            parse_prometheus(bad)
    samples, _, _ = parse_prometheus('x{a="1",b="q\\"z"} 2.5 1700000000\n')
    assert samples == [("x", {"a": "1", "b": 'q\\"z'}, 2.5)]
