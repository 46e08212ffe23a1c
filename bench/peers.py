"""llama.cpp's programs, for side-by-side figures in the benches (never needed by the project).

    from peers import Peers
    peers = Peers.find(args.peers)      # None without a folder: the bench skips that column
    out = peers.run("llama-batched-bench", "-m", path, ...)

The folder holds `bin/` with the programs and their shared libraries. A copy of such a folder
can lose its library symlinks (each becomes a small text file holding the target's name), and the
loader then fails with "file too short"; `Peers` rebuilds those links in a temporary folder put
first on LD_LIBRARY_PATH, leaving the folder itself untouched.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import Optional, Sequence



class Peers:
    def __init__(self, folder: str):
        self.bin = os.path.join(folder, "bin")
        self._libdir = tempfile.mkdtemp(prefix="pyllama-peers-")
        for name in os.listdir(self.bin):
            path = os.path.join(self.bin, name)
            if ".so" not in name or os.path.islink(path) or os.path.getsize(path) > 256:
                continue
            with open(path, "rb") as fh:
                target = fh.read().decode("utf-8", "replace").strip()
            if target and "/" not in target and os.path.exists(os.path.join(self.bin, target)):
                os.symlink(os.path.join(self.bin, target), os.path.join(self._libdir, name))
        self.env = dict(os.environ)
        self.env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (self._libdir, self.bin, os.environ.get("LD_LIBRARY_PATH", "")) if p)

    @classmethod
    def find(cls, folder: Optional[str] = None) -> Optional["Peers"]:
        """The peers in `folder` (else $PYLLAMA_PEERS), or None when neither names one."""
        folder = folder or os.environ.get("PYLLAMA_PEERS")
        if not folder:
            return None
        if not os.path.isfile(os.path.join(folder, "bin", "llama-batched-bench")):
            return None
        return cls(folder)

    def path(self, program: str) -> str:
        return os.path.join(self.bin, program)

    def run(self, program: str, *args: str, timeout: float = 1800) -> str:
        """Runs a program to completion; returns its stdout (raises with its stderr tail on failure)."""
        proc = subprocess.run([self.path(program), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{program} exited {proc.returncode}: {proc.stderr[-2000:]}")
        return proc.stdout

    def popen(self, program: str, *args: str, wrap: Sequence[str] = (), env: Optional[dict] = None,
              **kwargs) -> subprocess.Popen:
        """Starts a program; `wrap` goes before it (e.g. `chrt -f 40`); `env` adds variables."""
        return subprocess.Popen([*wrap, self.path(program), *args], env={**self.env, **(env or {})}, **kwargs)

    def close(self) -> None:
        shutil.rmtree(self._libdir, ignore_errors=True)
