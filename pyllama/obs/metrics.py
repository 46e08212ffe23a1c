"""Server metrics in llama-server's ``/metrics`` form (Prometheus text exposition format 0.0.4).

Decode threads report finished phases and decode calls; the event loop renders. Every update is a
few additions under one lock; :meth:`Metrics.render` copies the counters under that lock and
formats outside it.
"""
from __future__ import annotations

import math
import re
import threading

__all__ = ["Metrics", "PREFIX", "render_families", "pipeline_families"]

PREFIX = "llamacpp:"

# (name, type, help) in llama-server's order and wording
_COUNTERS = (
    ("prompt_tokens_total", "Number of prompt tokens processed."),
    ("prompt_seconds_total", "Prompt process time"),
    ("tokens_predicted_total", "Number of generation tokens processed."),
    ("tokens_predicted_seconds_total", "Predict process time"),
    ("n_decode_total", "Total number of llama_decode() calls"),
    ("n_tokens_max", "Largest observed n_tokens."),
    ("spec_decode_num_draft_tokens_total", "Total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total", "Total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total", "Total speculative decoding verification steps"),
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
        self._n_tokens_max = 0
        self._n_preemptions = 0
        self._n_context_shifts = 0
        self._n_draft_tokens = 0
        self._n_draft_accepted = 0
        self._n_drafts = 0

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

    def on_tokens(self, n_tokens: int) -> None:
        """A slot's context holds ``n_tokens`` after a step (llama-server's n_tokens_max is the largest)."""
        if n_tokens > self._n_tokens_max:  # read without the lock: a stale value only delays the update
            with self._lock:
                self._n_tokens_max = max(self._n_tokens_max, n_tokens)

    def on_preempt(self) -> None:
        """A request's KV cells were freed for an older request; it will be recomputed."""
        with self._lock:
            self._n_preemptions += 1

    def on_draft(self, n_drafted: int, n_accepted: int) -> None:
        """A draft of ``n_drafted`` tokens was verified; ``n_accepted`` of them were kept."""
        with self._lock:
            self._n_draft_tokens += n_drafted
            self._n_draft_accepted += n_accepted
            self._n_drafts += 1

    def on_context_shift(self) -> None:
        with self._lock:
            self._n_context_shifts += 1

    # -- reading (event loop) ----------------------------------------------------------------

    def snapshot(self) -> dict[str, float]:
        """The counters and the averages derived from them, keyed by metric name without prefix."""
        with self._lock:
            pt, ps = self._prompt_tokens, self._prompt_seconds
            gt, gs = self._predicted_tokens, self._predicted_seconds
            nd, nb, nt = self._n_decode, self._n_busy_slots, self._n_tokens_max
            npre, nshift = self._n_preemptions, self._n_context_shifts
            ndt, nda, nds = self._n_draft_tokens, self._n_draft_accepted, self._n_drafts
        return {
            "spec_decode_num_draft_tokens_total": ndt,
            "spec_decode_num_accepted_tokens_total": nda,
            "spec_decode_num_drafts_total": nds,
            "n_preemptions_total": npre,
            "n_context_shifts_total": nshift,
            "prompt_tokens_total": pt,
            "prompt_seconds_total": ps,
            "tokens_predicted_total": gt,
            "tokens_predicted_seconds_total": gs,
            "n_decode_total": nd,
            "n_tokens_max": nt,
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


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_families(families: list[tuple[str, str, str, list[tuple[dict[str, str], float]]]]) -> str:
    """Metric families with labels, in the same exposition format: (name, type, help, samples),
    each sample (labels, value). A family without samples is left out (nothing was measured)."""
    lines: list[str] = []
    for name, mtype, help_text, samples in families:
        if not samples:
            continue
        full = PREFIX + _BAD_NAME_CHARS.sub("_", name)
        lines.append(f"# HELP {full} {_escape_help(help_text)}")
        lines.append(f"# TYPE {full} {mtype}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in labels.items())
            lines.append(f"{full}{{{lab}}} {_fmt(value)}" if lab else f"{full} {_fmt(value)}")
    return "\n".join(lines) + "\n" if lines else ""


def pipeline_families(snap: dict) -> list[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
    """The /metrics families of a pipeline snapshot (pyllama.server.pipeline_stats): per device
    the busy / waiting / idle shares of the window and its busy seconds since start, per group
    its step figures, per rpc connection its traffic. Values not measured are left out."""
    devs = [d for d in snap["devices"] if d["measured"]]

    def per_dev(key: str) -> list:
        return [({"device": d["name"]}, d[key]) for d in devs if d[key] is not None]

    def per_group(key: str, scale: float = 1.0) -> list:
        return [({"group": str(g["group"])}, g[key] * scale) for g in snap["groups"] if g[key] is not None]

    def per_link(key: str) -> list:
        return [({"endpoint": r["endpoint"]}, r[key]) for r in snap["rpc"] if r[key] is not None]

    w = f"{snap['window_s']:g} s"
    return [
        ("device_busy_ratio", "gauge", f"Share of the last {w} the device computed", per_dev("busy")),
        ("device_waiting_ratio", "gauge", f"Share of the last {w} the device waited while another device computed",
         per_dev("waiting")),
        ("device_idle_ratio", "gauge", f"Share of the last {w} no device of the split computed", per_dev("idle")),
        ("device_busy_seconds_total", "counter", "Seconds the device computed since it started",
         per_dev("busy_total_s")),
        ("group_step_seconds", "gauge", f"Mean decode step time of the pipeline group over the last {w}",
         per_group("step_ms", 1e-3)),
        ("group_batch_size", "gauge", f"Mean tokens per decode step of the pipeline group over the last {w}",
         per_group("batch_size")),
        ("group_tokens_per_second", "gauge", f"Tokens sampled per second by the pipeline group over the last {w}",
         per_group("tokens_per_s")),
        ("group_steps_total", "counter", "Decode steps of the pipeline group since start", per_group("steps_total")),
        ("rpc_round_trips_total", "counter", "Replies read from the rpc server on this connection",
         per_link("round_trips_total")),
        ("rpc_bytes_out_total", "counter", "Bytes sent to the rpc server on this connection",
         per_link("bytes_out_total")),
        ("rpc_bytes_in_total", "counter", "Bytes read from the rpc server on this connection",
         per_link("bytes_in_total")),
        ("rpc_round_trips_per_step", "gauge", "Round trips to the rpc server per decode step (all groups)",
         per_link("round_trips_per_step")),
        ("rpc_bytes_out_per_step", "gauge", "Bytes sent to the rpc server per decode step (all groups)",
         per_link("bytes_out_per_step")),
        ("rpc_bytes_in_per_step", "gauge", "Bytes read from the rpc server per decode step (all groups)",
         per_link("bytes_in_per_step")),
    ]
