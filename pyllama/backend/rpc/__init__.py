"""The client side of a device of another machine, behind `python -m pyllama.rpc_server` (backend.py)."""
from .backend import RPCBackend, RPCBuffer, RPCLane, RPCError, tensor_bytes

__all__ = ["RPCBackend", "RPCBuffer", "RPCError", "RPCLane", "tensor_bytes"]
