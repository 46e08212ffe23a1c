"""Constrained decoding: grammars and JSON schemas as token masks, with llguidance.

A request's constraint is a `ConstraintSpec` (a GBNF grammar, a JSON schema, a Lark grammar in
llguidance's dialect, or "any JSON object"). `compile_constraint` checks it and returns a fresh
matcher before any work is queued: an invalid spec is a 400 naming the request field and the
problem. Compiled grammars are cached (a schema sent with every request compiles once), and each
request gets its own copy of the compiled matcher.

During generation a slot holds a `Constraint`: its matcher and the bitmask of the tokens allowed
next. The group's decode thread applies the mask to the row's host logits before the sampler
(disallowed tokens become -inf), feeds the sampled token to the matcher, and asks the group's
`MaskWorker` for the next mask right away: the mask is computed on the sequence's own thread
(llguidance releases the GIL) while the next step is built and decoded, so the mask is usually
ready when the logits come back. A constraint is done when the matcher allows nothing but the end
of generation; the request then ends as if the model had produced EOS.

A mask usually takes microseconds, but a short grammar can force a string of millions of bytes
(`root ::= a{3000}` with `a ::= "x"{3000}`), which llguidance walks for seconds to minutes (and
gigabytes) for every mask, and no llguidance limit bounds that walk. So a new grammar's first mask
must come within FIRST_MASK_S (else the request is a 400), and a later mask within MASK_TIMEOUT_S
(else that request ends with an error); either way the grammar is remembered as too complex. The
first mask is checked in a process of its own (grammar_check.py), killed when it is too slow, so
that a given-up check leaves no CPU or memory behind. Nothing can stop llguidance in the server's
own process: a later mask given up on runs to its end on its own thread at the lowest priority,
which no other request's masks wait for, holding one of MAX_CHECKS places meanwhile; a new grammar
that finds none free within FIRST_MASK_S is a 503, so that such computations cannot pile up.
"""
from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

import llguidance as llg

from .._fast import masks as _masks
from ..util.threads import Thread
from ..tokenizer import Tokenizer
from ..tokenizer.base import TT_BYTE, TT_NORMAL, TT_USER_DEFINED
from .grammar_check import CheckUnavailable, FirstMaskChecker
from ..util.errors import HTTPError

log = logging.getLogger(__name__)

KINDS = ("gbnf", "json_schema", "lark", "json_object")
# The request field each kind comes from by default, for error messages.
_DEFAULT_FIELD = {"gbnf": "grammar", "json_schema": "json_schema", "lark": "grammar", "json_object": "response_format"}
# Whitespace between JSON tokens: llama.cpp's JSON-schema grammars allow nothing, one space, or one
# or two newlines plus up to 20 spaces or tabs. Unbounded whitespace (llguidance's default) lets a
# weak model spend its whole token budget on indentation.
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}
# "Any JSON object": OpenAI's JSON mode
_ANY_OBJECT = '{"type": "object"}'
MAX_CACHED = 64


@dataclass(frozen=True)
class ConstraintSpec:
    """What a request constrains its output to.

    kind: "gbnf" (llama.cpp's GBNF), "json_schema" (text is the schema as JSON), "lark"
    (llguidance's Lark dialect, which can embed `%json {...}`), or "json_object" (any JSON object;
    text is ""). field: the request field it came from, named in errors ("" = the kind's usual one).
    """

    kind: str
    text: str
    field: str = ""

    @property
    def source(self) -> str:
        return self.field or _DEFAULT_FIELD.get(self.kind, "grammar")


def grammar_text(spec: ConstraintSpec) -> str:
    """llguidance's grammar for a spec (not yet checked against a vocabulary). Raises HTTPError
    400 for a spec that cannot even be translated (bad GBNF syntax, schema that is not JSON)."""
    if spec.kind not in KINDS:
        raise HTTPError(400, f"'{spec.source}': unknown constraint kind {spec.kind!r} (one of {', '.join(KINDS)})")
    try:
        if spec.kind == "gbnf":
            return llg.grammar_from("gbnf", spec.text)
        if spec.kind == "lark":
            return llg.LLMatcher.grammar_from_lark(spec.text)
        schema = _ANY_OBJECT if spec.kind == "json_object" else spec.text
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise HTTPError(400, f"'{spec.source}': invalid {_what(spec)}: {_short(exc)}") from None


def check_spec(spec: ConstraintSpec) -> None:
    """Checks a spec without a vocabulary (the command line's defaults, before the model loads);
    raises HTTPError 400 naming the problem."""
    grammar = grammar_text(spec)
    err, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if err:
        raise HTTPError(400, f"'{spec.source}': invalid {_what(spec)}: {_short(msgs[0] if msgs else 'rejected')}")


def _what(spec: ConstraintSpec) -> str:
    return {"gbnf": "grammar", "lark": "grammar", "json_schema": "JSON schema", "json_object": "JSON object format"}[
        spec.kind]


def _short(exc: Any, limit: int = 500) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "..."


# --- the vocabulary as llguidance sees it ------------------------------------------------------
class _Vocab:
    """llguidance's view of a pyllama tokenizer: every token's bytes, special tokens marked (as
    llama.cpp does, by a 0xFF byte before their text, so that no text can produce them), and an
    encoder for the text llguidance needs tokenized. Built from the pieces alone (`tok` None, as
    the first-mask check process does), it encodes by the greedy match only."""

    def __init__(self, tokens: list[bytes], special_token_ids: list[int], eos_tokens: list[int],
                 bos_token_id: Optional[int], tok: Optional[Tokenizer] = None) -> None:
        # weakly: the llguidance tokenizer holding this view is kept per Tokenizer in a weak
        # dictionary, which a strong reference back would keep forever
        self._tok = weakref.ref(tok) if tok is not None else None
        self.tokens = tokens
        self.special_token_ids = special_token_ids
        self._special = frozenset(special_token_ids)
        self._by_piece: Optional[dict[bytes, int]] = None  # made on the first text that needs it
        self._longest = 1
        self.eos_tokens = eos_tokens
        self.eos_token_id = eos_tokens[0]
        self.bos_token_id = bos_token_id

    @classmethod
    def of(cls, tok: Tokenizer) -> "_Vocab":
        plain = (TT_NORMAL, TT_USER_DEFINED, TT_BYTE)
        tokens: list[bytes] = []
        special: list[int] = []
        for i in range(tok.n_vocab):
            if tok.token_type(i) in plain:
                tokens.append(tok.token_bytes(i))
            else:
                tokens.append(b"\xff" + tok.token_text(i).encode("utf-8", errors="replace"))
                special.append(i)
        eog = sorted(tok.eog_ids)
        return cls(tokens, special, eog or [tok.eos_id if tok.eos_id is not None else 0], tok.bos_id, tok)

    def pieces(self) -> tuple:
        """What a process without the tokenizer needs to rebuild this view (encoding greedily)."""
        return self.tokens, self.special_token_ids, self.eos_tokens, self.bos_token_id

    def __call__(self, text: Any) -> list[int]:
        """Tokens whose bytes are exactly `text`'s: llguidance tokenizes the bytes a grammar forces
        and allows the first of those tokens, which the matcher then checks byte by byte. The
        model's own encoding is used when it spells the text exactly; it does not when the
        vocabulary adds a space prefix (SPM, UGM, WPM's word starts) or normalizes text (WPM
        lowercases), and a greedy longest match over the token pieces is used instead."""
        data = text if isinstance(text, bytes) else text.encode("utf-8", errors="surrogatepass")
        tok = self._tok() if self._tok is not None else None
        if tok is not None:
            ids = tok.encode(data.decode("utf-8", errors="replace"), add_special=False)
            if self._spells(ids, data):
                return ids
        return self._greedy(data)

    def _spells(self, ids: list[int], data: bytes) -> bool:
        return all(i not in self._special for i in ids) and b"".join([self.tokens[i] for i in ids]) == data

    def _greedy(self, data: bytes) -> list[int]:
        """Longest pieces first, left to right, up to the first byte that no piece starts with (a
        vocabulary without byte tokens may have none: WPM's lowercase vocabularies lack capitals):
        a prefix of the text spelled exactly tells llguidance no more than it can check."""
        if self._by_piece is None:
            by_piece: dict[bytes, int] = {}
            for i, piece in enumerate(self.tokens):
                if piece and i not in self._special:
                    by_piece.setdefault(piece, i)
            self._by_piece = by_piece
            self._longest = max(map(len, by_piece), default=1)
        out: list[int] = []
        pos = 0
        while pos < len(data):
            for end in range(min(len(data), pos + self._longest), pos, -1):
                found = self._by_piece.get(data[pos:end])
                if found is not None:
                    out.append(found)
                    pos = end
                    break
            else:
                break
        return out


class _LLVocab(NamedTuple):
    tokenizer: Any               # llguidance's LLTokenizer
    checker: "FirstMaskChecker"
    serial: int                  # names it in the compiled grammars' cache (an id could be reused)


_tokenizers: "weakref.WeakKeyDictionary[Tokenizer, _LLVocab]" = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()
_serials = itertools.count()


def _ll_vocab(tok: Tokenizer) -> _LLVocab:
    """The llguidance view of a model's tokenizer, built once per tokenizer (and gone with it)."""
    with _tokenizers_lock:
        found = _tokenizers.get(tok)
        if found is None:
            vocab = _Vocab.of(tok)
            found = _LLVocab(llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=tok.n_vocab,
                                             eos_token=vocab.eos_tokens),
                             FirstMaskChecker(vocab.pieces(), tok.n_vocab), next(_serials))
            _tokenizers[tok] = found
        return found


def ll_tokenizer(tok: Tokenizer) -> Any:
    """The llguidance tokenizer of a model's tokenizer, built once per tokenizer."""
    return _ll_vocab(tok).tokenizer


def first_mask_checker(tok: Tokenizer) -> "FirstMaskChecker":
    """The processes that check a new grammar's first mask for `tok`'s vocabulary."""
    return _ll_vocab(tok).checker


# --- compiling ----------------------------------------------------------------------------------
_compiled: "OrderedDict[tuple, Any]" = OrderedDict()
_compiled_lock = threading.Lock()


def compile_constraint(spec: ConstraintSpec, tok: Tokenizer) -> Any:
    """A fresh llguidance matcher for `spec` over the model's vocabulary. Raises HTTPError 400
    naming the request field and the problem when the grammar or schema is invalid. The compiled
    grammar is cached; each call returns its own matcher (a copy), ready for a new sequence."""
    ll = _ll_vocab(tok)
    lt = ll.tokenizer
    key = (spec.kind, spec.text, ll.serial)
    with _compiled_lock:
        template = _compiled.get(key)
        if template is not None:
            _compiled.move_to_end(key)
        refused = _too_complex.get(key)
    if refused:
        raise HTTPError(400, refused)
    if template is None:
        grammar = grammar_text(spec)
        template = llg.LLMatcher(lt, grammar, log_level=0)  # (the GIL is released while it compiles)
        if template.is_error():
            raise HTTPError(400, f"'{spec.source}': invalid {_what(spec)}: {_short(template.get_error())}")
        why = _first_mask_check(template, tok, grammar)
        if why:
            raise HTTPError(400, _forget((key, f"'{spec.source}': {_what(spec)} too complex"), why))
        with _compiled_lock:
            _compiled[key] = template
            while len(_compiled) > MAX_CACHED:
                _compiled.popitem(last=False)
    matcher = template.deep_copy()
    with _compiled_lock:
        _origins[id(matcher)] = (key, f"'{spec.source}': {_what(spec)} too complex")
        while len(_origins) > 4 * MAX_CACHED:  # (matchers of requests that ended before they ran)
            _origins.popitem(last=False)
    return matcher


# The cache key and error prefix of each matcher compile_constraint handed out, until its
# Constraint takes them (llguidance's matchers take neither attributes nor weak references).
_origins: "OrderedDict[int, tuple[tuple, str]]" = OrderedDict()


def _forget(origin: Optional[tuple[tuple, str]], why: str) -> str:
    """Remembers the grammar a matcher came from as too complex (its next requests are a 400
    with the message returned)."""
    if origin is None:
        return why
    key, prefix = origin
    message = f"{prefix}: {why}"
    with _compiled_lock:
        _compiled.pop(key, None)
        _too_complex[key] = message
        while len(_too_complex) > MAX_CACHED:
            _too_complex.popitem(last=False)
    return message


# A first mask that takes longer than this fails its request with a 400 (they take microseconds to
# a few milliseconds with the largest vocabularies).
FIRST_MASK_S = 1.0
# Computations given up on that may run at once (later masks, and first masks checked on a thread
# where no check process can run): each holds a core (and up to a few GB) until it ends, so they
# are kept to a quarter of the cores, two at least; while all places are held, new grammars are a 503.
MAX_CHECKS = max(2, (os.cpu_count() or 1) // 4)
_checks = threading.BoundedSemaphore(MAX_CHECKS)
# First-mask check processes that may run at once (a quarter of the cores, one at least): each takes
# a core for FIRST_MASK_S at most. A new grammar waits CHECK_WAIT_S at most for one (then a 503):
# long enough for one slow check ahead of it to be killed.
CHECK_PROCESSES = max(1, (os.cpu_count() or 1) // 4)
CHECK_WAIT_S = 2.0
_checking = threading.BoundedSemaphore(CHECK_PROCESSES)
_too_complex: "OrderedDict[tuple, str]" = OrderedDict()  # grammars whose first mask was too slow


def _busy(why: str) -> HTTPError:
    return HTTPError(503, f"the server is {why}; try again later", "unavailable_error")


def _first_mask_check(template: Any, tok: Tokenizer, grammar: str) -> str:
    """Checks a grammar's first mask in a check process (grammar_check.py), killed when it takes
    more than FIRST_MASK_S; returns why the grammar is refused ("" when it is not). Where no check
    process can run, a copy's first mask is computed on a thread here instead. Raises HTTPError 503
    when MAX_CHECKS given-up computations still run after waiting FIRST_MASK_S for one to end, or
    when no check process is free within CHECK_WAIT_S."""
    checks = _checks
    if not checks.acquire(timeout=FIRST_MASK_S):
        raise _busy("still computing the token masks of grammars too complex to use")
    checks.release()  # (a check process holds no such place: it is killed when too slow)
    if not _checking.acquire(timeout=CHECK_WAIT_S):
        raise _busy("checking other new grammars")
    try:
        _, why = first_mask_checker(tok).check(grammar, FIRST_MASK_S)
        return why
    except CheckUnavailable as exc:
        log.warning("checking a grammar's first mask on a thread of the server: %s", exc)
        if not checks.acquire(timeout=FIRST_MASK_S):
            raise _busy("still computing the token masks of grammars too complex to use") from None
        return _first_mask_check_here(template, tok.n_vocab, checks)  # (it releases the place)
    finally:
        _checking.release()


def _first_mask_check_here(template: Any, n_vocab: int, checks: threading.BoundedSemaphore) -> str:
    """Computes a copy's first mask on a thread of its own, waiting FIRST_MASK_S at most; a
    computation given up on runs on (see _give_up), holding its place in `checks` (acquired by the
    caller) until it ends."""
    matcher = template.deep_copy()
    mask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
    done = threading.Event()

    def run() -> None:
        try:
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        finally:
            done.set()
            checks.release()

    thread = Thread(target=run, name="grammar-check", daemon=True)
    try:
        thread.start()
    except BaseException:
        checks.release()
        raise
    if not done.wait(FIRST_MASK_S):
        _give_up(thread)
        return f"its first token mask takes more than {FIRST_MASK_S:g} s"
    return f"its first token mask failed: {_short(matcher.get_error())}" if matcher.is_error() else ""


def json_schema_spec(schema: Any, field: str) -> ConstraintSpec:
    """A json_schema spec from a request's schema value: an object, its JSON text, or true (any
    JSON value)."""
    if isinstance(schema, str):  # the schema's JSON text, as some clients send it
        try:
            schema = json.loads(schema)
        except ValueError:
            raise HTTPError(400, f"'{field}' must be a JSON schema object (or its JSON text)") from None
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise HTTPError(400, f"'{field}' must be a JSON schema object (or its JSON text)")
    return ConstraintSpec("json_schema", json.dumps(schema), field)


def _give_up(thread: threading.Thread) -> None:
    """Lowers a thread whose computation no request waits for any more to the least CPU priority
    (Linux sets it per thread), so that it takes only the time that serving leaves."""
    try:
        if thread.native_id is not None:
            os.setpriority(os.PRIO_PROCESS, thread.native_id, 19)
    except (OSError, AttributeError):  # (the thread is gone, or the platform has no per-thread nice)
        pass


# --- per-sequence state and mask computation ---------------------------------------------------
# How long the decode thread (and so every sequence of its group) waits for one mask before it
# fails the request: a mask takes microseconds to milliseconds, and the first one was checked
# against FIRST_MASK_S when the grammar was compiled.
MASK_TIMEOUT_S = 2.0


class Constraint:
    """A sequence's matcher and the mask of the tokens it allows next. The decode thread owns
    it; the mask worker writes `mask` and reads the matcher only between `request_mask` and the
    `take_mask` that follows, while the decode thread leaves both alone."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.mask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self._pending: Optional[Future] = None
        # the thread its masks are computed on (MaskWorker); its work queue ends when the
        # constraint is dropped, so the thread ends after its last mask
        self._thread: Optional[_MaskThread] = None
        self._ready = False
        self.failed = ""  # why the matcher can no longer be used (its request then ends with an error)
        self._origin = _origins.pop(id(matcher), None)  # (compile_constraint's key and field)

    @property
    def done(self) -> bool:
        """Nothing but the end of generation is allowed (or the matcher failed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        if self.failed:
            return self.failed
        return self.matcher.get_error() if self.matcher.is_error() else ""

    def compute_mask(self) -> None:
        """Computes the mask here (the worker's job, or a caller that has no worker)."""
        self.matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        self._ready = True

    def take_mask(self) -> float:
        """Makes the mask current; returns the seconds spent waiting for it. A mask not ready
        within MASK_TIMEOUT_S fails the constraint: the worker may still hold the matcher, so
        nothing here touches it again, and `consume` refuses every token."""
        if self._pending is not None:
            t0 = time.perf_counter()
            try:
                self._pending.result(timeout=MASK_TIMEOUT_S)
            except FutureTimeout:
                why = f"a token mask was not ready within {MASK_TIMEOUT_S:g} s"
                self.failed = f"grammar too complex: {why}"
                _forget(self._origin, why)
                if self._thread is not None:
                    _give_up(self._thread.thread)
                # the computation holds a check's place until it ends, so that given-up ones
                # leave no room for new grammars rather than pile up
                if _checks.acquire(blocking=False):
                    self._pending.add_done_callback(lambda _, checks=_checks: checks.release())
                self.mask[:] = -1  # (the row is sampled with the others; its token is refused)
            self._pending = None
            return time.perf_counter() - t0
        if not self._ready:
            t0 = time.perf_counter()
            self.compute_mask()
            return time.perf_counter() - t0
        return 0.0

    def consume(self, token: int) -> bool:
        """Feeds a sampled token to the matcher (after `take_mask`); False when the grammar refuses it."""
        self._ready = False
        if self.failed:
            return False
        return bool(self.matcher.consume_token(token))


def apply_masks(logits: np.ndarray, rows: list[int], constraints: list[Constraint]) -> None:
    """Sets the logits of the tokens each row's constraint disallows to -inf, in place (one
    kernel pass over the packed masks, without the GIL)."""
    if not rows:
        return
    masks = np.stack([c.mask for c in constraints]).view(np.uint32)
    _masks.apply_bitmasks(logits, np.asarray(rows, dtype=np.int32), masks)


class _MaskThread:
    """A constraint's own mask thread: runs the calls queued to it, in order, and ends once the
    constraint is gone (a daemon, so that a computation given up on cannot hold up exit)."""

    def __init__(self, owner: Constraint, name: str) -> None:
        self._queue: "queue.SimpleQueue[Optional[tuple[Future, Callable[[], None]]]]" = queue.SimpleQueue()
        weakref.finalize(owner, self._queue.put, None)
        self.thread = Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], None]) -> Future:
        future: Future = Future()
        self._queue.put((future, fn))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            del item
            try:
                fn()
                future.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting decode thread
                future.set_exception(exc)
            del future, fn


class MaskWorker:
    """One group's mask computations, off the decode thread: `request_mask` queues the next mask
    of constraints whose matchers just consumed a token; the masks are computed while the next
    step runs, and `Constraint.take_mask` picks them up before sampling. Each constraint has a
    thread of its own (made with its first mask, gone with the constraint), so that a matcher
    that takes seconds holds up no other sequence's mask."""

    def __init__(self, name: str = "masks") -> None:
        self._name = name
        self._lock = threading.Lock()
        self.t_compute = 0.0  # seconds spent computing masks (on the constraints' threads)
        self.n_masks = 0

    def request_mask(self, constraints: list[Constraint]) -> None:
        for c in constraints:
            if c._thread is None:
                c._thread = _MaskThread(c, self._name)
            c._pending = c._thread.submit(functools.partial(self._compute, weakref.ref(c)))

    def _compute(self, ref: "weakref.ref[Constraint]") -> None:
        c = ref()
        if c is None:
            return
        t0 = time.perf_counter()
        c.compute_mask()
        with self._lock:
            self.t_compute += time.perf_counter() - t0
            self.n_masks += 1

    def close(self) -> None:
        """(Nothing to stop: each constraint's thread ends when the constraint is dropped.)"""
