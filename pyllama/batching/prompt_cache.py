"""Prompt cache in host memory (`--cache-ram`): the KV rows of prompts that slots gave up.

A slot holds one cached prompt; when it takes a request that shares little with it, the old prompt
would be lost and computed again when its conversation comes back. Instead its tokens and KV rows
(`Context.read_seq`) go here, and a request whose prompt shares a longer prefix with an entry than
with its slot's own cache starts from that entry (`Context.write_seq`). One cache serves every
pipeline group: the rows are host bytes in the cache's types, the same for every group's context.
Entries go least recently used first once the total passes the limit.

Admission: a slot's prompt is kept only when its request looked like part of a conversation: its
prompt began with the whole of a prompt seen before (a conversation's next turn, a repeated or
regenerated prompt: what came back once comes back again), or with the same SYSTEM_PREFIX tokens
as one (a system prompt: the mark of an application whose conversations come back; a chat
template's own markup is far shorter). Anything else is let go at its first appearance, neither
copied nor held, only remembered (`sight`: hashes, SIGHTINGS prompts, no rows) so that its return
is recognised. One-off prompts come back rarely: copying each (from a peer, over the wire) would
cost the steps time and fill the host memory for nothing.

The copy is made off the decode thread: the group holds the sequence's KV blocks (they stay out of
the pool, unchanged, while the slot moves on) and `RowCopier`'s thread reads them into an entry
reserved for them; a request that would load an entry still being copied waits for that copy.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from .slot import common_prefix

log = logging.getLogger("pyllama.server")

# prompts remembered for admission (three ints each, some 4 MiB in all); a conversation's turns
# come back far sooner than this many other prompts
SIGHTINGS = 16384

# a prompt prefix this long shared with an earlier prompt is taken for a system prompt (four KV blocks)
SYSTEM_PREFIX = 64

# A loss shorter than one KV block is cheaper to compute again than to copy out and back.
MIN_TOKENS = 16

Rows = list[tuple[np.ndarray, np.ndarray]]


@dataclass
class Entry:
    tokens: list[int]
    rows: Optional[Rows]  # None while its copy is under way (`ready` not set) or after it failed
    nbytes: int
    used: int = field(default=0)
    ready: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float) -> Optional[Rows]:
        """The rows once copied; None when the copy failed or takes longer than `timeout`."""
        self.ready.wait(timeout)
        return self.rows


def _key(tokens: Sequence[int]) -> bytes:
    """Entries are found by their first MIN_TOKENS tokens: a prompt sharing fewer with an entry
    would not load it (see MIN_TOKENS), so no lookup needs to look past its own bucket."""
    return np.asarray(tokens[:MIN_TOKENS], dtype=np.int64).tobytes()


def _starts(longer: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(longer) >= len(prefix) and common_prefix(longer, prefix) == len(prefix)


class PromptCache:
    def __init__(self, limit_bytes: int, sightings: int = SIGHTINGS):
        """limit_bytes < 0: no limit."""
        self.limit = limit_bytes
        self._buckets: dict[bytes, list[Entry]] = {}
        self.nbytes = 0
        self._clock = 0
        self._lock = threading.Lock()
        # prompts seen (head, length, hash of the tokens), oldest first, and per head their lengths
        self._seen: "OrderedDict[tuple[int, int, int], None]" = OrderedDict()
        self._lengths: dict[int, dict[int, int]] = {}
        self._prefixes: "OrderedDict[int, None]" = OrderedDict()  # hashes of prompts' first SYSTEM_PREFIX
        self._max_seen = sightings
        # for /metrics: copies made and their bytes, dropped prompts let go on a first sighting
        self.n_saved = self.bytes_saved = self.n_not_admitted = 0
        self.copier = RowCopier()

    def sight(self, prompt: Sequence[int]) -> bool:
        """A prompt starts: whether it begins with the whole of a prompt seen before (it repeats or
        continues one) or with the same SYSTEM_PREFIX tokens: its rows are worth keeping when its
        slot drops them. It is remembered."""
        if len(prompt) < MIN_TOKENS:
            return False
        arr = np.asarray(prompt, dtype=np.int64)
        head = hash(arr[:MIN_TOKENS].tobytes())
        with self._lock:
            lengths = self._lengths.setdefault(head, {})
            back = any(n <= len(arr) and (head, n, hash(arr[:n].tobytes())) in self._seen for n in lengths)
            if len(arr) >= SYSTEM_PREFIX:
                prefix = hash(arr[:SYSTEM_PREFIX].tobytes())
                back = back or prefix in self._prefixes
                self._prefixes[prefix] = None
                self._prefixes.move_to_end(prefix)
                if len(self._prefixes) > self._max_seen:
                    self._prefixes.popitem(last=False)
            key = (head, len(arr), hash(arr.tobytes()))
            if key in self._seen:
                self._seen.move_to_end(key)
            else:
                self._seen[key] = None
                lengths[len(arr)] = lengths.get(len(arr), 0) + 1
                if len(self._seen) > self._max_seen:  # the least recently seen prompt is forgotten
                    (h, n, _), _ = self._seen.popitem(last=False)
                    left = self._lengths[h]
                    left[n] -= 1
                    if not left[n]:
                        del left[n]
                        if not left:
                            del self._lengths[h]
            return back

    def not_admitted(self) -> None:
        """A dropped prompt was let go (its request had not come back): counted for /metrics."""
        with self._lock:
            self.n_not_admitted += 1

    def __len__(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._buckets.values())

    def covers(self, tokens: Sequence[int]) -> bool:
        """Whether an entry already holds these tokens (as its own or a longer prompt's prefix)."""
        with self._lock:
            return any(_starts(e.tokens, tokens) for e in self._buckets.get(_key(tokens), ()))

    def save(self, tokens: Sequence[int], rows: Rows) -> bool:
        """Keeps `rows` (one K and one V array per layer, a row per token) for `tokens` (at least
        MIN_TOKENS), replacing entries whose prompts are prefixes of it. False when it does not fit
        the limit at all."""
        nbytes = sum(k.nbytes + v.nbytes for k, v in rows)
        entry = self.reserve(tokens, nbytes)
        return entry is not None and self.fill(entry, rows)

    def reserve(self, tokens: Sequence[int], nbytes: int) -> Optional[Entry]:
        """An entry for `tokens` whose rows (`nbytes` of them) are still to come (`fill`, or
        `fail`): it covers its tokens at once, and a lookup finding it waits for the rows. Entries
        whose prompts are prefixes of it go. None: shorter than MIN_TOKENS or over the whole limit."""
        tokens = list(tokens)
        if len(tokens) < MIN_TOKENS or 0 <= self.limit < nbytes:
            return None
        key = _key(tokens)
        with self._lock:
            for e in [e for e in self._buckets.get(key, ()) if _starts(tokens, e.tokens)]:
                self._drop(key, e)
            self._clock += 1
            entry = Entry(tokens, None, 0, self._clock)
            self._buckets.setdefault(key, []).append(entry)
        return entry

    def fill(self, entry: Entry, rows: Rows) -> bool:
        """The rows of a reserved entry have come: counted, and older entries go past the limit.
        False when the entry was dropped meanwhile (the rows are let go)."""
        nbytes = sum(k.nbytes + v.nbytes for k, v in rows)
        key = _key(entry.tokens)
        with self._lock:
            try:
                if entry not in self._buckets.get(key, ()):
                    return False
                entry.rows, entry.nbytes = rows, nbytes
                self.nbytes += nbytes
                self.n_saved += 1
                self.bytes_saved += nbytes
                if 0 <= self.limit < self.nbytes:
                    for k, e in sorted(((k, e) for k, b in self._buckets.items() for e in b), key=lambda ke: ke[1].used):
                        if self.nbytes <= self.limit:
                            break
                        self._drop(k, e)
                return entry in self._buckets.get(key, ())
            finally:
                entry.ready.set()

    def fail(self, entry: Entry) -> None:
        """A reserved entry's copy failed: it goes (a waiting lookup finds no rows)."""
        key = _key(entry.tokens)
        with self._lock:
            if entry in self._buckets.get(key, ()):
                self._drop(key, entry)
        entry.ready.set()

    def _drop(self, key: bytes, entry: Entry) -> None:
        bucket = self._buckets[key]
        bucket.remove(entry)
        if not bucket:
            del self._buckets[key]
        self.nbytes -= entry.nbytes

    def best(self, prompt: Sequence[int]) -> tuple[Optional[Entry], int]:
        """The entry sharing the longest prefix with `prompt`, and that length (marked as used);
        (None, 0) when none shares MIN_TOKENS. Its rows may still be on their way (`Entry.wait`)."""
        with self._lock:
            best, n = None, 0
            for e in self._buckets.get(_key(prompt), ()):
                m = common_prefix(e.tokens, prompt)
                if m > n:
                    best, n = e, m
            if best is None or n < MIN_TOKENS:
                return None, 0
            self._clock += 1
            best.used = self._clock
            return best, n

    def families(self) -> list:
        """The cache's /metrics families (metrics.render_families): its bytes against its limit."""
        with self._lock:
            n_entries = sum(len(b) for b in self._buckets.values())
            used, saved, nbytes_saved, skipped = self.nbytes, self.n_saved, self.bytes_saved, self.n_not_admitted
        return cache_families(used, self.limit, n_entries, saved, nbytes_saved, skipped)


def cache_families(used: int, limit: int, n_entries: int = 0, saved: int = 0, nbytes_saved: int = 0,
                   skipped: int = 0) -> list:
    """/metrics families of a prompt cache; limit < 0: none (+Inf), 0: the cache is off."""
    return [
        ("prompt_cache_bytes", "gauge", "Bytes of KV rows held by the prompt cache in host memory (--cache-ram)",
         [({}, used)]),
        ("prompt_cache_limit_bytes", "gauge", "The prompt cache's limit in bytes (--cache-ram; 0: off, +Inf: none)",
         [({}, float("inf") if limit < 0 else limit)]),
        ("prompt_cache_entries", "gauge", "Prompts held by the prompt cache (copies under way included)",
         [({}, n_entries)]),
        ("prompt_cache_saves_total", "counter", "Dropped prompts copied into the prompt cache", [({}, saved)]),
        ("prompt_cache_saved_bytes_total", "counter", "Bytes of KV rows copied into the prompt cache",
         [({}, nbytes_saved)]),
        ("prompt_cache_not_admitted_total", "counter",
         "Dropped prompts not copied: their request neither continued an earlier prompt nor shared its system prompt",
         [({}, skipped)]),
    ]


# How long a decode thread waits for a copy under way (a load of its rows, or its KV blocks back):
# a copy is a read of the rows, bounded on a peer by the RPC timeout; past this the prompt is
# computed instead, and the blocks come back at a later step.
COPY_WAIT_S = 60.0


class RowCopier:
    """One thread that runs the cache's copies in order, started on the first. A copy holds
    nothing the decode threads wait for (their KV blocks are held apart, see PipelineGroup)."""

    def __init__(self) -> None:
        self._jobs: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._start = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="prompt-cache-copy", daemon=True)
                self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - one copy, never the thread (jobs report their own failures)
                log.exception("prompt cache copy failed")
