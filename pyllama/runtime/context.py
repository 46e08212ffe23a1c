"""Context: a KV cache on every device plus compute buffers, and decode(batch) -> logits.

One context serves many sequences at once: a batch mixes tokens of any sequences, each with its
position and whether it wants logits. Prompts are processed in micro-batches (n_ubatch); only the
rows that asked for logits produce them, and a decode step reads back one thing: those logits.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..obs import trace
from ..backend.base import Backend, Buffer, DType, Tensor, nbytes_of
from ..backend.remote import lost_devices
from .cache_types import cache_type, cache_type_name, check_cache_row
from ..util.errors import ContextLimitError, PyllamaError
from ..models.build.llama import LORA_INPUT, SAMPLING_INPUT, build_forward
from ..models.build.ops import Op, sample_in_cols, sample_out_cols
from .kv_cache import KVCache
from ..models.model import Model
from ..obs import rpc_stats
from ..models.weights import Placement, Weights
from .sched import Job, Plan, Scheduler

# Plans kept per context, least recently used dropped first. Under a mixed load nearly every step
# has another (tokens, outputs) shape, and each plan holds its graph, host staging and the
# devices' bound kernels: without a bound, memory grows with the variety of shapes.
PLAN_CACHE = 128

log = logging.getLogger(__name__)
_KV_FALLBACK_LOGGED: set = set()  # (device, K type, V type) already logged as kept in F32


@dataclass
class Batch:
    """Tokens to decode. Arrays of one length; `logits[i]` asks for the logits of token i."""

    tokens: np.ndarray
    pos: np.ndarray
    seq_id: np.ndarray
    logits: np.ndarray

    def __post_init__(self) -> None:
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int32)
        self.pos = np.ascontiguousarray(self.pos, dtype=np.int32)
        self.seq_id = np.ascontiguousarray(self.seq_id, dtype=np.int32)
        self.logits = np.ascontiguousarray(self.logits, dtype=bool)
        n = len(self.tokens)
        if not (len(self.pos) == len(self.seq_id) == len(self.logits) == n):
            raise ValueError("batch arrays must have one entry per token")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def for_sequence(cls, tokens: Sequence[int], start: int, seq: int = 0, all_logits: bool = False) -> "Batch":
        """Tokens of one sequence at positions start..; logits for the last one (or all)."""
        n = len(tokens)
        want = np.ones(n, dtype=bool) if all_logits else np.arange(n) == n - 1
        return cls(np.asarray(tokens), np.arange(start, start + n), np.full(n, seq), want)

    @classmethod
    def concat(cls, batches: Sequence["Batch"]) -> "Batch":
        return cls(*(np.concatenate([getattr(b, f) for b in batches]) for f in ("tokens", "pos", "seq_id", "logits")))


@dataclass
class DecodeOutput:
    logits: np.ndarray  # [n_outputs, n_vocab], a view valid until the next decode (empty when sampled)
    rows: np.ndarray    # batch index of each logits row, in batch order
    sampled: Optional[np.ndarray] = None  # int32 [n_outputs, 2 + 2N] when sampled on the device
    embd: Optional[np.ndarray] = None     # [n_outputs, n_embd] hidden states (decode(embeddings=True)), a view


class Context:
    """KV cache and compute state of one pipeline group over a loaded model."""

    def __init__(self, model: Model, weights: Weights, placement: Placement, n_ctx: int, n_seq_max: int = 1,
                 n_batch: int = 2048, n_ubatch: int = 512, kv_unified: bool = False, allocate: bool = True,
                 type_k: DType = DType.F16, type_v: DType = DType.F16):
        """allocate=False builds the context on paper only (placeholder buffers, a dry plan), to
        learn what it would take on each device (`device_bytes`) before anything is allocated.
        type_k, type_v: the KV cache types (F32, F16, BF16, Q8_0); a device that cannot hold one
        keeps that cache in F32 (logged; `kv_types` says what each device holds)."""
        hp = model.hparams
        if n_ubatch <= 0 or n_batch <= 0:
            raise ValueError("batch sizes must be positive")
        self.model = model
        self.hparams = hp
        self.weights = weights
        self.placement = placement
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_ubatch = min(n_ubatch, n_batch)
        self.kv = KVCache(n_ctx, n_seq_max, kv_unified)
        self.n_seq_max = n_seq_max
        self._kv_buffers = []
        self.freed = False
        self.kv_tensors: list[tuple[Tensor, Tensor]] = []
        self.kv_bytes: dict[str, int] = {}
        if hp.encoder:  # the cache only holds one step's keys and values, in F16 as llama.cpp's flash
            # attention casts an encoder's K and V (and the F16 kernel reads them 4x faster than F32's)
            type_k = type_v = DType.F16
        self.type_k, self.type_v = cache_type(type_k), cache_type(type_v)
        if hp.mla_lora_kv and self.type_v != self.type_k:  # (as llama.cpp refuses it)
            raise PyllamaError(f"{model.name}: latent attention (MLA) keeps one cache, its values a view of its "
                               f"keys: -ctk {cache_type_name(self.type_k)} and -ctv {cache_type_name(self.type_v)} "
                               "must be the same type")
        check_cache_row(self.type_k, hp.n_embd_kv, "K")
        check_cache_row(self.type_v, hp.n_embd_kv, "V")
        self.kv_types: dict[str, tuple[DType, DType]] = {}  # device name -> (K, V) cache types it holds
        n_cells, width = self.kv.n_cells, hp.n_embd_kv
        for il in range(hp.n_layer):
            backend = placement.backends[placement.backend_of_layer(il)]
            tk, tv = self.kv_types.get(backend.name) or self._device_kv_types(backend)
            self.kv_types[backend.name] = (tk, tv)
            # V starts on a 64-byte boundary whatever the K rows' size (a Q8_0 row is 34 B per block);
            # latent attention (MLA) caches K only, and its V is a view of K (nothing more stored)
            v_off = -(-nbytes_of(tk, (n_cells, width)) // 64) * 64
            size = v_off + nbytes_of(tv, (n_cells, width))
            if hp.mla_lora_kv:
                v_off, size, tv = 0, nbytes_of(tk, (n_cells, width)), tk
            buf = backend.alloc_buffer(size, usage="kv") if allocate else Buffer(backend, size, "kv")
            if allocate:
                self._kv_buffers.append(buf)
            self.kv_bytes[backend.name] = self.kv_bytes.get(backend.name, 0) + size
            k = Tensor(tk, (n_cells, width), f"cache_k_l{il}", buf, 0)
            v = Tensor(tv, (n_cells, width), f"cache_v_l{il}", buf, v_off)
            self.kv_tensors.append((k, v))
        self.sched = Scheduler(placement, dry=not allocate)
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._logits = np.zeros((0, hp.n_vocab), dtype=np.float32)
        self._logits_in_place: Optional[np.ndarray] = None  # the last decode's logits, read in place
        self.last_submit_s = self.last_sync_s = 0.0  # of the last decode: building and sending, then waiting
        self.last_spans = (0, 0, 0)  # trace times of the last decode: start, submitted, synchronized
        self._n_splits = 0
        self._sampled = np.zeros((0, 0), dtype=np.int32)
        self._embd = np.zeros((0, hp.n_embd), dtype=np.float32)
        # each sequence's scale of each LoRA adapter (set_lora): what its tokens' products add
        self.lora_scales = np.zeros((self.kv.n_seq_max, weights.n_lora), dtype=np.float32)
        self._plan(self.n_ubatch, self.n_ubatch)  # sizes the compute buffers for the worst case

    # ------------------------------------------------------------------------------------------
    def _device_kv_types(self, backend: Backend) -> tuple[DType, DType]:
        """The (K, V) cache types `backend` holds: the context's, or F32 for a type it cannot hold."""
        tk, tv = (t if backend.holds_kv(t, self.hparams.head_dim) else DType.F32 for t in (self.type_k, self.type_v))
        key = (backend.name, self.type_k, self.type_v)
        if (tk, tv) != (self.type_k, self.type_v) and key not in _KV_FALLBACK_LOGGED:
            _KV_FALLBACK_LOGGED.add(key)
            log.warning("%s cannot hold a KV cache of K %s, V %s: its layers keep it as K %s, V %s", backend.name,
                        cache_type_name(self.type_k), cache_type_name(self.type_v), cache_type_name(tk),
                        cache_type_name(tv))
        return tk, tv

    def device_bytes(self) -> dict[str, int]:
        """KV cache plus compute buffers of this context, per device name."""
        out = dict(self.kv_bytes)
        for backend, peak in zip(self.placement.backends, self.sched.peaks):
            out[backend.name] = out.get(backend.name, 0) + peak
        return out

    @property
    def seq_cap(self) -> int:
        """The most positions one sequence may hold."""
        return self.kv.seq_cap

    def lost_devices(self) -> dict[str, str]:
        """Devices of this context that cannot be used any more (name -> why, naming the peer)."""
        return lost_devices(self.placement.backends)

    def output_backend(self) -> Backend:
        """The device that holds the output layer (and so the logits)."""
        return self.placement.backends[self.placement.backend_of_layer(self.hparams.n_layer)]

    def can_sample_on_device(self) -> bool:
        """Whether the device holding the output layer runs the SAMPLE op (backend sampling)."""
        return self.output_backend().supports(Op.SAMPLE)

    def _plan(self, n_tokens: int, n_outputs: int, sample: Optional[tuple[int, int]] = None,
              embd: bool = False) -> Plan:
        key = (n_tokens, n_outputs, sample, embd)
        plan = self._plans.get(key)
        if plan is not None and plan.generation == self.sched.generation:
            self._plans.move_to_end(key)
            return plan
        listed = min(n_tokens, self.n_seq_max) * self.kv.seq_cap
        fg = build_forward(self.hparams, self.weights, self.kv_tensors, n_tokens, n_outputs, listed,
                           sample if n_outputs else None, embd=embd, n_ctx_seq=self.kv.seq_cap)
        plan = self.sched.plan(fg)
        stale = self._plans.pop(key, None)
        if stale is not None:
            self._forget(stale)
        if plan.generation != self.sched.generation:  # placing it grew a buffer: earlier plans are stale
            while self._plans:
                self._forget(self._plans.popitem()[1])
        self._plans[key] = plan
        while len(self._plans) > PLAN_CACHE:
            self._forget(self._plans.popitem(last=False)[1])
        return plan

    @staticmethod
    def _forget(plan: Plan) -> None:
        """Tells the devices that a dropped plan's graphs will not run again."""
        for split in plan.splits:
            split.stream.forget_graph(split.graph.uid)

    def forget_plans(self) -> None:
        """Drops every plan, telling the devices their graphs will not run again."""
        while self._plans:
            self._forget(self._plans.popitem()[1])

    def synchronize(self) -> None:
        """Waits for the work this context queued on every device."""
        self.sched.synchronize()

    def decode(self, batch: Batch, sampling: Optional[np.ndarray] = None,
               sample: Optional[tuple[int, int]] = None, embeddings: bool = False) -> DecodeOutput:
        """Runs the batch through the model; returns the logits of the rows that asked for them.

        With `sampling` (int32 [n_outputs, 12 + window], the packed sampler inputs of those rows,
        see sampling.BatchSampler.pack) and `sample` = (n_probs, window), the rows are sampled on
        the device that holds the output layer and only the packed results come back.
        With `embeddings`, those rows' final hidden states after the output norm [n_outputs,
        n_embd] come back in `embd` instead of logits."""
        n = len(batch)
        if n == 0:
            raise ValueError("empty batch")
        if n > self.n_batch:
            raise ValueError(f"batch of {n} tokens exceeds n_batch {self.n_batch}")
        if batch.tokens.min() < 0 or batch.tokens.max() >= self.hparams.n_vocab:
            raise ValueError(f"token ids must lie in [0, {self.hparams.n_vocab})")
        rows = np.flatnonzero(batch.logits)
        if self.hparams.encoder:  # no output layer: an encoder's rows are its hidden states
            if sampling is not None:
                raise ValueError("an encoder model returns embeddings, it samples nothing")
            embeddings = True
        if embeddings and sampling is not None:
            raise ValueError("a decode returns either embeddings or sampled tokens")
        if embeddings:
            if len(self._embd) < len(rows):
                self._embd = np.zeros((max(len(rows), 1), self.hparams.n_embd), dtype=np.float32)
        elif sampling is not None:
            if sample is None or sampling.shape != (len(rows), sample_in_cols(sample[1])) \
                    or sampling.dtype != np.int32:
                raise ValueError(f"sampling inputs {sampling.shape} do not match {len(rows)} output rows and {sample}")
            cols = sample_out_cols(sample[0])
            if self._sampled.shape[0] < len(rows) or self._sampled.shape[1] != cols:
                self._sampled = np.zeros((max(len(rows), 1), cols), dtype=np.int32)
        elif len(self._logits) < len(rows):
            self._logits = np.zeros((max(len(rows), 1), self.hparams.n_vocab), dtype=np.float32)
        tr0 = trace.now() if trace.enabled else 0
        t0 = time.perf_counter()
        done = 0
        readers = set()
        self._logits_in_place = None
        try:
            keys, jobs = [], []
            for u0, u1 in self._ubatches(batch):
                key, job, k, stream = self._ubatch_job(batch, u0, u1, done, sampling, sample, embeddings)
                keys.append(key)
                jobs.append(job)
                done += k
                if stream is not None:
                    readers.add(stream)
            self._replan_stale(keys, jobs)
            self.sched.compute_ubatches(jobs)
        except BaseException:
            self._collect_pending()
            raise
        t1 = time.perf_counter()
        tr1 = trace.now() if tr0 else 0
        for stream in readers:  # the reads sent with the graphs complete here
            stream.synchronize()
        self.last_submit_s, self.last_sync_s = t1 - t0, time.perf_counter() - t1
        if tr0:
            tr2 = trace.now()
            self.last_spans = (tr0, tr1, tr2)
            trace.event("ctx", "decode", tr0, tr2, n_tokens=n, n_outputs=len(rows),
                        n_splits=self._n_splits, grp=trace.group())
        rpc_stats.on_step()
        if embeddings:
            return DecodeOutput(self._logits[:0], rows, embd=self._embd[:len(rows)])
        if sampling is not None:
            return DecodeOutput(self._logits[:0], rows, self._sampled[:len(rows)])
        if self._logits_in_place is not None:
            return DecodeOutput(self._logits_in_place, rows)
        return DecodeOutput(self._logits[:len(rows)], rows)

    def _ubatches(self, batch: Batch) -> list[tuple[int, int]]:
        """The batch's micro-batches: runs of n_ubatch tokens; for a model whose tokens see their
        whole sequence, runs of whole sequences (each given whole, from position 0), since one
        split over two micro-batches would have its first tokens miss the later ones; what the
        cache held for those sequences is forgotten (a sequence starts anew each time)."""
        n = len(batch)
        if self.hparams.causal:
            return [(u0, min(n, u0 + self.n_ubatch)) for u0 in range(0, n, self.n_ubatch)]
        starts = np.flatnonzero(np.r_[True, batch.seq_id[1:] != batch.seq_id[:-1]])
        ends = np.r_[starts[1:], n]
        out: list[tuple[int, int]] = []
        for s0, s1 in zip(starts.tolist(), ends.tolist()):
            if s1 - s0 > self.n_ubatch:
                raise ValueError(f"input of {s1 - s0} tokens is too large to process: a sequence of a non-causal model "
                                 f"must fit one micro-batch of {self.n_ubatch} (increase the physical batch size)")
            if s1 - s0 > self.hparams.n_ctx_train:  # the learned positions end there
                raise ValueError(f"input of {s1 - s0} tokens is longer than the model's {self.hparams.n_ctx_train} "
                                 "positions")
            if not np.array_equal(batch.pos[s0:s1], np.arange(s1 - s0)):
                raise ValueError("a sequence of a non-causal model must come whole, positions 0..n-1, in one batch")
            self.kv.seq_rm(int(batch.seq_id[s0]), 0)
            if out and s1 - out[-1][0] <= self.n_ubatch:
                out[-1] = (out[-1][0], s1)
            else:
                out.append((s0, s1))
        return out

    def _collect_pending(self) -> None:
        """After a failed micro-batch: collects every reply this thread still has queued on any
        device of the step (the logits of earlier micro-batches, a split's outgoing read). A
        reply left uncollected on a shared RPC connection would stall every other group on it.
        Each wait is bounded by the RPC timeout; an error here is secondary to the one raised."""
        for stream in self.sched.streams:
            try:
                stream.synchronize()
            except Exception as exc:  # noqa: BLE001 - the step's own error is what the caller gets
                log.debug("after a failed step, %s: %s", stream.backend.name, exc)

    def _ubatch_job(self, batch: Batch, u0: int, u1: int, out_row: int, sampling: Optional[np.ndarray] = None,
                    sample: Optional[tuple[int, int]] = None, embeddings: bool = False):
        """One micro-batch's job for the scheduler, its cells taken in the KV cache; returns (its
        plan's key, the job, rows of output it reads, the stream they are read on or None)."""
        seq, pos = batch.seq_id[u0:u1], batch.pos[u0:u1]
        want = batch.logits[u0:u1]
        n_out = int(want.sum())
        kv_idx = self.kv.prepare(seq, pos)
        cells, ranges = self.kv.attention_lists(seq, pos, self.hparams.causal)
        sampled = sampling is not None and n_out > 0
        key = (u1 - u0, n_out, sample if sampled else None, embeddings and n_out > 0)
        plan = self._plan(*key)
        self._n_splits = len(plan.splits)
        values = {
            "inp_tokens": batch.tokens[u0:u1],
            "inp_pos": pos,
            "inp_kv_idx": kv_idx,
            "inp_attn_cells": cells,
            "inp_attn_ranges": ranges,
        }
        if "inp_out_ids" in plan.input_names:
            values["inp_out_ids"] = np.flatnonzero(want).astype(np.int32)
        if self.lora_scales.shape[1]:
            values[LORA_INPUT] = self.lora_scales[seq]
        if not n_out:
            return key, Job(plan, values), 0, None
        if sampled:
            values[SAMPLING_INPUT] = sampling[out_row:out_row + n_out]
            return key, Job(plan, values, self._sampled[out_row:out_row + n_out]), n_out, plan.splits[-1].stream
        out = plan.output
        if not embeddings and u1 - u0 == len(batch) and out is not None and out.backend.host_memory \
                and out.dtype is DType.F32 and tuple(out.shape) == (n_out, self.hparams.n_vocab):
            # One micro-batch whose logits lie in this host's memory: the caller reads them where
            # the output layer wrote them (until the next decode, as it would the copy), which
            # saves copying n_outputs x n_vocab floats (4 MB at 32 rows of a 32k vocabulary).
            self._logits_in_place = out.backend.host_array(out).view(np.float32).reshape(out.shape)
            return key, Job(plan, values), n_out, None
        dest = self._embd if embeddings else self._logits
        return key, Job(plan, values, dest[out_row:out_row + n_out]), n_out, plan.splits[-1].stream

    def _replan_stale(self, keys: list[tuple], jobs: list[Job]) -> None:
        """Placing a later micro-batch's plan can grow a compute buffer, which makes the plans
        placed before it stale: those are placed again (the buffers only grow, so this settles)."""
        while any(job.plan.generation != self.sched.generation for job in jobs):
            for key, job in zip(keys, jobs):
                if job.plan.generation != self.sched.generation:
                    job.plan = self._plan(*key)

    # ------------------------------------------------------------------------------------------
    def set_lora(self, seq: int, scales: Sequence[float]) -> None:
        """The LoRA adapters' scales (one per adapter the model loaded, 0 for none) of sequence
        `seq`'s next tokens. What its cache holds was computed with the scales of its time."""
        if len(scales) != self.lora_scales.shape[1]:
            raise ValueError(f"{len(scales)} LoRA scales for {self.lora_scales.shape[1]} adapters")
        self.lora_scales[seq] = np.asarray(scales, dtype=np.float32) * self.weights.lora_factors

    def seq_rm(self, seq: int, p0: int = 0) -> int:
        """Forgets positions p0.. of a sequence; returns the length actually kept (see KVCache.seq_rm)."""
        return self.kv.seq_rm(seq, p0)

    def seq_share(self, src: int, dst: int, n_pos: int) -> int:
        """dst starts with src's first positions (whole blocks, shared); returns how many."""
        return self.kv.seq_share(src, dst, n_pos)

    # --- a sequence's cache in host memory (the server's prompt cache, slot files) ------------------
    def kv_layout(self) -> list[list]:
        """Per layer [K type, K row bytes, V type, V row bytes]: what rows from `read_seq` need to
        mean the same in another context."""
        out = []
        for k, v in self.kv_tensors:
            out.append([cache_type_name(k.dtype), nbytes_of(k.dtype, (1, k.shape[1])),
                         cache_type_name(v.dtype), nbytes_of(v.dtype, (1, v.shape[1]))])
        return out

    def read_seq(self, seq: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Positions 0..n-1 of `seq`'s KV cache, per layer its K rows and V rows as host bytes
        (one row of each per position, in the cache's own types)."""
        return self.read_cells(self.kv.cell_runs(seq, n), n)

    def read_cells(self, runs: Sequence[tuple[int, int, int]], n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """As read_seq, of cells given as `KVCache.cell_runs` (held with `KVCache.hold`): it touches
        no bookkeeping, so another thread than the decode thread may call it."""
        out: list[tuple[np.ndarray, np.ndarray]] = []
        backends = {}
        for k, v in self.kv_tensors:
            pair = []
            for t in (k, v):
                row = nbytes_of(t.dtype, (1, t.shape[1]))
                host = np.empty((n, row), dtype=np.uint8)
                for p0, cell, length in runs:
                    part = Tensor(t.dtype, (length, t.shape[1]), t.name, t.buffer, t.offset + cell * row)
                    t.backend.get_tensor_async(part, host[p0:p0 + length])
                pair.append(host)
                backends[id(t.backend)] = t.backend
            out.append((pair[0], pair[1]))
        for backend in backends.values():
            backend.synchronize()  # queued reads (one round trip per peer) land here
        return out

    def write_seq(self, seq: int, layers: Sequence[tuple[np.ndarray, np.ndarray]], n: int) -> None:
        """`seq` (emptied first) holds positions 0..n-1 from rows `read_seq` returned (which may
        hold more). Raises ContextLimitError, the sequence left empty, when the pool lacks blocks."""
        if len(layers) != len(self.kv_tensors):
            raise ValueError(f"{len(layers)} layers of cache rows for a model of {len(self.kv_tensors)}")
        self.kv.seq_rm(seq, 0)
        if n <= 0:
            return
        self.kv.prepare(np.full(n, seq, dtype=np.int32), np.arange(n, dtype=np.int32))
        runs = self.kv.cell_runs(seq, n)
        backends = {}
        try:
            for (k, v), rows in zip(self.kv_tensors, layers):
                for t, host in zip((k, v), rows):
                    row = nbytes_of(t.dtype, (1, t.shape[1]))
                    if host.shape[0] < n or host.shape[1] != row:
                        raise ValueError(f"{t.name}: rows of {host.shape[1]} B for {n} positions, "
                                         f"the cache has {row} B rows")
                    for p0, cell, length in runs:
                        t.backend.set_tensor(t, host[p0:p0 + length], offset=cell * row)
                    backends[id(t.backend)] = t.backend
            for backend in backends.values():
                backend.synchronize()  # writes to a peer are one-way: their errors come back here
        except BaseException:
            self.kv.seq_rm(seq, 0)
            raise

    # --- layers moving to another device (Engine.move_layers) --------------------------------------
    def stage_kv(self, layers: Sequence[int], backends: Sequence[Backend]) -> list[tuple[int, Buffer, Tensor, Tensor]]:
        """The KV cache of each of `layers` copied into a new buffer on `backends[i]` (its new device),
        the cache in use left as it is; `commit_kv` then swaps them in. Raises (with nothing left
        allocated) when a device cannot hold this cache's types or the copy fails."""
        staged: list[tuple[int, Buffer, Tensor, Tensor]] = []
        if self.freed:
            return staged
        try:
            for il, backend in zip(layers, backends):
                k, v = self.kv_tensors[il]
                if self._device_kv_types(backend) != (k.dtype, v.dtype):
                    raise PyllamaError(f"{backend.name} cannot hold layer {il}'s KV cache as it is "
                                       f"(K {cache_type_name(k.dtype)}, V {cache_type_name(v.dtype)})")
                old = k.buffer
                assert old is not None
                buf = backend.alloc_buffer(old.size, usage="kv")
                staged.append((il, buf, Tensor(k.dtype, k.shape, k.name, buf, k.offset),
                               Tensor(v.dtype, v.shape, v.name, buf, v.offset)))
                for src, dst in ((k, staged[-1][2]), (v, staged[-1][3])):
                    backend.set_tensor(dst, old.backend.get_tensor(src).reshape(-1).view(np.uint8))
            for _, buf, _, _ in staged:
                buf.backend.synchronize()  # writes to a peer are one-way: their errors come back here
        except BaseException:
            for _, buf, _, _ in staged:
                try:
                    buf.backend.free_buffer(buf)
                except Exception:  # noqa: BLE001 - a lost peer freed it with the connection
                    pass
            raise
        return staged

    def commit_kv(self, staged: list[tuple[int, Buffer, Tensor, Tensor]]) -> None:
        """Swaps in the KV cache `stage_kv` copied (the layers' new devices are already in the
        placement), frees the old one, and drops every plan: the graphs' stages changed."""
        if self.freed:
            return
        for il, buf, k, v in staged:
            old = self.kv_tensors[il][0].buffer
            assert old is not None
            self.kv_tensors[il] = (k, v)
            self._kv_buffers = [b for b in self._kv_buffers if b is not old] + [buf]
            self.kv_bytes[old.backend.name] -= old.size
            if not self.kv_bytes[old.backend.name]:
                del self.kv_bytes[old.backend.name]
            self.kv_bytes[buf.backend.name] = self.kv_bytes.get(buf.backend.name, 0) + buf.size
            self.kv_types[buf.backend.name] = (k.dtype, v.dtype)
            try:
                old.backend.free_buffer(old)
            except Exception as exc:  # noqa: BLE001 - the cache moved; a peer that lost it frees it anyway
                log.warning("freeing layer %d's old KV cache on %s: %s", il, old.backend.name, exc)
        self.forget_plans()
        self.sched.generation += 1
        try:
            self._plan(self.n_ubatch, self.n_ubatch)  # compute buffers for the worst case on the new stages
        except Exception as exc:  # noqa: BLE001 - the move is made; the next step plans (and says) again
            log.warning("sizing the compute buffers after the move: %s", exc)

    def clear(self) -> None:
        self.kv.clear()

    def free(self) -> None:
        self.freed = True
        self.sched.free()
        for buf in self._kv_buffers:
            buf.backend.free_buffer(buf)
        self._kv_buffers.clear()


def check_prompt_fits(n_prompt: int, seq_cap: int) -> None:
    if n_prompt >= seq_cap:
        raise ContextLimitError(
            f"the prompt is {n_prompt} tokens long but the context holds {seq_cap} (use a larger -c)")
