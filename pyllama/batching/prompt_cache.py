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
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from .slot import SlotState, common_prefix

if TYPE_CHECKING:
    from ..runtime.context import Context
    from .slot import Slot
    from .task import CompletionTask

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


class GroupPromptCache:
    """The host prompt cache as one pipeline group uses it: a slot's prompt is saved into it when
    its cells are about to be dropped (the cache's copier thread reads them while their KV blocks
    are held out of the pool), a starting prompt is loaded from the entry it shares most with, and
    held blocks go back once copied. Decode thread only (the KV bookkeeping); without --cache-ram
    (`cache` None) only the room checks of slot restores use it."""

    def __init__(self, ctx: "Context") -> None:
        self.ctx = ctx
        self.cache: Optional[PromptCache] = None  # --cache-ram, shared by every group (set by the server)
        self.idle_slots = False  # --cache-idle-slots: idle slots saved there when a request starts
        # KV blocks kept out of the pool while the cache's copier reads them: (blocks, copied)
        self.held: deque[tuple[list[int], threading.Event]] = deque()
        self._came_back: set[int] = set()  # slots whose request repeated or continued an earlier prompt

    def start(self, slot: "Slot", task: "CompletionTask", n_keep: int) -> int:
        """A request starts on `slot`, its own cache matching the first n_keep prompt tokens: what
        the slot held goes into the cache (when it is worth it), and the prompt is loaded from the
        cache when an entry shares more of it. Returns the prompt tokens now cached."""
        cache = self.cache
        if cache is None or task.embedding:
            return n_keep
        came_back = cache.sight(task.prompt)
        self.save(slot, n_keep)
        (self._came_back.add if came_back else self._came_back.discard)(slot.id)
        return self._load(slot, task.prompt, n_keep) if task.cache_prompt else n_keep

    def start_child(self, slot: "Slot") -> None:
        """A choice of an n > 1 request starts on `slot` (it shares its parent's prompt)."""
        self._came_back.discard(slot.id)

    def save_idle(self, slots: list["Slot"]) -> None:
        """--cache-idle-slots: the idle slots whose request came back are saved now (an idle slot
        whose request did not come back is let go when dropped)."""
        if self.cache is None or not self.idle_slots:
            return
        for idle in slots:
            if idle.state is SlotState.IDLE and idle.id in self._came_back:
                self.save(idle, 0)

    def save(self, slot: Slot, n_keep: int) -> None:
        """The slot's cached prompt into the host cache when more than a block of it is about to
        be dropped (all but its first n_keep tokens), no entry holds it already and its request
        came back (see PromptCache.sight). Its blocks are held and copied by the cache's copier
        thread: the decode thread goes on at once."""
        cache = self.cache
        assert cache is not None
        # (the last token a request sampled has no KV rows yet)
        tokens = slot.cache_tokens[:self.ctx.kv.seq_len(slot.seq)]
        if len(tokens) - n_keep < MIN_TOKENS or cache.covers(tokens):
            return
        if slot.id not in self._came_back:  # a first appearance: it will most likely not come back
            cache.not_admitted()
            return
        entry = cache.reserve(tokens, self._rows_nbytes(len(tokens)))
        if entry is None:
            return
        blocks, runs = self.ctx.kv.hold(slot.seq, len(tokens))
        copied = threading.Event()
        self.held.append((blocks, copied))
        ctx, n, slot_id = self.ctx, len(tokens), slot.id

        def copy() -> None:
            t0 = time.perf_counter()
            try:
                rows = ctx.read_cells(runs, n)
            except Exception as exc:  # noqa: BLE001 - the prompt is only computed again later
                log.warning("slot %d: saving its prompt to the host cache failed: %s", slot_id, exc)
                cache.fail(entry)
                return
            finally:
                copied.set()  # the decode thread gives the blocks back (release_held)
            if cache.fill(entry, rows):
                log.info("slot %d: %d prompt tokens saved to the host cache (%.1f ms; %d entries, %.1f MiB)",
                         slot_id, n, (time.perf_counter() - t0) * 1e3, len(cache), cache.nbytes / 2**20)

        cache.copier.submit(copy)

    def _rows_nbytes(self, n: int) -> int:
        """Bytes of n positions' K and V rows over all layers (what read_seq returns)."""
        return n * sum(layer[1] + layer[3] for layer in self.ctx.kv_layout())

    def release_held(self, wait: bool) -> bool:
        """Gives back the blocks of finished copies (with wait, waits for the oldest copy first
        when none has finished); whether any went back. Decode thread only (the KV bookkeeping)."""
        held = self.held
        if wait and held and not any(done.is_set() for _, done in held):
            held[0][1].wait(COPY_WAIT_S)
        kept: deque[tuple[list[int], threading.Event]] = deque()
        released = False
        while held:
            blocks, done = held.popleft()
            if done.is_set():
                self.ctx.kv.release(blocks)
                released = True
            else:
                kept.append((blocks, done))
        self.held = kept
        return released

    def _load(self, slot: Slot, prompt: list[int], n_keep: int) -> int:
        """Starts the slot from the host cache's entry that shares the longest prefix with `prompt`
        when it shares more (by a block at least) than the slot's own cache and the KV pool has
        the room; returns the prompt tokens now cached."""
        cache = self.cache
        assert cache is not None
        entry, n = cache.best(prompt)
        n = min(n, len(prompt) - 1)
        if entry is None or n - n_keep < MIN_TOKENS:
            return n_keep
        n = min(n, self.ctx.kv.seq_cap)
        if not self.fits(slot, n):
            return n_keep
        t0 = time.perf_counter()
        rows = entry.wait(COPY_WAIT_S)  # a copy still under way is waited for: it is this request's prefix
        if rows is None:
            return n_keep
        try:
            self.ctx.write_seq(slot.seq, rows, n)
        except Exception as exc:  # noqa: BLE001 - the sequence is empty again: computed from the start
            log.warning("slot %d: loading a prompt from the host cache failed: %s", slot.id, exc)
            slot.cache_tokens = []
            return 0
        slot.cache_tokens = list(prompt[:n])
        log.info("slot %d: %d prompt tokens loaded from the host cache (%.1f ms)", slot.id, n,
                 (time.perf_counter() - t0) * 1e3)
        return n

    def fits(self, slot: Slot, n: int) -> bool:
        """Whether `slot`'s sequence, emptied, could take n positions from the free blocks now
        (between steps nothing is reserved: the scheduler's free count would hold the last step's)."""
        kv = self.ctx.kv
        self.release_held(wait=False)
        while -(-n // kv.block_size) > kv.n_free_blocks + kv.blocks_freed_by_rm(slot.seq):
            if not self.held:
                return False
            self.release_held(wait=True)
        return True
