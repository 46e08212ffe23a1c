"""Starting and stopping a real `python -m pyllama.server` process for tests."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Optional


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def child_pids(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (a zombie waiting for its parent does not count)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Server flags for tests whose slots hold more positions than the tiny test models' training
# context (512), which a slot's context is otherwise capped at, as llama-server caps it.
LONG_CONTEXT = ("--override-kv", "llama.context_length=int:131072")


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON (a client's parser refuses it)")


def strict_json(text):
    """json.loads that refuses what strict parsers (browsers, Go, serde) refuse: NaN, Infinity."""
    return json.loads(text, parse_constant=_not_json)


class ServerProcess:
    def __init__(self, model: str, *args: str, env: Optional[dict] = None):
        self.port = free_port()
        model_args = ["-m", model] if model else []
        cmd = [sys.executable, "-m", "pyllama.server", *model_args, "--port", str(self.port), "-t", "1", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        # read both pipes all along: a server that logs a lot must never block on a full pipe
        self._out: list[str] = []
        self._err: list[str] = []
        self._drains = [threading.Thread(target=lambda f=f, b=b: b.extend(f), daemon=True)
                        for f, b in ((self.proc.stdout, self._out), (self.proc.stderr, self._err))]
        for t in self._drains:
            t.start()

    def log_tail(self, n: int = 20) -> str:
        """The last n lines the server wrote on stdout and on stderr so far."""
        return "".join(self._out[-n:] + self._err[-n:])

    def _collect(self) -> None:
        for t in self._drains:
            t.join(10)
        self.stderr_text = "".join(self._err)

    def wait_ready(self, timeout: float = 60) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._collect()
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.stderr_text}")
            try:
                status, _ = self.request("GET", "/health")
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError("server did not become ready")

    def request(self, method: str, path: str, body: Any = None, raw: Optional[bytes] = None,
                headers: Optional[dict] = None, timeout: float = 60) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            payload = resp.read()
            ctype = resp.getheader("Content-Type", "")
            return resp.status, strict_json(payload) if "json" in ctype and payload else payload.decode()
        finally:
            conn.close()

    def post(self, path: str, body: Any, **kw) -> tuple[int, Any]:
        return self.request("POST", path, body, **kw)

    def stream(self, path: str, body: dict, timeout: float = 60) -> list[Any]:
        """POSTs with stream=true; returns the decoded `data:` events ('[DONE]' kept as a string)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            events = []
            for line in resp.read().decode().split("\n"):
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else strict_json(data))
            return events
        finally:
            conn.close()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Stops the server; what it wrote on stderr is kept in `stderr_text`."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._collect()
        return self.proc.returncode


class RPCServerProcess:
    """`python -m pyllama.rpc_server` on a free loopback port (read from its 'listening on' line)."""

    def __init__(self, *args: str, env: Optional[dict] = None):
        cmd = [sys.executable, "-m", "pyllama.rpc_server", "--host", "127.0.0.1", "--port", "0", "-t", "1", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, text=True)
        deadline = time.monotonic() + 60
        self.port = 0
        self.log: list[str] = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"rpc_server exited {self.proc.wait()}: {''.join(self.log)}")
            self.log.append(line)
            if "listening on" in line:
                self.port = int(line.rsplit(":", 1)[1].split()[0])
                break
        if not self.port:
            raise TimeoutError("rpc_server did not start")
        self.endpoint = f"127.0.0.1:{self.port}"
        # keep draining stderr so the server never blocks on a full pipe
        import threading
        self._drain = threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True)
        self._drain.start()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def run_generate(model: str, prompt: str, n: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python -m pyllama.generate`: greedy, n tokens, EOS ignored, the ids printed, one thread."""
    return subprocess.run([sys.executable, "-m", "pyllama.generate", "-m", model, "-p", prompt, "-n", str(n),
                           "--temp", "0", "--ignore-eos", "--tokens", "-t", "1", *args],
                          capture_output=True, text=True, timeout=timeout)


def generated_tokens(model: str, prompt: str, n: int, *args: str) -> list[int]:
    proc = run_generate(model, prompt, n, *args)
    assert proc.returncode == 0, proc.stderr
    return [int(x) for x in proc.stdout.split()]


def assert_same_tokens_in_two_groups(model: str, prompt: str, n: int, expected: list[int]) -> None:
    """A server with 2 pipeline groups gives `expected`, greedy, to one request per group."""
    srv = ServerProcess(model, "-np", "2", "-c", "512", "--pipeline-groups", "2").wait_ready()
    try:
        for _ in range(2):
            status, res = srv.post("/completion", {"prompt": prompt, "n_predict": n, "temperature": 0,
                                                   "ignore_eos": True, "cache_prompt": False, "return_tokens": True})
            assert status == 200, res
            assert res["tokens"] == expected
    finally:
        assert srv.stop() == 0
