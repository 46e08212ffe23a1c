"""A peer's weight layout: the types its device holds decide what each weight is sent as."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...ir.tensor import DType
from ...rpc.connection import RPCError
from ..layout import WeightLayout

if TYPE_CHECKING:
    from .backend import RPCBackend

__all__ = ["PeerLayout"]


class PeerLayout(WeightLayout):
    """The layout of a device behind an rpc server (the peer keeps its own: a CPU peer repacks)."""

    backend: "RPCBackend"

    def weight_dtype(self, file_dtype: DType) -> DType:
        # A peer gets each weight in its file type when it holds that type (the file's bytes go
        # up as they are: a CPU peer computes on them as the local CPU backend does). Otherwise a
        # GPU peer takes it in F16, as the local CUDA backend stores it (converted here, on the
        # host); a CPU peer without DEVICE_TYPES (an older server) computes in F32.
        peer = self.backend
        held = peer.weight_types
        if file_dtype in held:
            return file_dtype
        if DType.F16 in held:
            return DType.F16
        if peer.peer_types() is None:
            return DType.F32
        raise RPCError(f"{peer.name}: the RPC server at {peer.conn.endpoint} cannot hold {file_dtype.name} weights "
                       f"(it holds {', '.join(sorted(t.name for t in held))}); run a server that does, or keep "
                       "these layers on another device")
