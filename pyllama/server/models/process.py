"""One model's server process: started with its command line, ready once its /health answers 200,
stopped with SIGTERM (then SIGKILL after its stop timeout). Its output goes to the router's stderr,
each line prefixed with the model's name."""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import sys
from typing import Optional, Sequence

log = logging.getLogger("pyllama.server")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends it SIGTERM if the router dies without stopping it
    (killed with SIGKILL), so that no model server outlives its router."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the router's own shutdown still stops its children
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the child binds it a moment later, as llama-server's router does)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def http_status(host: str, port: int, path: str, timeout: float = 2.0) -> Optional[int]:
    """The status of GET path, None when nothing answers."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        line = await asyncio.wait_for(reader.readline(), timeout)
        parts = line.split()
        return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
    except (OSError, asyncio.TimeoutError, ValueError):
        return None
    finally:
        if writer is not None:
            writer.close()


class ModelProcess:
    """A child `python -m pyllama.server` for one model."""

    def __init__(self, name: str, argv: Sequence[str], port: int, env: dict[str, str], stop_timeout: float) -> None:
        self.name = name
        self.argv = list(argv)
        self.port = port
        self.env = env
        self.stop_timeout = stop_timeout
        self.proc: Optional[asyncio.subprocess.Process] = None
        self.stopping = False  # the router asked it to stop (its exit is then no failure)
        self._pump: Optional[asyncio.Task] = None

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.returncode if self.proc is not None else None

    async def start(self) -> None:
        """Spawns the child; OSError when it cannot be started."""
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env=self.env, preexec_fn=_die_with_parent)
        log.info("model %s: server process %d started on port %d", self.name, self.proc.pid, self.port)
        self._pump = asyncio.ensure_future(self._forward_output())

    async def _forward_output(self) -> None:
        # read in blocks, not lines: a line longer than the reader's limit (a -v dump) must not end
        # the draining, or the child would block on a full pipe
        assert self.proc is not None and self.proc.stdout is not None
        prefix = f"[{self.name}] ".encode()
        out = sys.stderr.buffer
        pending = b""
        while True:
            data = await self.proc.stdout.read(1 << 16)
            pending += data
            *lines, pending = pending.split(b"\n")
            if not data and pending:
                lines, pending = lines + [pending], b""
            elif len(pending) > 1 << 16:
                lines, pending = lines + [pending], b""
            if lines:
                try:
                    out.write(b"".join(prefix + line + b"\n" for line in lines))
                    out.flush()
                except (OSError, ValueError):  # the router's stderr is gone: keep draining the pipe
                    pass
            if not data:
                break

    async def wait_ready(self, poll_s: float = 0.1) -> bool:
        """True once /health answers 200; False if the child exits first."""
        assert self.proc is not None
        while self.proc.returncode is None:
            if await http_status("127.0.0.1", self.port, "/health") == 200:
                return True
            try:
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), poll_s)
            except asyncio.TimeoutError:
                pass
        return False

    async def wait(self) -> int:
        """The exit status, once the child has exited and its output is drained."""
        assert self.proc is not None
        code = await self.proc.wait()
        if self._pump is not None:
            try:
                await asyncio.wait_for(self._pump, 5.0)
            except asyncio.TimeoutError:
                self._pump.cancel()
        return code

    async def stop(self, force: bool = False) -> int:
        """SIGTERM (SIGKILL when `force`: a load being cancelled), SIGKILL after the stop timeout."""
        self.stopping = True
        proc = self.proc
        if proc is None:
            return 0
        if proc.returncode is None:
            try:
                proc.send_signal(signal.SIGKILL if force else signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), self.stop_timeout)
            except asyncio.TimeoutError:
                log.warning("model %s: server process %d still running %.0f s after SIGTERM: killing it", self.name,
                            proc.pid, self.stop_timeout)
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
        return await self.wait()

    def kill_now(self) -> None:
        """Last resort (the router exits without its loop): SIGKILL."""
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
