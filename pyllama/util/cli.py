"""Command-line conventions shared by the programs: llama.cpp's flag names matched exactly, every flag
also read from PYLLAMA_ARG_<NAME> or llama-server's LLAMA_ARG_<NAME> (in that order; the command line
wins), failures as one line with exit status 1, logging, and the stop signals (the first stops
gracefully, a second exits at once)."""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
from typing import Callable, NoReturn, Optional, Sequence

from .errors import PyllamaError

ENV_PREFIX = "PYLLAMA_ARG_"
LLAMA_PREFIX = "LLAMA_ARG_"
# llama-server's variables, read after ours (PYLLAMA_ARG_<NAME> wins when both are set)
ENV_PREFIXES = (ENV_PREFIX, LLAMA_PREFIX)

# llama.cpp's spelling of on and off in variables and in on|off|auto values
TRUTHY = frozenset(("1", "true", "on", "enabled", "yes"))
FALSEY = frozenset(("0", "false", "off", "disabled", "no"))


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in TRUTHY:
        return True
    if value in FALSEY:
        return False
    raise ValueError("expected one of 1, true, on, enabled or 0, false, off, disabled")


def env_name(action: argparse.Action, prefix: str = ENV_PREFIX) -> Optional[str]:
    longs = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
    if not longs:
        longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs:
        return None
    return prefix + longs[0][2:].upper().replace("-", "_")


class Toggle(argparse.Action):
    """An on/off flag spelled by several options: those in `negatives` turn it off, the others on
    (llama-server's `--slots`/`--no-slots`, `-kvu`/`-no-kvu`, `-cb`/`-nocb`)."""

    def __init__(self, option_strings, dest, negatives: Sequence[str] = (), default=None, help=None, **kw):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help, **kw)
        self.negatives = frozenset(negatives)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string not in self.negatives)


def _is_on_off(action: argparse.Action) -> bool:
    return isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                               argparse.BooleanOptionalAction, Toggle))


class Parser(argparse.ArgumentParser):
    """An ArgumentParser with llama.cpp's conventions: flags fall back to environment variables
    (and say which in --help, with their defaults), options are matched exactly (no prefix
    abbreviations, and no clustering of short options: `-ngl 99` is never `-n gl`), failures are
    one line with status 1.

    env_prefixes: the variable prefixes read, first found wins (default PYLLAMA_ARG_, then
    LLAMA_ARG_). A flag's variable is the prefix plus its first long name (`--ctx-size`:
    PYLLAMA_ARG_CTX_SIZE); `add_argument(..., llama_env="LLAMA_ARG_N_PARALLEL")` names the
    LLAMA_ARG_ variable where llama-server spells it differently (`llama_env=None` reads none),
    and an on/off flag also reads llama.cpp's negated form (LLAMA_ARG_NO_<NAME> set turns it off).
    A program other than the server and generate (the rpc server) takes its own prefix, so that
    variables exported for the server (PYLLAMA_ARG_DEVICE=RPC0,CPU, a port) never reach it."""

    def __init__(self, *args, env_prefixes: Sequence[str] = ENV_PREFIXES, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.env_prefixes = tuple(env_prefixes)
        self._llama_env: dict[int, Optional[str]] = {}

    def add_argument(self, *args, **kwargs):  # type: ignore[override]
        has_llama = "llama_env" in kwargs
        llama = kwargs.pop("llama_env", None)
        action = super().add_argument(*args, **kwargs)
        if has_llama:
            self._llama_env[id(action)] = llama
        return action

    def _get_option_tuples(self, option_string):  # type: ignore[override]
        # argparse reads an unknown `-hf` as `-h f` and `-ngl` as `-n gl`; llama.cpp matches
        # options exactly, so no partial match is offered at all
        return []

    def error(self, message: str) -> NoReturn:  # one line, status 1 (argparse's default is 2 and a usage dump)
        self.exit(1, f"{self.prog}: error: {message}\n")

    def env_names(self, action: argparse.Action) -> list[tuple[str, bool]]:
        """The variables `action` reads, first found wins: (name, negated)."""
        out: list[tuple[str, bool]] = []
        if action.dest == "help" or isinstance(action, argparse._VersionAction):
            return out
        for prefix in self.env_prefixes:
            if prefix == LLAMA_PREFIX and id(action) in self._llama_env:
                name = self._llama_env[id(action)]
            else:
                name = env_name(action, prefix)
            if not name:
                continue
            out.append((name, False))
            if prefix == LLAMA_PREFIX and _is_on_off(action) and name.startswith(LLAMA_PREFIX):
                out.append((LLAMA_PREFIX + "NO_" + name[len(LLAMA_PREFIX):], True))
        return out

    def finish(self) -> "Parser":
        """Call after every add_argument: appends each flag's default and variables to its help."""
        for action in self._actions:
            if action.help is argparse.SUPPRESS or action.dest == "help" or isinstance(action, argparse._VersionAction):
                continue
            text = action.help or ""
            if "default:" not in text:
                if _is_on_off(action) and isinstance(action.default, bool):
                    text += f" (default: {'on' if action.default else 'off'})"
                elif not _is_on_off(action) and action.default not in (None, argparse.SUPPRESS):
                    text += f" (default: {action.default})"
            names = [n for n, negated in self.env_names(action) if not negated]
            if names:
                text += f" (env: {', '.join(names)})"
            action.help = text.strip().replace("%", "%%")
        return self

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace=None):  # type: ignore[override]
        for action in self._actions:
            found = next(((n, neg) for n, neg in self.env_names(action) if n in os.environ), None)
            if found is None:
                continue
            name, negated = found
            raw = os.environ[name]
            try:
                if _is_on_off(action):
                    truthy = parse_bool(raw)
                    if negated:
                        truthy = not truthy
                    value = truthy if not isinstance(action, argparse._StoreFalseAction) else not truthy
                else:
                    value = action.type(raw) if action.type else raw
                    if action.choices is not None and value not in action.choices:
                        raise ValueError(f"must be one of {', '.join(map(str, action.choices))}")
            except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
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


def is_loopback_address(host: str) -> bool:
    """Whether a listening address (--host) is a loopback one: only this machine can connect."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
