"""Server metrics in llama-server's ``/metrics`` form (Prometheus text exposition format 0.0.4).

Decode threads report finished phases and decode calls; the event loop renders. Every update is a
few additions under one lock; :meth:`Metrics.render` copies the counters under that lock and
formats outside it.
"""
from __future__ import annotations

import math
import re
import threading

__all__ = ["Metrics", "PREFIX"]

PREFIX = "llamacpp:"

# (name, type, help) in llama-server's order and wording
_COUNTERS = (
    ("prompt_tokens_total", "Number of prompt tokens processed."),
    ("prompt_seconds_total", "Prompt process time"),
    ("tokens_predicted_total", "Number of generation tokens processed."),
    ("tokens_predicted_seconds_total", "Predict process time"),
    ("n_decode_total", "Total number of llama_decode() calls"),
    # pyllama's own: the scheduler under a full KV pool (docs/server.md)
    ("n_preemptions_total", "Requests preempted: their KV cells freed for an older request and recomputed later"),
    ("n_context_shifts_total", "Context shifts (--context-shift)"),
)
_GAUGES = (
    ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call"),
    ("prompt_tokens_seconds", "Average prompt throughput in tokens/s."),
    ("predicted_tokens_seconds", "Average generation throughput in tokens/s."),
    ("kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage."),
    ("kv_cache_tokens", "KV-cache tokens."),
    ("requests_processing", "Number of requests processing."),
    ("requests_deferred", "Number of requests deferred."),
)
_BUILTIN = frozenset(n for n, _ in _COUNTERS + _GAUGES)
_BAD_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_:]")


def _fmt(value: float) -> str:
    """A sample value as Prometheus writes it: integers without a fraction, +Inf/-Inf/NaN."""
    v = float(value)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 2 ** 53:
        return str(int(v))
    return repr(v)


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


class Metrics:
    """Cumulative counters since start; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._prompt_tokens = 0
        self._prompt_seconds = 0.0
        self._predicted_tokens = 0
        self._predicted_seconds = 0.0
        self._n_decode = 0
        self._n_busy_slots = 0
        self._n_preemptions = 0
        self._n_context_shifts = 0

    # -- updates (decode threads) ------------------------------------------------------------

    def on_prompt(self, n_tokens: int, seconds: float) -> None:
        """A request finished its prompt-processing phase: ``n_tokens`` in ``seconds``."""
        with self._lock:
            self._prompt_tokens += n_tokens
            self._prompt_seconds += seconds

    def on_prediction(self, n_tokens: int, seconds: float) -> None:
        """A request finished its generation phase: ``n_tokens`` in ``seconds``."""
        with self._lock:
            self._predicted_tokens += n_tokens
            self._predicted_seconds += seconds

    def on_decode(self, n_busy_slots: int) -> None:
        """One decode call whose group had ``n_busy_slots`` slots with work in them."""
        with self._lock:
            self._n_decode += 1
            self._n_busy_slots += n_busy_slots

    def on_preempt(self) -> None:
        """A request's KV cells were freed for an older request; it will be recomputed."""
        with self._lock:
            self._n_preemptions += 1

    def on_context_shift(self) -> None:
        with self._lock:
            self._n_context_shifts += 1

    # -- reading (event loop) ----------------------------------------------------------------

    def snapshot(self) -> dict[str, float]:
        """The counters and the averages derived from them, keyed by metric name without prefix."""
        with self._lock:
            pt, ps = self._prompt_tokens, self._prompt_seconds
            gt, gs = self._predicted_tokens, self._predicted_seconds
            nd, nb = self._n_decode, self._n_busy_slots
            npre, nshift = self._n_preemptions, self._n_context_shifts
        return {
            "n_preemptions_total": npre,
            "n_context_shifts_total": nshift,
            "prompt_tokens_total": pt,
            "prompt_seconds_total": ps,
            "tokens_predicted_total": gt,
            "tokens_predicted_seconds_total": gs,
            "n_decode_total": nd,
            "n_busy_slots_total": nb,
            "n_busy_slots_per_decode": _ratio(nb, nd),
            "prompt_tokens_seconds": _ratio(pt, ps),
            "predicted_tokens_seconds": _ratio(gt, gs),
        }

    def render(self, *, requests_processing: int, requests_deferred: int,
               kv_cache_usage_ratio: float, kv_cache_tokens: int,
               extra: dict[str, float] | None = None) -> str:
        """The ``/metrics`` body (``Content-Type: text/plain; version=0.0.4``).

        ``extra`` adds gauges named ``llamacpp:<key>`` (characters a metric name may not hold
        become ``_``); a key that collides with a built-in metric raises ``ValueError``.
        """
        snap = self.snapshot()
        snap["kv_cache_usage_ratio"] = kv_cache_usage_ratio
        snap["kv_cache_tokens"] = kv_cache_tokens
        snap["requests_processing"] = requests_processing
        snap["requests_deferred"] = requests_deferred
        lines: list[str] = []

        def add(name: str, mtype: str, help_text: str, value: float) -> None:
            full = PREFIX + name
            lines.append(f"# HELP {full} {_escape_help(help_text)}")
            lines.append(f"# TYPE {full} {mtype}")
            lines.append(f"{full} {_fmt(value)}")

        for name, help_text in _COUNTERS:
            add(name, "counter", help_text, snap[name])
        for name, help_text in _GAUGES:
            add(name, "gauge", help_text, snap[name])
        if extra:
            seen: set[str] = set()
            for key, value in extra.items():
                name = _BAD_NAME_CHARS.sub("_", str(key))
                if not name or name in _BUILTIN or name in seen:
                    raise ValueError(f"extra metric name {key!r} is empty or already used")
                seen.add(name)
                add(name, "gauge", f"pyllama: {key}", value)
        return "\n".join(lines) + "\n"
