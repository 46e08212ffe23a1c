"""An authenticated RPC server: challenge-response with a shared token that never crosses the wire,
nothing served before it, clear refusals at both ends, unauthenticated setups unchanged."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.rpc import auth
from pyllama.rpc import protocol as P
from pyllama.rpc.connection import Connection, RPCError, set_token
from pyllama.rpc.protocol import Cap, Cmd
from pyllama.rpc_server import ServerThread
from pyllama.rpc_server.__main__ import exposure_warning
from server_util import RPCServerProcess
from test_rpc_server import Client

TOKEN = b"0123456789abcdef0123456789abcdef"
PROMPT = "The little cat sat on the"


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_bytes(TOKEN + b"\n")
    path.chmod(0o600)
    return str(path)


def generate(model: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyllama.generate", "-m", model, "-p", PROMPT, "-n", "12",
                           "--temp", "0", "--ignore-eos", "--tokens", "-t", "1", *args],
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYLLAMA_RPC_TOKEN": "", **(env or {})})


def test_split_with_the_token_equals_local(tiny_model, token_file, tmp_path):
    local = generate(tiny_model)
    assert local.returncode == 0, local.stderr
    peer = RPCServerProcess("--auth-token-file", token_file)
    try:
        split = ["--rpc", peer.endpoint, "--device", "RPC0,CPU"]
        ok = generate(tiny_model, *split, "--rpc-token-file", token_file)
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout == local.stdout
        by_env = generate(tiny_model, *split, env={"PYLLAMA_RPC_TOKEN": TOKEN.decode()})
        assert by_env.stdout == local.stdout, by_env.stderr

        missing = generate(tiny_model, *split)
        assert missing.returncode == 1 and "requires a token" in missing.stderr
        assert "Traceback" not in missing.stderr
        wrong = tmp_path / "wrong"
        wrong.write_bytes(b"not-the-token-but-long-enough\n")
        bad = generate(tiny_model, *split, "--rpc-token-file", str(wrong))
        assert bad.returncode == 1 and "wrong token on one side" in bad.stderr
        # the server keeps serving authenticated clients after the refusals
        assert generate(tiny_model, *split, "--rpc-token-file", token_file).stdout == local.stdout
    finally:
        assert peer.stop() == 0
    plain = RPCServerProcess()
    try:
        refused = generate(tiny_model, "--rpc", plain.endpoint, "--device", "RPC0,CPU", "--rpc-token-file", token_file)
        assert refused.returncode == 1 and "does not authenticate" in refused.stderr
        assert generate(tiny_model, "--rpc", plain.endpoint, "--device", "RPC0,CPU").stdout == local.stdout
    finally:
        assert plain.stop() == 0


def test_bad_token_files_are_one_line_errors(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"abc\n")
    for args, needle in [(["--auth-token-file", str(short)], "at least 16 bytes"),
                         (["--auth-token-file", str(tmp_path / "none")], "No such file")]:
        p = subprocess.run([sys.executable, "-m", "pyllama.rpc_server", "--port", "0", *args], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYLLAMA_RPC_TOKEN": ""})
        assert p.returncode == 1 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_exposure_warning():
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("::1", None) is None
    assert "without --auth-token-file" in exposure_warning("0.0.0.0", None)
    assert exposure_warning("0.0.0.0", TOKEN) is None


# --- the wire, with a raw client ----------------------------------------------------------------

class Raw(Client):
    """The raw frame client of test_rpc_server, recording every byte it sends."""

    def __init__(self, port: int):
        self.sent = bytearray()
        super().__init__(port, hello=False)

    def send(self, cmd: int, payload: bytes = b"") -> None:
        self.sent += P.HEADER.pack(int(cmd), len(payload)) + payload
        super().send(cmd, payload)

    def hello(self) -> int:
        return P.HELLO_REP.unpack(self.ok(Cmd.HELLO, P.HELLO_REQ.pack(*P.VERSION, 0)))[4]


@pytest.fixture
def guarded():
    st = ServerThread(port=0, backend_factory=lambda: CPUBackend(1), token=TOKEN, caps_mask=0)
    st.start()
    yield st
    st.stop()


def test_nothing_is_served_before_authentication(guarded):
    c = Raw(guarded.port)
    assert c.hello() == Cap.AUTH  # advertised even with every optional capability masked
    c.send(Cmd.DEVICE_COUNT)
    status, msg = c.reply()
    assert status == P.STATUS_ERROR and b"authentication required" in msg
    assert c.closed_by_server()
    c.close()
    # a large frame before authentication is refused from its header, never buffered
    c = Raw(guarded.port)
    c.hello()
    c.sock.sendall(P.HEADER.pack(Cmd.SET_TENSOR, 1 << 30))
    status, msg = c.reply()
    assert status == P.STATUS_ERROR and c.closed_by_server()
    c.close()
    assert guarded.server.allocated() == 0


def test_wrong_proof_closes_and_right_proof_opens(guarded):
    c = Raw(guarded.port)
    c.hello()
    cn = auth.new_nonce()
    c.send(Cmd.AUTH, bytes([auth.STEP_BEGIN]) + cn)
    status, sn = c.reply()
    assert status == 0 and len(sn) == auth.NONCE  # a nonce only: the client proves first
    c.send(Cmd.AUTH, bytes([auth.STEP_PROVE]) + auth.client_proof(b"x" * 32, cn, sn))
    status, msg = c.reply()
    assert status == P.STATUS_ERROR and b"authentication failed" in msg and c.closed_by_server()
    c.close()

    c = Raw(guarded.port)
    c.hello()
    cn = auth.new_nonce()
    c.send(Cmd.AUTH, bytes([auth.STEP_BEGIN]) + cn)
    sn = c.reply()[1]
    c.send(Cmd.AUTH, bytes([auth.STEP_PROVE]) + auth.client_proof(TOKEN, cn, sn))
    status, proof = c.reply()
    assert status == 0 and auth.verify(auth.server_proof(TOKEN, cn, sn), proof)  # then the server proves
    c.send(Cmd.DEVICE_COUNT)
    assert c.reply() == (0, P.U32.pack(1))
    c.send(Cmd.AUTH, bytes([auth.STEP_BEGIN]) + cn)  # once is enough
    status, msg = c.reply()
    assert status == P.STATUS_ERROR and b"already authenticated" in msg
    assert TOKEN not in bytes(c.sent)  # the token itself never crossed the wire
    c.close()


def test_a_client_of_protocol_1_0_is_told_to_upgrade(guarded):
    """1.0 clients expected the server to prove first; that order is not served any more."""
    c = Raw(guarded.port)
    assert P.HELLO_REP.unpack(c.ok(Cmd.HELLO, P.HELLO_REQ.pack(1, 0, 0, 0)))[4] == Cap.AUTH
    status, msg = c.call(Cmd.AUTH, bytes([auth.STEP_BEGIN]) + auth.new_nonce())
    assert status == P.STATUS_ERROR and b"upgrade the client" in msg and c.closed_by_server()
    c.close()


def test_client_connection_proves_and_checks(guarded):
    set_token(TOKEN)
    try:
        conn = Connection(f"127.0.0.1:{guarded.port}")
        assert conn.has(Cap.AUTH)
        assert conn.call(Cmd.DEVICE_COUNT) == P.U32.pack(1)
        conn.close()
        set_token(b"y" * 32)
        with pytest.raises(RPCError, match="wrong token on one side"):
            Connection(f"127.0.0.1:{guarded.port}")
        set_token(None)
        with pytest.raises(RPCError, match="requires a token"):
            Connection(f"127.0.0.1:{guarded.port}")
    finally:
        set_token(None)
        import pyllama.rpc.connection as c
        c._token_set = False


def test_a_client_without_the_token_gets_nothing_that_depends_on_it(monkeypatch):
    """The client proves first: a peer guessing the token receives the server's nonce and a refusal,
    never an HMAC of the token it could test guesses against offline. With the server's nonce fixed,
    every byte it receives is the same whatever the server's token."""
    monkeypatch.setattr(auth, "new_nonce", lambda: b"\x07" * auth.NONCE)
    cn = b"\x01" * auth.NONCE
    transcripts = []
    for token in (TOKEN, b"another token, just as long as the first"):
        st = ServerThread(port=0, backend_factory=lambda: CPUBackend(1), token=token, caps_mask=0)
        st.start()
        try:
            c = Raw(st.port)
            c.hello()  # its reply carries the server's random id: not part of the comparison
            got = bytearray()
            status, rep = c.call(Cmd.AUTH, bytes([auth.STEP_BEGIN]) + cn)
            got += bytes([status]) + rep
            assert status == P.STATUS_OK and len(rep) == auth.NONCE
            guess = auth.client_proof(b"a guessed token of 32 bytes ....", cn, rep[:auth.NONCE])
            status, msg = c.call(Cmd.AUTH, bytes([auth.STEP_PROVE]) + guess)
            got += bytes([status]) + msg
            assert status == P.STATUS_ERROR and b"authentication failed" in msg
            assert c.closed_by_server()
            c.close()
            transcripts.append(bytes(got))
        finally:
            st.stop()
    assert transcripts[0] == transcripts[1]


def test_the_client_still_authenticates_to_a_server_of_protocol_1_0():
    """A 1.0 server proves first (step 1: nonce and proof, step 2: empty): the client checks that
    proof before it proves, then goes on; a 1.0 server without our token is refused unproven."""
    import socket
    import threading

    def old_server(sock: socket.socket, token: bytes, got: list) -> None:
        conn, _ = sock.accept()
        with conn:
            def read(n: int) -> bytes:
                buf = b""
                while len(buf) < n:
                    chunk = conn.recv(n - len(buf))
                    if not chunk:
                        raise EOFError
                    buf += chunk
                return buf

            def reply(payload: bytes, status: int = 0) -> None:
                conn.sendall(P.HEADER.pack(status, len(payload)) + payload)
            try:
                while True:
                    cmd, size = P.HEADER.unpack(read(P.HEADER.size))
                    body = read(size)
                    got.append((cmd, body))
                    if cmd == Cmd.HELLO:
                        reply(P.HELLO_REP.pack(1, 0, 0, 0, int(Cap.AUTH), 7))
                    elif cmd == Cmd.AUTH and body[0] == auth.STEP_BEGIN:
                        cn, sn = body[1:], b"\x05" * auth.NONCE
                        reply(sn + auth.server_proof(token, cn, sn))
                    elif cmd == Cmd.AUTH:  # 1.0: an empty reply accepts
                        if auth.verify(auth.client_proof(token, cn, sn), body[1:]):
                            reply(b"")
                        else:
                            reply(b"authentication failed", P.STATUS_ERROR)
                    elif cmd == Cmd.DEVICE_COUNT:
                        reply(P.U32.pack(1))
            except (EOFError, OSError):
                pass

    for server_token, ok in ((TOKEN, True), (b"y" * 32, False)):
        listener = socket.create_server(("127.0.0.1", 0))
        got: list = []
        th = threading.Thread(target=old_server, args=(listener, server_token, got), daemon=True)
        th.start()
        set_token(TOKEN)
        try:
            endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
            if ok:
                conn = Connection(endpoint)
                assert conn.call(Cmd.DEVICE_COUNT) == P.U32.pack(1)
                conn.close()
            else:
                with pytest.raises(RPCError, match="does not hold our token"):
                    Connection(endpoint)
        finally:
            set_token(None)
            import pyllama.rpc.connection as c
            c._token_set = False
            th.join(5)
            listener.close()
        steps = [body[0] for cmd, body in got if cmd == Cmd.AUTH]
        assert steps == ([auth.STEP_BEGIN, auth.STEP_PROVE] if ok else [auth.STEP_BEGIN])  # unproven when wrong
