"""A device: what it is and what it can run, the questions placement and the scheduler ask before
anything is allocated or computed on it (ggml-backend's device: description, memory, capabilities)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..ir.tensor import FAMILY_OPS, AttentionParams, DType, Node, Op, family_node

__all__ = ["Device", "DeviceInfo"]


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    kind: str  # "cpu", "cuda", "rpc"
    description: str
    free: int
    total: int


class Device(ABC):
    """One device's description and capabilities."""

    name: str

    host_memory = False  # whether tensors live in this host's memory (host_array gives views)
    # Whether every command reaches the device in the order it is issued and runs after the ones
    # before it (a write after the graphs issued earlier, whatever reads them): then a step's next
    # micro-batch may be issued to this device while its previous one runs on the later stages
    # of a split (Scheduler.compute_ubatches).
    in_order = False
    # whether graph_compute returns before the graph has run (its work queued on the device or a
    # peer); False: it returns when the graph is done, as on a host device
    compute_async = False
    # whether quantized products cost about as much per token in batches of 16-64 rows as in 512
    # (a CPU's kernels; a GPU's need large batches to fill the device)
    small_batches_cheap = False
    # a device of another machine (a RemoteDevice, remote.py): it can be lost, and reconnected
    remote = False

    # the types a graph may give as a weight (MUL_MAT's matrix, GET_ROWS's table): the rpc server
    # accepts exactly these from a client
    weight_types: frozenset = frozenset({DType.F32})

    # the types this device holds a KV cache in (ATTENTION's k_cache, v_cache); a context that asks
    # for another keeps that cache in F32 on this device, and logs it
    kv_types: frozenset = frozenset({DType.F32})

    def holds_kv(self, dtype: DType, head_dim: int) -> bool:
        """Whether this device keeps a KV cache of `dtype` for heads of `head_dim` (a device that
        reads a head at a time needs whole blocks of a block type per head)."""
        return dtype in self.kv_types

    @abstractmethod
    def device_info(self) -> DeviceInfo: ...

    def supports(self, op: int) -> bool:
        """Whether graphs on this device may hold `op` (an Op code); every device runs the core
        ops, optional ones (SAMPLE) depend on the device or, for a peer, its capabilities."""
        return True

    def supports_node(self, node: Node) -> bool:
        """Whether this device runs `node`: its op, and what its parameters ask of it (ATTENTION's
        extensions need the dense families' ops, FAMILY_OPS). A model's load asks this of every
        node of its graph (models/weights.py, check_placement), the scheduler of every plan's."""
        if not self.supports(node.op):
            return False
        if node.op == Op.ATTENTION and not self.alibi_ok and AttentionParams.of(node.params, len(node.srcs)).alibi:
            return False
        return not family_node(node.op, node.params, len(node.srcs)) or all(self.supports(op) for op in FAMILY_OPS)

    # whether ATTENTION's ALiBi slopes are computed here (the CPU's kernel; no peer announces them)
    alibi_ok = False

    def refusal_hint(self) -> str:
        """What to say of this device when a model's node cannot run on it (a peer names itself
        and what would help); empty for a local device."""
        return ""

    def can_copy_from(self, src: "Device") -> bool:
        """Whether cpy_tensor_async can take a tensor of `src` without passing through the host."""
        return False

    def can_copy_to(self, dst: "Device") -> bool:
        """Whether cpy_tensor_from_async takes this device's tensors to `dst` (planned ahead, so
        the scheduler does not stage those copies through the host)."""
        return False

    def end_thread(self) -> None:
        """The calling thread will not use this device again: what the device keeps for that thread
        alone (a GPU's per-thread stream) goes. Nothing on devices without such state."""

    def close(self) -> None:
        """Releases every resource of the device."""
