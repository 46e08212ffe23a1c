"""Command-line conventions shared by the programs: llama.cpp's flag names, every flag also read
from PYLLAMA_ARG_<NAME> or LLAMA_ARG_<NAME> (in that order; the command line wins), failures as
one line with exit status 1, logging, and the stop signals (the first stops gracefully, a second
exits at once)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Callable, NoReturn, Optional, Sequence

from .errors import PyllamaError

ENV_PREFIX = "PYLLAMA_ARG_"
# llama-server's variables, read after ours (PYLLAMA_ARG_<NAME> wins when both are set)
ENV_PREFIXES = (ENV_PREFIX, "LLAMA_ARG_")


def env_name(action: argparse.Action, prefix: str = ENV_PREFIX) -> Optional[str]:
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs:
        return None
    return prefix + longs[0][2:].upper().replace("-", "_")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose flags fall back to environment variables and say so in --help.

    env_prefixes: the variable prefixes read, first found wins (default PYLLAMA_ARG_, then
    LLAMA_ARG_). A program other than the server and generate (the rpc server) takes its own
    prefix, so that variables exported for the server (PYLLAMA_ARG_DEVICE=RPC0,CPU, a port) never
    reach it."""

    def __init__(self, *args, env_prefixes: Sequence[str] = ENV_PREFIXES, **kwargs):
        super().__init__(*args, **kwargs)
        self.env_prefixes = tuple(env_prefixes)

    def error(self, message: str) -> NoReturn:  # one line, status 1 (argparse's default is 2 and a usage dump)
        self.exit(1, f"{self.prog}: error: {message}\n")

    def finish(self) -> "Parser":
        """Call after every add_argument: appends the variable name to each flag's help."""
        for action in self._actions:
            name = env_name(action, self.env_prefixes[0]) if self.env_prefixes else None
            if name and action.help is not argparse.SUPPRESS and action.dest != "help":
                action.help = f"{action.help or ''} (env: {name})".strip()
        return self

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace=None):  # type: ignore[override]
        for action in self._actions:
            if action.dest == "help":
                continue
            names = [env_name(action, prefix) for prefix in self.env_prefixes]
            name = next((n for n in names if n and n in os.environ), None)
            if name is None:
                continue
            raw = os.environ[name]
            try:
                if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                       argparse.BooleanOptionalAction)):
                    truthy = raw.strip().lower() in ("1", "true", "yes", "on", "enabled")
                    value = truthy if not isinstance(action, argparse._StoreFalseAction) else not truthy
                else:
                    value = action.type(raw) if action.type else raw
                    if action.choices is not None and value not in action.choices:
                        raise ValueError(f"must be one of {', '.join(map(str, action.choices))}")
            except (ValueError, TypeError) as exc:
                self.error(f"{name}={raw!r}: {exc}")
            action.default = value
        return super().parse_args(args, namespace)


def run_main(main: Callable[[], int]) -> NoReturn:
    """Runs a program's main: a PyllamaError (or ValueError from bad input) is one line, exit 1."""
    try:
        code = main()
    except PyllamaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def setup_logging(verbose: bool, default: int = logging.WARNING) -> None:
    """pyllama's loggers at `default` (the servers pass INFO: their normal events, as
    llama-server prints its start-up lines; problems are WARNING or ERROR), DEBUG with -v.
    Other libraries log at WARNING and above only."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pyllama").setLevel(logging.DEBUG if verbose else default)


def install_stop_signals(loop: asyncio.AbstractEventLoop, on_stop: Callable[[], None]) -> None:
    """SIGINT and SIGTERM: the first calls `on_stop` (a graceful shutdown, which may take a few
    seconds with requests in flight); a second one exits the process at once with status 128 +
    the signal number (130 for a second Ctrl+C), as llama-server exits on a second interrupt.

    The second signal goes to a plain Python handler, not the event loop, because the graceful
    shutdown may hold the main thread in a bounded join, where loop callbacks cannot run."""
    def force(signum: int, _frame) -> None:
        try:
            os.write(2, f"received a second {signal.Signals(signum).name}: exiting at once\n".encode())
        finally:
            os._exit(128 + signum)

    def first(signum: int) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
            signal.signal(sig, force)
        on_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, first, sig)
