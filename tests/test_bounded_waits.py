"""Every wait is bounded: a static check over the code that waits on peers, threads and queues.

No thread may wait on a reply, a lock, an event, a queue or a socket without a bound (the RPC
timeout, or a timeout that a loop around it re-checks) or a wake-up by shutdown. This test parses
the packages with `ast` and fails on any blocking call that passes no timeout; the few waits that
are bounded another way are listed in ALLOWED, each with the reason it cannot block forever. An
entry that no longer matches anything fails too, so the list stays exact.

What counts as blocking (a method call by its name, whatever the object):
  x.wait(), x.join(), x.result(), x.wait_closed()        with no argument at all
  x.acquire(), x.acquire(True)                         without timeout= (or blocking=False)
  x.get(), x.get(True), x.get(block=True)              without timeout= (queue.get; dict.get has a key)
  asyncio.wait(...)                                    without timeout=
  x.communicate()                                      without timeout=
  socket operations (recv, recv_into, recvfrom, accept, sendall, connect, socket.create_connection
  without a timeout): bounded only by the socket's own timeout, so each use is listed with where
  that timeout is set.
A call passed straight to asyncio.wait_for(..., timeout) is bounded by it. A `with` block over a
lock (a name ending in "lock") must not contain any of these calls, even bounded ones: whoever
waits for that lock would wait as long again, unbounded.
"""
from __future__ import annotations

import ast
import os
import textwrap
from typing import Iterator, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKED = ["pyllama/rpc", "pyllama/backend", "pyllama/batching", "pyllama/server", "pyllama/rpc_server",
           "pyllama/runtime/context.py", "pyllama/runtime/sched.py", "pyllama/runtime/engine.py"]
SOCKET_OPS = {"recv", "recv_into", "recvfrom", "recvfrom_into", "accept", "sendall", "connect"}

# (file, function, call) -> why it is bounded anyway
ALLOWED: dict[tuple[str, str, str], str] = {
    ("pyllama/rpc/connection.py", "Connection._recv_into", "self.sock.recv_into"):
        "the socket has settimeout(RPC timeout) from Connection.__init__; a timeout breaks the connection",
    ("pyllama/rpc/connection.py", "Connection.send", "self.sock.sendall"):
        "the socket has settimeout(RPC timeout), which bounds a whole sendall; a timeout breaks the connection",
    ("pyllama/backend/ggml/connection.py", "GGMLConnection.send", "self.sock.sendall"):
        "the socket has settimeout(RPC timeout) from GGMLConnection.__init__, which bounds a whole sendall; the "
        "lock is the connection's send lock (a ggml peer reads commands in order) and a timeout breaks the "
        "connection",
    ("pyllama/backend/ggml/connection.py", "GGMLConnection._recv_into", "self.sock.recv_into"):
        "the socket has settimeout(RPC timeout) from GGMLConnection.__init__; a timeout breaks the connection",
    ("pyllama/backend/ggml/connection.py", "GGMLConnection.check_peer", "self.sock.recv"):
        "MSG_PEEK | MSG_DONTWAIT after select() said readable: never blocks",
    ("pyllama/backend/ggml/connection.py", "_pyllama_hello", "sock.sendall"):
        "identify's probe socket, settimeout(the RPC timeout) before any send",
    ("pyllama/backend/ggml/connection.py", "_read", "sock.recv"):
        "reads identify's probe socket, which has settimeout(the RPC timeout)",
    ("pyllama/batching/group.py", "PipelineGroup._run", "self._wake.wait"):
        "the idle decode thread's wait for work, in a loop: woken by submit() and by request_stop() (shutdown)",
    ("pyllama/server/router.py", "Router._run", "self._commands.get"):
        "the idle task thread's wait for a command: woken by every submit/free and by stop() (shutdown)",
    ("pyllama/batching/constraint.py", "_MaskThread._run", "self._queue.get"):
        "a constraint's idle mask thread's wait for work: woken by every mask asked of it and ended by the "
        "None its constraint's finalizer queues; a daemon thread, so shutdown never waits for it",
    ("pyllama/batching/prompt_cache.py", "RowCopier._run", "self._jobs.get"):
        "the idle prompt-cache copier's wait for a copy: woken by every submit; a daemon thread, so shutdown "
        "never waits for it",
    ("pyllama/server/api.py", "Api._events", "q.get"):
        "an HTTP handler awaiting its own request's events: a queued request may wait as long as the pool is "
        "busy; the client disconnecting or the server's shutdown (grace, then cancel) ends it",
    ("pyllama/server/__main__.py", "serve", "stop.wait"):
        "the main coroutine's wait for SIGINT/SIGTERM: woken by shutdown by definition",
    ("pyllama/server/__main__.py", "serve", "asyncio.wait"):
        "waits for loading or a stop signal, whichever first; after a signal, for the load to end (every RPC "
        "wait in it is bounded by the RPC timeout) - a second signal exits at once",
    ("pyllama/rpc_server/__main__.py", "serve", "stop.wait"):
        "the main coroutine's wait for SIGINT/SIGTERM: woken by shutdown by definition",
    ("pyllama/server/models/front.py", "serve_router", "stop.wait"):
        "the router's main coroutine's wait for SIGINT/SIGTERM: woken by shutdown by definition",
    ("pyllama/server/models/front.py", "ModelRouter._watch", "proc.wait"):
        "a model's watcher coroutine awaiting its server process's exit, which is the model's whole life: it "
        "holds nothing, and unloading or shutting down stops the process (SIGTERM, SIGKILL after the stop "
        "timeout)",
    ("pyllama/server/models/process.py", "ModelProcess.wait", "self.proc.wait"):
        "a model server process's exit, awaited by its watcher (above) and by stop() after SIGKILL, which "
        "ends any process",
    ("pyllama/server/models/process.py", "ModelProcess.stop", "self.wait"):
        "after SIGTERM and, past the stop timeout, SIGKILL: the process exits",
}


def _dotted(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001
        return "?"


def _kw(call: ast.Call, name: str) -> Optional[ast.expr]:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def _is_none(node: Optional[ast.expr]) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _has_timeout(call: ast.Call) -> bool:
    t = _kw(call, "timeout")
    return t is not None and not _is_none(t)


def unbounded(call: ast.Call) -> Optional[str]:
    """Why `call` may block forever, or None."""
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    name, owner, npos = func.attr, _dotted(func.value), len(call.args)
    if _has_timeout(call):
        return None
    if owner == "asyncio" and name == "wait":
        return "asyncio.wait without timeout="
    if owner == "socket" and name == "create_connection":
        return None if npos >= 2 else "socket.create_connection without a timeout"
    if owner == "asyncio":
        return None
    if name in ("wait", "join", "result", "wait_closed") and npos == 0 and not call.keywords:
        return f".{name}() without a timeout"
    if name == "acquire":
        blocking = call.args[0] if npos else _kw(call, "blocking")
        if blocking is None or (isinstance(blocking, ast.Constant) and blocking.value is True and npos < 2):
            return ".acquire() without a timeout"
        return None
    if name == "get":
        block = call.args[0] if npos == 1 else _kw(call, "block")
        if npos == 0 and block is None and not call.keywords:
            return ".get() without a timeout"
        if isinstance(block, ast.Constant) and block.value is True and npos < 2:
            return ".get(block=True) without a timeout"
        return None
    if name == "communicate" and npos < 2:
        return ".communicate() without a timeout"
    if name in SOCKET_OPS and owner != "self" and "sock" in owner.lower():
        return f"socket .{name}(): bounded only by the socket's timeout"
    return None


def _bounded_by_wait_for(call: ast.Call, parents: dict[ast.AST, ast.AST]) -> bool:
    parent = parents.get(call)
    if isinstance(parent, ast.Call) and _dotted(parent.func) == "asyncio.shield":  # wait_for(shield(x), t)
        call, parent = parent, parents.get(parent)
    return (isinstance(parent, ast.Call) and _dotted(parent.func) == "asyncio.wait_for" and call in parent.args
            and (len(parent.args) >= 2 and not _is_none(parent.args[1]) or _has_timeout(parent)))


def _is_lock(expr: ast.expr) -> bool:
    node = expr.func if isinstance(expr, ast.Call) else expr
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name.lower().endswith("lock")


def check_source(source: str, path: str) -> Iterator[tuple[str, str, str, int, str]]:
    """(file, function, call, line, why) of every unbounded wait in `source`."""
    tree = ast.parse(source)
    parents: dict[ast.AST, ast.AST] = {}
    scope: dict[ast.AST, str] = {}

    def walk(node: ast.AST, qual: str) -> None:
        for child in ast.iter_child_nodes(node):
            parents[child] = node
            q = qual
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                q = f"{qual}.{child.name}" if qual else child.name
            scope[child] = q
            walk(child, q)

    walk(tree, "")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            why = unbounded(node)
            if why and not _bounded_by_wait_for(node, parents):
                yield path, scope.get(node, ""), _dotted(node.func), node.lineno, why
        elif isinstance(node, (ast.With, ast.AsyncWith)) and any(_is_lock(i.context_expr) for i in node.items):
            for inner in _executed(node.body):
                if isinstance(inner, ast.Call) and _blocks(inner):
                    yield (path, scope.get(inner, ""), _dotted(inner.func), inner.lineno,
                           "a blocking call while holding a lock")


def _executed(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """The nodes a block runs, not those of functions it only defines."""
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def _blocks(call: ast.Call) -> bool:
    """Whether `call` waits at all, bounded or not (str.join and dict.get do not)."""
    if unbounded(call):
        return True
    if not isinstance(call.func, ast.Attribute):
        return False
    attr, owner = call.func.attr, call.func.value
    if attr == "join":
        return not isinstance(owner, (ast.Constant, ast.JoinedStr))
    if attr == "get":
        return _has_timeout(call)
    return attr in ("wait", "result", "acquire", "sleep", "communicate", "wait_for") \
        or (attr in SOCKET_OPS and "sock" in _dotted(owner).lower())


def files() -> Iterator[str]:
    for entry in CHECKED:
        full = os.path.join(ROOT, entry)
        if os.path.isfile(full):
            yield entry
            continue
        for base, _, names in os.walk(full):
            for name in sorted(names):
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(base, name), ROOT)


def findings() -> list[tuple[str, str, str, int, str]]:
    out = []
    for rel in files():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
            out.extend(check_source(fh.read(), rel))
    return out


# --- the checker itself -----------------------------------------------------------------------

def _found(snippet: str) -> list[tuple[str, str]]:
    return [(f[1], f[2]) for f in check_source(textwrap.dedent(snippet), "x.py")]


def test_the_checker_finds_unbounded_waits():
    found = _found("""
        import asyncio, queue, threading
        class Worker:
            def run(self):
                self.cond.wait()
                self.thread.join()
                self.q.get()
                self.q.get(True)
                self.lock.acquire()
                self.future.result()
            async def main(self):
                await asyncio.wait({self.task})
                await self.stopped.wait()
            def send(self):
                with self.send_lock:
                    self.sock.sendall(b"x")
                    self.cond.wait(5)
    """)
    assert ("Worker.run", "self.cond.wait") in found
    assert ("Worker.run", "self.thread.join") in found
    assert found.count(("Worker.run", "self.q.get")) == 2
    assert ("Worker.run", "self.lock.acquire") in found
    assert ("Worker.run", "self.future.result") in found
    assert ("Worker.main", "asyncio.wait") in found
    assert ("Worker.main", "self.stopped.wait") in found
    assert found.count(("Worker.send", "self.sock.sendall")) == 2  # a socket op, and under a lock
    assert ("Worker.send", "self.cond.wait") in found               # bounded, but under a lock
    assert len(found) == 11, found


def test_the_checker_accepts_bounded_waits():
    assert _found("""
        import asyncio, socket
        def f(cond, ev, t, q, lock, fut, items, d):
            cond.wait(1.0)
            ev.wait(timeout=2)
            t.join(5)
            q.get(timeout=1)
            q.get(False)
            q.get_nowait()
            lock.acquire(timeout=3)
            lock.acquire(False)
            fut.result(10)
            ", ".join(items)
            d.get("key")
            socket.create_connection(("h", 1), 5)
        async def g(ev, aws):
            await asyncio.wait_for(ev.wait(), 5)
            await asyncio.wait(aws, timeout=1)
    """) == []


# --- the code -----------------------------------------------------------------------------------

def test_every_wait_is_bounded():
    bad = [f for f in findings() if (f[0], f[1], f[2]) not in ALLOWED]
    assert not bad, "unbounded waits (bound them, or list them in ALLOWED with the reason):\n" + \
        "\n".join(f"{p}:{line} {fn}: {call} - {why}" for p, fn, call, line, why in bad)


def test_every_allowed_entry_is_still_used():
    used = {(f[0], f[1], f[2]) for f in findings()}
    stale = [k for k in ALLOWED if k not in used]
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"
