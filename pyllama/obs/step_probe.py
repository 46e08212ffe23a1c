"""The one hook a pipeline group's decode loop reports through.

The loop marks the points each step passes (built, decoded, sampled, post-processed, results
sent); at the end of the iteration the probe hands the step to every sink that wants it: the
trace file (spans on the trace's clock, when tracing), the pipe profile (sums per phase, with
PYLLAMA_PIPE_PROF) and the step log the live pipeline view reads (/pipeline/stats, the split
check). A mark is one clock read; the sinks run once per iteration, after the step's results
went out.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from . import pipe_prof, trace
from .steps import StepLog

_now = trace.now  # microseconds of the trace's clock: every mark and every sink share it


class StepProbe:
    __slots__ = ("group", "steps", "prof", "traced", "t_begin", "t_built", "t_decoded", "t_sample", "t_sampled",
                 "t_post", "t_send", "spans", "submit_s", "sync_s", "mask_wait_s", "mask_apply_s", "detok_s",
                 "stop_s", "n_tokens", "n_rows", "n_decode")

    def __init__(self, group: int):
        self.group = group
        self.steps = StepLog()
        self.prof: Optional[pipe_prof.GroupProfile] = pipe_prof.profile_for(group) if pipe_prof.enabled() else None
        self._reset()

    def _reset(self) -> None:
        self.traced = False
        self.t_begin = self.t_built = self.t_decoded = self.t_sample = self.t_sampled = self.t_post = 0
        self.t_send = 0
        self.spans = (0, 0, 0)
        self.submit_s = self.sync_s = self.mask_wait_s = self.mask_apply_s = self.detok_s = self.stop_s = 0.0
        self.n_tokens = self.n_rows = self.n_decode = 0

    # --- marks, in the order a step passes them ---------------------------------------------------
    def begin(self) -> None:
        """An iteration starts (it becomes a step once `built` is marked)."""
        self.t_begin = _now()
        self.traced = trace.enabled

    def built(self, n_tokens: int, n_rows: int, n_decode: int) -> None:
        """The batch is built: n_tokens computed, n_rows of them sampled, n_decode generating slots."""
        self.t_built = _now()
        self.n_tokens, self.n_rows, self.n_decode = n_tokens, n_rows, n_decode

    def decoded(self, ctx: Any) -> None:
        """The context's decode returned (its own split of the time: submit, then synchronize)."""
        self.t_decoded = _now()
        self.spans = ctx.last_spans
        self.submit_s, self.sync_s = ctx.last_submit_s, ctx.last_sync_s

    def sampling(self) -> None:
        self.t_sample = _now()

    def sampled(self, mask_wait_s: float, mask_apply_s: float) -> None:
        """Sampling is done; of its time, waiting for and applying grammar masks."""
        self.t_sampled = _now()
        self.mask_wait_s, self.mask_apply_s = mask_wait_s, mask_apply_s

    def post_done(self, rows: Sequence[Any]) -> None:
        """The samples of `rows` (slots) became events. With the profile on, their detokenizing
        and stop-string times (each slot's t_detok, t_stop) are taken and reset; otherwise they
        are left alone, since nothing reads them."""
        self.t_post = _now()
        if self.prof is not None:
            self.detok_s = sum(r.t_detok for r in rows)
            self.stop_s = sum(r.t_stop for r in rows)
            for r in rows:
                r.t_detok = r.t_stop = 0.0

    def sending(self) -> None:
        """The step's events are handed to the event loop now."""
        self.t_send = _now()

    def end(self, lock_wait_s: float) -> None:
        """The iteration is over (its events sent): every sink takes it, and the probe starts over."""
        t_end = _now()
        if self.t_built:
            self.steps.add(self.t_begin, t_end, self.n_tokens, self.n_rows)
        if self.traced:
            self._trace(t_end)
        if self.prof is not None:
            self._profile(t_end, lock_wait_s)
        self._reset()

    # --- sinks ---------------------------------------------------------------------------------------
    def _trace(self, t_end: int) -> None:
        grp, n = self.group, self.n_rows
        if self.t_built:
            trace.event("server", "batch_build", self.t_begin, self.t_built, grp=grp, n_slots=n)
            s0, s1, s2 = self.spans
            if s0:
                trace.event("server", "submit", s0, s1, grp=grp, n_slots=n)
                trace.event("server", "synchronize", s1, s2, grp=grp, n_slots=n)
            if self.t_sampled:
                trace.event("server", "sampling", self.t_sample, self.t_sampled, grp=grp, n_slots=n)
            if self.t_post:
                trace.event("server", "post_decode", self.t_decoded, self.t_post, grp=grp, n_slots=n)
        if self.t_send:
            trace.event("server", "result_send", self.t_send, t_end, grp=grp, n_slots=n)
        if self.t_built:
            trace.event("server", "iteration", self.t_begin, t_end, grp=grp, n_slots=n,
                        n_prompt=self.n_tokens - self.n_decode, n_decode=self.n_decode)

    def _profile(self, t_end: int, lock_wait_s: float) -> None:
        prof = self.prof
        assert prof is not None
        send_s = (t_end - self.t_send) / 1e6 if self.t_send else 0.0
        prof.add(lock_wait=lock_wait_s, result_send=send_s)
        if not self.t_built:
            return
        prof.add(steps=1, pre_decode=(self.t_built - self.t_begin) / 1e6, submit=self.submit_s,
                 synchronize=self.sync_s, post_decode=(self.t_post - self.t_decoded) / 1e6 if self.t_post else 0.0)
        if self.t_sampled:
            sampling_s = (self.t_sampled - self.t_sample) / 1e6 - self.mask_wait_s - self.mask_apply_s
            prof.add(tokens=self.n_rows, sampling=sampling_s, detokenize=self.detok_s, stop_strings=self.stop_s,
                     mask_wait=self.mask_wait_s, mask_apply=self.mask_apply_s)
