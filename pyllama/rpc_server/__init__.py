"""The RPC server program: exposes this machine's device to a pyllama server over TCP.

Run it with `python -m pyllama.rpc_server`; the wire is described in docs/rpc-protocol.md. It has no
authentication: bind it to loopback (the default) or a trusted network only.
"""
from .server import RPCServer, ServerThread

__all__ = ["RPCServer", "ServerThread"]
