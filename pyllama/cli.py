"""Command-line conventions shared by the programs: llama.cpp's flag names, every flag also read
from PYLLAMA_ARG_<NAME> (the command line wins), and failures as one line with exit status 1."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, NoReturn, Optional, Sequence

from .errors import PyllamaError

ENV_PREFIX = "PYLLAMA_ARG_"


def env_name(action: argparse.Action) -> Optional[str]:
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs:
        return None
    return ENV_PREFIX + longs[0][2:].upper().replace("-", "_")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose flags fall back to PYLLAMA_ARG_<NAME> and say so in --help."""

    def error(self, message: str) -> NoReturn:  # one line, status 1 (argparse's default is 2 and a usage dump)
        self.exit(1, f"{self.prog}: error: {message}\n")

    def finish(self) -> "Parser":
        """Call after every add_argument: appends the variable name to each flag's help."""
        for action in self._actions:
            name = env_name(action)
            if name and action.help is not argparse.SUPPRESS and action.dest != "help":
                action.help = f"{action.help or ''} (env: {name})".strip()
        return self

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace=None):  # type: ignore[override]
        for action in self._actions:
            name = env_name(action)
            if not name or name not in os.environ or action.dest == "help":
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


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
