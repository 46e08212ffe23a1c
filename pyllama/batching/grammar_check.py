"""A new grammar's first token mask, computed in a child process that can be killed.

llguidance cannot be interrupted, and a 40-byte grammar can make one mask walk for minutes and
gigabytes. So before a grammar is compiled for use, a `FirstMaskChecker` process compiles it and
computes its first mask; a check that has not answered within its time is ended by killing the
process, which gives back its core and its memory at once (a thread could only be left to run to
its end). A process serves one check at a time and stays for the next; killed ones are replaced
when next needed. The processes rebuild the vocabulary's llguidance tokenizer from the token
pieces (`constraint._Vocab.pieces`), encoding forced text greedily: the check measures time, and
the server's own compile (with the model's encoder) makes the matcher that is used.

    python -m pyllama.batching.grammar_check   (started by FirstMaskChecker, not by hand)

The parent sends the pieces once, then grammar texts; the child answers ("ok",) or ("error", why).
A child whose parent has gone exits within a second.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Optional

# A check process's start-up (Python, llguidance and the tokenizer of the vocabulary) is not held
# against a grammar's FIRST_MASK_S, but one that cannot start within this makes checks unavailable.
START_S = 60.0


class CheckUnavailable(RuntimeError):
    """No check process could be started or it failed by itself (not by being too slow)."""


class _Child:
    def __init__(self, pieces: tuple, n_vocab: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pyllama.batching.grammar_check"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.tx = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.rx = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()
        try:
            self.tx.send((pieces, n_vocab))
            if not self.rx.poll(START_S) or self.rx.recv() != ("ready",):
                raise CheckUnavailable(f"the grammar check process did not start within {START_S:g} s")
        except (OSError, EOFError) as exc:
            self.kill()
            raise CheckUnavailable(f"the grammar check process did not start: {exc}") from None
        except BaseException:
            self.kill()
            raise

    def check(self, grammar: str, limit_s: float) -> Optional[tuple]:
        """The child's answer, or None when it did not come within limit_s (the child is then killed)."""
        try:
            self.tx.send(grammar)
            if not self.rx.poll(limit_s):
                self.kill()
                return None
            return self.rx.recv()
        except (OSError, EOFError) as exc:
            self.kill()
            raise CheckUnavailable(f"the grammar check process failed: {exc}") from None

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:  # (already gone)
            pass
        self.proc.wait(timeout=10)
        for conn in (self.tx, self.rx):
            conn.close()


class FirstMaskChecker:
    """Processes that check grammars' first masks for one vocabulary, one check each at a time.
    The callers bound how many checks run at once (constraint.MAX_CHECKS), so that many idle
    processes stay at most."""

    def __init__(self, pieces: tuple, n_vocab: int) -> None:
        self._pieces = pieces
        self._n_vocab = n_vocab
        self._idle: list[_Child] = []
        self._lock = threading.Lock()
        self.killed = 0  # checks ended by killing their process (for tests and logs)
        # the idle processes end with the checker, or at exit
        weakref.finalize(self, _kill_all, self._idle, self._lock)

    def check(self, grammar: str, limit_s: float) -> tuple[bool, str]:
        """(True, "") when the grammar's first mask came within limit_s; (False, why) when it did
        not or failed. Raises CheckUnavailable when no process can do the check."""
        with self._lock:
            child = self._idle.pop() if self._idle else None
        if child is None or child.proc.poll() is not None:
            child = _Child(self._pieces, self._n_vocab)
        t0 = time.monotonic()
        answer = child.check(grammar, limit_s)
        if answer is None:
            with self._lock:
                self.killed += 1
            return False, f"its first token mask takes more than {limit_s:g} s"
        with self._lock:
            self._idle.append(child)
        if answer[0] == "ok":
            return True, ""
        if answer[0] == "error":
            return False, f"its first token mask failed: {answer[1]}"
        raise CheckUnavailable(f"the grammar check process answered {answer!r} after {time.monotonic() - t0:.1f} s")

    def pids(self) -> list[int]:
        """The idle check processes' ids."""
        with self._lock:
            return [c.proc.pid for c in self._idle]

    def close(self) -> None:
        _kill_all(self._idle, self._lock)


def _kill_all(idle: list[_Child], lock: threading.Lock) -> None:
    with lock:
        children = list(idle)
        idle.clear()
    for child in children:
        child.kill()


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(0)


def main() -> int:
    # replies go on the original stdout; anything else written to stdout lands on stderr
    rx = Connection(os.dup(0), writable=False)
    tx = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    import llguidance as llg
    import numpy as np

    from .constraint import _Vocab
    try:
        (tokens, special, eos, bos), n_vocab = rx.recv()
    except EOFError:
        return 0
    vocab = _Vocab(tokens, special, eos, bos)
    lt = llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=n_vocab, eos_token=eos)
    mask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
    tx.send(("ready",))
    while True:
        try:
            grammar = rx.recv()
        except EOFError:
            return 0
        matcher = llg.LLMatcher(lt, grammar, log_level=0)
        if not matcher.is_error():
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        tx.send(("error", matcher.get_error()) if matcher.is_error() else ("ok",))
        del matcher


if __name__ == "__main__":
    sys.exit(main())
