"""The RPC wire protocol and the client connection, shared by both ends (docs/rpc-protocol.md)."""
