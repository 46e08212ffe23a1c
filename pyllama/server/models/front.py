"""The router: one HTTP front for several models, each served by its own `python -m pyllama.server`
process (started on demand, stopped when unloaded, idle or evicted), as llama-server's router mode.

ModelRouter holds each model's state (unloaded, loading, loaded, sleeping) and decides loads and
unloads: at most --models-max running at once and their estimated memory within --models-memory,
making room by unloading the least recently used model that has no request in flight. RouterApi
answers /models, /models/load, /models/unload, /health and /props itself and passes every other
request on to the model named by the body's `model` (POST) or the `?model=` parameter (GET)."""
from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any, Optional, Union

from ...backend.cpu.memory import available_memory
from ...util.cli import install_stop_signals
from ...util.errors import PyllamaError
from ..listen import listen
from ..http import (PUBLIC_PATHS, HTTPError, Request, Response, StreamResponse, error_response,
                    json_response)
from ..options import model_server_environment, settings
from .process import ModelProcess, free_port
from .proxy import forward
from .registry import ModelEntry, ModelRegistry, describe

log = logging.getLogger("pyllama.server")

UNLOADED, LOADING, LOADED, SLEEPING = "unloaded", "loading", "loaded", "sleeping"
MiB = 1 << 20

# llama-server's router passes on these endpoints (and pyllama's own /pipeline/stats)
PROXY_GET = ("/metrics", "/slots", "/lora-adapters", "/pipeline/stats")
PROXY_POST = ("/completion", "/completions", "/v1/completions", "/v1/chat/completions", "/chat/completions",
              "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/responses",
              "/v1/chat/completions/input_tokens", "/chat/completions/input_tokens", "/v1/responses/input_tokens",
              "/responses/input_tokens", "/apply-template", "/tokenize", "/detokenize", "/props", "/slots/*",
              "/lora-adapters", "/infill", "/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking",
              "/v1/rerank", "/v1/reranking")


class RouterError(HTTPError):
    """A request the router refuses, with llama-server's status and error type."""


class ModelState:
    """One model's life in the router."""

    def __init__(self, entry: ModelEntry) -> None:
        self.entry = entry
        self.status = UNLOADED
        self.process: Optional[ModelProcess] = None
        self.args: list[str] = entry.argv(0)  # as /models shows them until a load gives the port
        self.exit_code = 0
        self.failed = False
        self.in_flight = 0              # requests passed on (or waiting for the load), not yet answered
        self.last_used = 0.0
        self.loaded: Optional[asyncio.Future] = None  # done when a load ends, True if the model is ready
        self.info: dict[str, Any] = {}  # the model server's own /v1/models entry, while it runs

    @property
    def running(self) -> bool:
        """A process is up (or starting): it counts against --models-max and the memory budget."""
        return self.status in (LOADING, LOADED)


class ModelRouter:
    """Loads and unloads the models of a registry."""

    def __init__(self, registry: ModelRegistry, models_max: int, memory_budget: int, idle_s: int,
                 read_timeout: float) -> None:
        self.registry = registry
        self.models = {name: ModelState(e) for name, e in registry.models.items()}
        self.models_max = models_max
        self.memory_budget = memory_budget
        self.idle_s = idle_s
        self.read_timeout = read_timeout
        self.env = model_server_environment()
        self._idle_task: Optional[asyncio.Task] = None
        self._closing = False

    def find(self, name: str) -> Optional[ModelState]:
        entry = self.registry.find(name)
        return self.models[entry.name] if entry is not None else None

    def memory_in_use(self) -> int:
        return sum(m.entry.memory for m in self.models.values() if m.running)

    def idle_seconds(self, m: ModelState) -> int:
        s = m.entry.sleep_idle_seconds
        return self.idle_s if s is None else s

    # --- loading ---------------------------------------------------------------------------------
    async def _make_room(self, m: ModelState) -> None:
        """Unloads least recently used idle models until `m` fits --models-max and the memory budget;
        RouterError(503) when it cannot."""
        need = m.entry.memory
        if self.memory_budget and need > self.memory_budget:
            raise RouterError(503, f"not enough memory for model '{m.entry.name}': it needs an estimated "
                                   f"{need / MiB:.0f} MiB, more than the whole budget of {self.memory_budget / MiB:.0f} "
                                   "MiB (--models-memory)", "unavailable_error")
        while True:
            running = [x for x in self.models.values() if x.running and x is not m]
            over_count = 0 < self.models_max <= len(running)
            over_memory = bool(self.memory_budget) and self.memory_in_use() + need > self.memory_budget
            if not over_count and not over_memory:
                return
            idle = [x for x in running if x.status == LOADED and x.in_flight == 0]
            if not idle:
                if over_count:
                    raise RouterError(503, "model limit reached, try again later", "unavailable_error")
                raise RouterError(503, f"not enough memory for model '{m.entry.name}': it needs an estimated "
                                       f"{need / MiB:.0f} MiB; {self.memory_in_use() / MiB:.0f} MiB of the budget of "
                                       f"{self.memory_budget / MiB:.0f} MiB (--models-memory) are held by models "
                                       "with requests in flight or loading", "unavailable_error")
            victim = min(idle, key=lambda x: x.last_used)
            log.info("%s: unloading model %s (least recently used) to load %s",
                     "models_max limit reached" if over_count else "memory budget reached", victim.entry.name,
                     m.entry.name)
            await self.unload(victim)

    async def load(self, m: ModelState) -> None:
        """Starts loading `m` (returns once its process is started; `m.loaded` says how it ends)."""
        if m.running or self._closing:
            return
        await self._make_room(m)
        if m.running:  # another request started it while room was being made
            return
        port = free_port()
        proc = ModelProcess(m.entry.name, m.entry.argv(port), port, self.env, m.entry.stop_timeout)
        m.status, m.process, m.args = LOADING, proc, proc.argv
        m.failed, m.exit_code = False, 0
        m.last_used = time.monotonic()
        m.loaded = asyncio.get_running_loop().create_future()
        try:
            await proc.start()
        except OSError as exc:
            self._ended(m, proc, 1)
            raise RouterError(500, f"model '{m.entry.name}': cannot start its server: {exc}", "server_error") \
                from None
        asyncio.ensure_future(self._watch(m, proc))

    async def _watch(self, m: ModelState, proc: ModelProcess) -> None:
        ready = await proc.wait_ready()
        info = await _model_info(proc.port) if ready else {}
        if ready and m.process is proc and m.status == LOADING:
            m.info = info
            m.status = LOADED
            m.last_used = time.monotonic()
            log.info("model %s loaded (server process %s, port %d)", m.entry.name, proc.pid, proc.port)
            if m.loaded is not None and not m.loaded.done():
                m.loaded.set_result(True)
        code = await proc.wait()
        self._ended(m, proc, code)

    def _ended(self, m: ModelState, proc: ModelProcess, code: int) -> None:
        if m.process is not proc:
            return
        m.process = None
        m.info = {}
        if m.status != SLEEPING:
            m.status = UNLOADED
        m.failed = not proc.stopping and code != 0
        m.exit_code = code if m.failed else 0
        if m.failed:
            log.error("model %s: its server exited with status %d", m.entry.name, code)
        if m.loaded is not None and not m.loaded.done():
            m.loaded.set_result(False)

    async def ensure_ready(self, m: ModelState) -> None:
        """Loads `m` if needed and waits for it; RouterError(500) when it fails to load."""
        if m.status == LOADED:
            return
        if m.status in (UNLOADED, SLEEPING):
            log.info("model %s is not loaded, loading it", m.entry.name)
            await self.load(m)
        fut = m.loaded
        if fut is None or not await asyncio.shield(fut) or m.status != LOADED:
            raise RouterError(500, f"model name={m.entry.name} failed to load", "server_error")

    async def unload(self, m: ModelState, sleeping: bool = False) -> None:
        """Stops `m`'s process and waits for it (a load in progress is killed at once)."""
        proc = m.process
        if proc is None:
            if sleeping is False and m.status == SLEEPING:
                m.status = UNLOADED
            return
        force = m.status == LOADING
        m.status = SLEEPING if sleeping else UNLOADED
        log.info("model %s: %s", m.entry.name, "idle: stopping its server (sleeping)" if sleeping else "unloading")
        await proc.stop(force=force)

    # --- idle models and shutdown ----------------------------------------------------------------
    def start(self) -> None:
        if any(self.idle_seconds(m) >= 0 for m in self.models.values()):
            self._idle_task = asyncio.ensure_future(self._sleep_idle())

    async def _sleep_idle(self) -> None:
        while not self._closing:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for m in list(self.models.values()):
                limit = self.idle_seconds(m)
                if limit >= 0 and m.status == LOADED and m.in_flight == 0 and now - m.last_used >= limit:
                    await self.unload(m, sleeping=True)

    async def stop_all(self) -> None:
        self._closing = True
        if self._idle_task is not None:
            self._idle_task.cancel()
        await asyncio.gather(*(self.unload(m) for m in self.models.values() if m.process is not None),
                             return_exceptions=True)

    def kill_all(self) -> None:
        for m in self.models.values():
            if m.process is not None:
                m.process.kill_now()

    # --- /models ---------------------------------------------------------------------------------
    def listing(self) -> dict[str, Any]:
        created = int(time.time())
        data = []
        for m in self.models.values():
            status: dict[str, Any] = {"value": m.status, "args": m.args}
            if m.failed:
                status["failed"] = True
                status["exit_code"] = m.exit_code
            item = describe(m.entry)
            item["created"] = created
            item["status"] = status
            item["memory_estimate"] = m.entry.memory  # pyllama's own: bytes counted against --models-memory
            if m.running:  # what the model's server says of itself (its metadata), as llama-server merges it
                for key, value in m.info.items():
                    item.setdefault(key, value)
            data.append(item)
        return {"data": data, "object": "list"}


async def _model_info(port: int) -> dict[str, Any]:
    """The first entry of a model server's /v1/models, {} when it cannot be read."""
    try:
        resp = await forward(Request("GET", "/v1/models"), port, 10.0, lambda: None)
        data = json.loads(resp.body)["data"][0] if isinstance(resp, Response) and resp.status == 200 else {}
        return data if isinstance(data, dict) else {}
    except (HTTPError, ValueError, KeyError, IndexError, TypeError):
        return {}


class RouterApi:
    """The router's routes."""

    def __init__(self, router: ModelRouter, args) -> None:
        self.router = router
        self.args = args
        self.autoload = bool(args.models_autoload)

    def routes(self) -> dict:
        r: dict = {("GET", "/health"): self.health, ("GET", "/v1/health"): self.health,
                   ("GET", "/models"): self.list_models, ("GET", "/v1/models"): self.list_models,
                   ("POST", "/models/load"): self.load, ("POST", "/models/unload"): self.unload,
                   ("GET", "/props"): self.props}
        for path in PROXY_GET:
            r[("GET", path)] = self.proxy_get
        for path in PROXY_POST:
            r[("POST", path)] = self.proxy_post
        return r

    async def health(self, req: Request) -> Response:
        return json_response({"status": "ok"})

    async def list_models(self, req: Request) -> Response:
        return json_response(self.router.listing())

    async def props(self, req: Request) -> Union[Response, StreamResponse]:
        if req.query.get("model"):
            return await self.proxy_get(req)
        return json_response({"role": "router", "max_instances": self.router.models_max,
                              "models_autoload": self.autoload, "model_alias": "pyllama", "model_path": "none",
                              "default_generation_settings": {"params": None, "n_ctx": 0},
                              "ui_settings": dict(self.args.ui_config or {})})

    @staticmethod
    def _body_model(req: Request) -> str:
        body = req.json()
        name = body.get("model") if isinstance(body, dict) else None
        return name if isinstance(name, str) else ""

    async def load(self, req: Request) -> Response:
        m = self.router.find(self._body_model(req))
        if m is None:
            return error_response(404, "model is not found", "not_found_error")
        if m.running:
            return error_response(400, "model is already running")
        await self.router.load(m)
        return json_response({"success": True})

    async def unload(self, req: Request) -> Response:
        m = self.router.find(self._body_model(req))
        if m is None:
            return error_response(400, "model is not found")
        if not m.running and m.status != SLEEPING:
            return error_response(400, "model is not running")
        await self.router.unload(m)
        return json_response({"success": True})

    def _autoload(self, req: Request) -> bool:
        value = req.query.get("autoload")
        return self.autoload if not value else value in ("true", "1")

    def _validate(self, name: str, autoload: bool) -> ModelState:
        if not name:
            raise RouterError(400, "model name is missing from the request")
        m = self.router.find(name)
        if m is None:
            raise RouterError(400, f"model '{name}' not found")
        # a sleeping model wakes on a request, as llama-server's: it was loaded, not unloaded
        if not autoload and not m.running and m.status != SLEEPING:
            raise RouterError(400, "model is not loaded")
        return m

    async def proxy_get(self, req: Request) -> Union[Response, StreamResponse]:
        return await self._proxy(req, req.query.get("model", ""))

    async def proxy_post(self, req: Request) -> Union[Response, StreamResponse]:
        return await self._proxy(req, self._body_model(req))

    async def _proxy(self, req: Request, name: str) -> Union[Response, StreamResponse]:
        autoload = self._autoload(req)
        m = self._validate(name, autoload)
        m.in_flight += 1  # from here the model is in use: no eviction, no idle stop

        def done() -> None:
            m.in_flight -= 1
            m.last_used = time.monotonic()

        try:
            m.last_used = time.monotonic()
            # a loading model is waited for even without autoload: its server does not listen yet
            if autoload or m.status in (SLEEPING, LOADING):
                await self.router.ensure_ready(m)
            proc = m.process
            if proc is None:
                raise RouterError(400, "model is not loaded")
        except BaseException:
            done()
            raise
        return await forward(req, proc.port, self.router.read_timeout, done)


def memory_budget(args) -> int:
    """--models-memory in bytes; 0 (the default): the memory available when the router starts."""
    return args.models_memory * MiB if args.models_memory else available_memory()


async def serve_router(args, argv: list[str]) -> int:
    """Runs the router until SIGINT or SIGTERM; every model process is stopped before it returns."""
    registry = ModelRegistry(args.models_dir, args.models_preset, argv)
    router = ModelRouter(registry, args.models_max, memory_budget(args), args.sleep_idle_seconds, args.timeout)
    starting = [m for m in router.models.values() if m.entry.load_on_startup]
    if 0 < args.models_max < len(starting):
        raise PyllamaError(f"{len(starting)} models are to load on start-up (load-on-startup), more than "
                           f"--models-max {args.models_max}")
    log.info("router mode: %d model(s): %s; at most %s loaded at once; memory budget %.0f MiB%s",
             len(router.models), ", ".join(router.models) or "none",
             args.models_max or "any number", router.memory_budget / MiB,
             "" if args.models_autoload else "; models load on /models/load only (--no-models-autoload)")
    api = RouterApi(router, args)
    access = settings(args)
    server, port = await listen(api.routes(), args, access, PUBLIC_PATHS | {"/models", "/v1/models"})
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    install_stop_signals(loop, stop.set)
    router.start()
    try:
        for m in starting:
            try:
                await router.load(m)
            except RouterError as exc:
                raise PyllamaError(f"model {m.entry.name} (load-on-startup): {exc.message}") from None
        log.info("listening on http://%s:%d%s", args.host, port, args.api_prefix)
        await stop.wait()
    finally:
        log.info("shutting down: stopping %d model server(s)",
                 sum(1 for m in router.models.values() if m.process is not None))
        await server.shutdown(grace=5.0)
        try:
            await router.stop_all()
        finally:
            router.kill_all()
    return 0


def run_router(args, argv: Optional[list[str]] = None) -> int:
    """The router's main (python -m pyllama.server with --models-dir or --models-preset, no -m)."""
    from ...util.loop import install_uvloop  # noqa: PLC0415
    install_uvloop()
    return asyncio.run(serve_router(args, list(sys.argv[1:] if argv is None else argv)))
