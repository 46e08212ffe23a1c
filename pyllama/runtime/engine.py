"""Engine: a model loaded on its devices with its tokenizer. Contexts (one per pipeline group) are
made from it and share its weights.

A device whose peer is lost (`lost_devices`) is brought back in two steps: `reach_lost_devices`
opens a new connection to each such peer and touches nothing the contexts use, so it may run
while they work; `restore_lost_devices`, with no context in use, re-creates on those devices
everything the engine had there (weights, every context's KV cache and compute buffers) and
empties every context's KV cache, whose contents went with the peer.
"""
from __future__ import annotations

import logging
import weakref
from typing import Optional, Sequence

from ..backend.base import Backend, DType
from ..backend.cpu import CPUBackend, set_compute_threads
from ..backend.remote import lost_devices, remote_devices
from .placement.balance import MeasuredSplit, counts_of, measured_split
from .context import Context
from .placement.devices import default_split
from ..util.errors import ModelFileError, PyllamaError
from ..models.check_tensors import check_tensors as check_model_tensors
from ..models.lora import load_lora_set
from ..models.model import Model
from ..tokenizer import Tokenizer, load_tokenizer
from ..models.weights import Placement, Weights, load_weights, split_layers

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model_path: str, n_threads: int = 0, backends: Optional[Sequence[Backend]] = None,
                 tensor_split: Optional[Sequence[float]] = None, load: bool = True, map_weights: bool = True,
                 kv_overrides: Optional[dict] = None, repack: bool = True, check_tensors: bool = False,
                 lora: Sequence[str] = ()):
        """Opens the model and places its layers; with load=False the weights are not uploaded yet
        (check_memory first, then load()). map_weights=False (--no-mmap) copies the weights a CPU
        would use in place in the file's memory map. kv_overrides (--override-kv) replace metadata
        values before anything reads them. repack=False (--no-repack) keeps the local CPU's quantized
        weights in the file's layout only (no repacked copies, backend/cpu/). check_tensors
        (--check-tensors) reads every tensor for values that are not finite before anything else.
        lora: LoRA adapter files (--lora), loaded beside the weights, none applied until a
        context's sequence asks for it (Context.set_lora)."""
        self.map_weights = map_weights
        self.n_threads = set_compute_threads(n_threads)
        self.model = Model(model_path, kv_overrides=kv_overrides)
        if check_tensors:
            n = check_model_tensors(model_path, self.model.file.tensors.values())
            log.info("--check-tensors: %d tensors, every value finite", n)
        self.tokenizer: Tokenizer = load_tokenizer(self.model.file.metadata, source=model_path)
        hp = self.model.hparams
        if self.tokenizer.n_vocab != hp.n_vocab:
            raise ModelFileError(f"{model_path}: the vocabulary has {self.tokenizer.n_vocab} tokens "
                                 f"but the model has {hp.n_vocab} embedding rows")
        self.model.lora = load_lora_set(lora, self.model)
        if self.model.lora is not None:
            for ad in self.model.lora.adapters:
                log.info("LoRA adapter %s: %d matrices, alpha %g", ad.path, len(ad.pairs), ad.alpha)
        self.backends = list(backends) if backends else [CPUBackend(self.n_threads)]
        for b in self.backends:
            if isinstance(b, CPUBackend):
                b.layout.repack = b.layout.repack and repack
        # without -ts: llama.cpp's by-free-memory split, or with PYLLAMA_SPLIT_PROBE=1 the devices'
        # timed step costs balanced (balance.py; the output layer counted on the last device)
        self.measured_split: Optional[MeasuredSplit] = None
        proportions = tensor_split
        if not proportions:
            proportions = default_split(self.backends) if len(self.backends) > 1 else [1.0]
            if len(self.backends) > 1 and hp.n_layer > 0:
                self.measured_split = measured_split(self.model, self.backends, proportions, map_weights)
                if self.measured_split is not None:
                    proportions = [float(n) for n in self.measured_split.counts]
        if len(proportions) != len(self.backends):
            raise ValueError(f"--tensor-split has {len(proportions)} values for {len(self.backends)} devices")
        self.placement = Placement(self.backends, split_layers(hp.n_layer, proportions))
        self.weights: Optional[Weights] = None
        self._contexts: "weakref.WeakSet[Context]" = weakref.WeakSet()
        if load:
            self.load()

    def load(self) -> None:
        self.weights = load_weights(self.model, self.placement, map_weights=self.map_weights)

    def check_memory(self, n_groups: int, n_ctx: int, n_seq_max: int, n_batch: int, n_ubatch: int,
                     kv_unified: bool, type_k: DType = DType.F16, type_v: DType = DType.F16) -> dict[str, int]:
        """Refuses (PyllamaError naming the device and the shortfall) a configuration whose weights
        plus every group's KV cache (of the cache types each device holds) and compute buffers do
        not fit each device's free memory. Nothing is allocated; returns the bytes needed per device."""
        paper_weights = load_weights(self.model, self.placement, upload=False, map_weights=self.map_weights)
        paper = Context(self.model, paper_weights, self.placement, n_ctx, n_seq_max, n_batch, n_ubatch, kv_unified,
                        allocate=False, type_k=type_k, type_v=type_v)
        per_group = paper.device_bytes()
        need: dict[str, int] = {}
        for backend in self.backends:
            w = paper_weights.bytes_per_backend.get(backend.name, 0)
            g = per_group.get(backend.name, 0)
            need[backend.name] = w + n_groups * g
            free = backend.device_info().free
            if need[backend.name] > free:
                mib = 2 ** 20
                raise PyllamaError(
                    f"not enough memory on {backend.name}: {need[backend.name] / mib:.0f} MiB needed (weights "
                    f"{w / mib:.0f} MiB + {n_groups} group(s) x {g / mib:.0f} MiB of KV cache and compute buffers), "
                    f"{free / mib:.0f} MiB free: short by {(need[backend.name] - free) / mib:.0f} MiB")
        return need

    def new_context(self, n_ctx: int, n_seq_max: int = 1, n_batch: int = 2048, n_ubatch: int = 512,
                    kv_unified: bool = False, type_k: DType = DType.F16, type_v: DType = DType.F16) -> Context:
        """A context with its KV cache in type_k / type_v (F32, F16, BF16, Q8_0; F16 as llama.cpp)."""
        assert self.weights is not None, "load() the weights first"
        ctx = Context(self.model, self.weights, self.placement, n_ctx, n_seq_max, n_batch, n_ubatch, kv_unified,
                      type_k=type_k, type_v=type_v)
        self._contexts.add(ctx)
        return ctx

    # --- moving layers -----------------------------------------------------------------------
    def counts(self) -> list[int]:
        """Blocks per device, in device order."""
        return counts_of(self.placement.layer_backend, len(self.backends))

    def move_layers(self, counts: Sequence[int]) -> list[int]:
        """Re-splits the blocks as `counts` (blocks per device, contiguous in device order, as -ts
        gives them), moving each block whose device changes with its weights and every context's
        KV cache, contents included: sequences go on where they were. Everything is first made on
        the new devices (weights loaded there, KV caches copied); only then do the contexts switch
        and the old copies go, so a failure (too little memory, a lost peer) raises and leaves the
        split as it was. The embedding and the output layer stay where they are, so every device
        keeps at least one block. No context may be in use. Returns the blocks that moved."""
        hp = self.model.hparams
        if len(counts) != len(self.backends) or sum(counts) != hp.n_layer or min(counts) < 1:
            raise ValueError(f"a split of {hp.n_layer} blocks over {len(self.backends)} devices, at least one "
                             f"each, was asked; got {list(counts)}")
        assert self.weights is not None, "load() the weights first"
        layout = split_layers(hp.n_layer, counts)
        moved = [il for il, (a, b) in enumerate(zip(self.placement.layer_backend, layout)) if a != b]
        if not moved:
            return []
        target = Placement(self.backends, layout)
        contexts = list(self._contexts)
        fresh = load_weights(self.model, target, map_weights=self.map_weights, layers=set(moved))
        staged = []
        try:
            for ctx in contexts:
                staged.append(ctx.stage_kv(moved, [self.backends[layout[il]] for il in moved]))
            for b in {id(b): b for b in (self.backends[layout[il]] for il in moved)}.values():
                b.synchronize()  # the weights' uploads are one-way too
        except BaseException:
            for ctx_staged in staged:
                for _, buf, _, _ in ctx_staged:
                    buf.backend.free_buffer(buf)
            fresh.free()
            raise
        # from here on the contexts switch to the new copies; what fails now (freeing an old copy,
        # sizing compute buffers on a peer that went away) is logged, the move stands
        was = self.counts()
        self.placement.layer_backend[:] = layout
        old = self.weights.replace_layers(fresh)
        for b in self.backends:
            b.layout.drop_weights([t for t in old if t.buffer is not None and t.buffer.backend is b])
        for ctx, ctx_staged in zip(contexts, staged):
            ctx.commit_kv(ctx_staged)
        log.info("blocks %s moved: %s -> %s (%s)", _span(moved), _split_text(was), _split_text(counts),
                 self.placement.describe())
        return moved

    # --- lost peers ----------------------------------------------------------------------------
    def lost_devices(self) -> dict[str, str]:
        """The devices that cannot be used any more, by name, with the reason (naming the peer)."""
        return lost_devices(self.backends)

    def reach_lost_devices(self) -> None:
        """Opens a new connection to the peer of every lost device; raises the error of the first
        that cannot be reached yet. Safe while contexts decode: nothing they use changes."""
        for b in remote_devices(self.backends):
            if b.lost():
                b.reach()

    def restore_lost_devices(self) -> list[str]:
        """Re-creates on every lost device what it held: its buffers (weights, each context's KV
        cache and compute buffers) allocated again, the weights written again (a peer with a
        weight cache takes them from there), and every context's KV cache emptied, since part of
        each sequence went with the peer. Returns the names of the restored devices; raises
        (RPCError) if a peer fails meanwhile, leaving it lost. No context may be in use."""
        restored = []
        for b in remote_devices(self.backends):
            if not b.lost():
                continue
            try:
                b.reconnect()
                if self.weights is not None:
                    self.weights.upload(self.model, b)
                b.synchronize()  # the uploads are one-way: their errors come back here
            except BaseException:
                b.disconnect()  # half restored is not restored: it stays lost, to be tried again
                raise
            restored.append(b.name)
        if restored:
            for ctx in list(self._contexts):
                ctx.clear()
            log.warning("restored %s: weights uploaded again, %d context(s) emptied", ", ".join(restored),
                        len(self._contexts))
        return restored

    def disconnect(self) -> None:
        """Drops the connections to every peer: a thread waiting on one gets an error at once.
        For shutting down; the engine cannot compute on its remote devices afterwards."""
        for b in remote_devices(self.backends):
            b.disconnect()

    def close(self) -> None:
        if self.weights is not None:
            self.weights.free()
        for b in self.backends:
            b.close()


def _span(layers: Sequence[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])


def _split_text(counts: Sequence[int]) -> str:
    return ",".join(str(n) for n in counts)
