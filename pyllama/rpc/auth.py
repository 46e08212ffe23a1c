"""Authentication of RPC connections: a shared token, proven by both ends, never sent.

After HELLO, a server configured with a token (`rpc_server --auth-token-file PATH` or
$PYLLAMA_RPC_TOKEN) advertises the AUTH capability and accepts nothing but AUTH until the client
has proven it holds the same token (docs/rpc-protocol.md):

    client -> AUTH  u8 1 | client nonce (32 bytes)
    server <- server nonce (32)
    client -> AUTH  u8 2 | HMAC-SHA256(token, "pyllama-rpc client" | sn | cn)
    server <- HMAC-SHA256(token, "pyllama-rpc server" | cn | sn), or status 1 and the connection closes

The client proves first, so a peer without the token never receives anything derived from it (an
HMAC it could test guessed tokens against offline); the client then checks the server's proof, so
it never goes on with a server that lacks the token. Both comparisons are constant-time; fresh
nonces on both sides make every proof single-use. Servers of protocol 1.0 proved first: a client
still authenticates to them in their order (checking their proof before it proves), while a
server refuses a 1.0 client's AUTH with a message saying to upgrade it.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from typing import Optional

from ..util.errors import PyllamaError
from ..util.settings import current

ENV = "PYLLAMA_RPC_TOKEN"
NONCE = 32
PROOF = 32
MIN_TOKEN = 16  # bytes: shorter tokens are guessable from a captured handshake
STEP_BEGIN, STEP_PROVE = 1, 2
CLIENT_FIRST_VERSION = (1, 1, 0)  # the protocol from which the client proves first


def _proof(token: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token, b"pyllama-rpc " + label + first + second, hashlib.sha256).digest()


def server_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return _proof(token, b"server", client_nonce, server_nonce)


def client_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return _proof(token, b"client", server_nonce, client_nonce)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE)


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def read_token(path: Optional[str], flag: str) -> Optional[bytes]:
    """The token from `path` (its first line, surrounding whitespace dropped), else from
    $PYLLAMA_RPC_TOKEN, else None. A token shorter than 16 bytes is refused."""
    if path:
        try:
            with open(path, "rb") as fh:
                raw = fh.read(4096).split(b"\n", 1)[0].strip()
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise PyllamaError(f"{flag} {path}: {exc.strerror or exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            import logging  # noqa: PLC0415
            logging.getLogger("pyllama.rpc").warning("%s %s: readable by other users (chmod 600 it)", flag, path)
        source = f"{flag} {path}"
    else:
        raw = current().rpc.token
        if raw is None:
            return None
        source = f"${ENV}"
    if len(raw) < MIN_TOKEN:
        raise PyllamaError(f"{source}: the token must be at least {MIN_TOKEN} bytes (e.g. `openssl rand -hex 32`)")
    return raw
