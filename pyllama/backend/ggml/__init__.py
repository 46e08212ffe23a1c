"""llama.cpp's rpc-server as a peer: ggml's RPC protocol (protocol.py) and a connection to it
(connection.py), with `identify` telling a ggml peer from a pyllama one at connect."""
