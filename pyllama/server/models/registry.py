"""What models the router serves: the GGUF files of --models-dir and the sections of --models-preset,
each with the command line its own server process starts with and an estimate of its memory.

A --models-dir entry is a `NAME.gguf` file (model NAME) or a subfolder NAME holding the model (its
first shard `*-00001-of-*.gguf` if split; files named `mmproj*` are skipped). A preset file is
llama-server's INI: `[*]` holds options for every model, `[NAME]` options for one (a name of
--models-dir adds to that model, another needs `model = PATH`); keys are flags without their dashes,
short forms or LLAMA_ARG_* names; `load-on-startup` and `stop-timeout` are the preset's own.

A model's options, highest first: the router's command line, its own section, `[*]`. The router sets
the model, host, port and alias of each child itself, and keeps its router-only flags."""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ...util.cli import Parser, Toggle, parse_bool
from ...util.errors import PyllamaError
from ..options import SPEC_FLAGS, UNSUPPORTED, build_parser

# flags the router decides for each child, or keeps for itself: never passed through
ROUTER_DESTS = frozenset(("model", "host", "port", "reuse_port", "api_key", "api_key_file", "alias", "api_prefix",
                          "models_dir", "models_preset", "models_max", "models_autoload", "sleep_idle_seconds",
                          "models_memory"))
# the preset's own keys (not flags)
PRESET_ONLY = ("load-on-startup", "stop-timeout")
DEFAULT_STOP_TIMEOUT = 10  # seconds a stopping child gets before it is killed, as llama-server
# what a pyllama server process takes beyond its weights and KV cache (interpreter, numpy, compute
# buffers): measured near 70 MiB for a tiny model
PROCESS_OVERHEAD = 80 << 20
CHILD_HOST = "127.0.0.1"


@dataclass
class ModelEntry:
    """One model the router can load."""
    name: str
    path: str
    source: str                     # "models_dir" or "preset", as llama-server's `source`
    options: list[str]              # the child's flags besides -m, --host, --port and --alias
    aliases: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    load_on_startup: bool = False
    stop_timeout: int = DEFAULT_STOP_TIMEOUT
    sleep_idle_seconds: Optional[int] = None  # the preset's; None: the router's --sleep-idle-seconds
    memory: int = 0                 # estimated bytes once loaded

    def argv(self, port: int) -> list[str]:
        """The child's whole command line."""
        return [sys.executable, "-m", "pyllama.server", *self.options, "-m", self.path, "--host", CHILD_HOST,
                "--port", str(port), "--alias", self.name]


class _Strict(Parser):
    """The server's parser with errors raised, not printed and exited on: a bad preset value is
    reported as the preset's error."""

    def error(self, message: str):  # type: ignore[override]
        raise PyllamaError(message)


def strict_parser() -> Parser:
    p = build_parser()
    p.__class__ = _Strict
    return p


def parse_ini(text: str, path: str) -> dict[str, dict[str, str]]:
    """llama-server's INI: `[section]`, `key = value`, comments from ; or #, blank lines. Keys
    before the first section are kept under "" (only `version` may be there)."""
    out: dict[str, dict[str, str]] = {"": {}}
    current = ""
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if line.startswith("["):
            end = line.find("]")
            rest = line[end + 1:].strip() if end > 0 else ""
            if end <= 1 or (rest and rest[0] not in ";#"):
                raise PyllamaError(f"{path}:{n}: a section header is [NAME], got '{raw.strip()}'")
            current = line[1:end].strip()
            out.setdefault(current, {})
            continue
        key, eq, value = line.partition("=")
        key = key.strip()
        if not eq or not key or not (key[0].isalpha() or key[0] == "_") or \
                any(not (c.isalnum() or c in "_.-") for c in key):
            raise PyllamaError(f"{path}:{n}: expected 'key = value', a [section], a comment or a blank line; "
                               f"got '{raw.strip()}'")
        for i, c in enumerate(value):  # a comment starts at ; or # after a blank
            if c in ";#" and (i == 0 or value[i - 1] in " \t"):
                value = value[:i]
                break
        out[current][key] = value.strip()
    return out


class _Options:
    """Preset keys to the server's flags, rendered as command-line tokens."""

    def __init__(self) -> None:
        self.parser = build_parser()
        self.by_option = self.parser._option_string_actions
        self.by_env: dict[str, tuple[argparse.Action, bool]] = {}
        for action in self.parser._actions:
            for name, negated in self.parser.env_names(action):
                self.by_env[name] = (action, negated)
        self.by_env.setdefault("LLAMA_API_KEY", (self.by_option["--api-key"], False))

    def lookup(self, key: str, where: str) -> tuple[argparse.Action, bool]:
        """(action, negated) of a preset key; PyllamaError for one the server does not take."""
        if key in self.by_env:
            return self.by_env[key]
        for option in ("--" + key, "-" + key):
            if option in UNSUPPORTED and option not in SPEC_FLAGS:
                raise PyllamaError(f"{where}: option '{key}': llama-server flag not supported by pyllama: "
                                   f"{UNSUPPORTED[option]}")
            action = self.by_option.get(option)
            if action is not None:
                return action, option in _negatives(action)
        raise PyllamaError(f"{where}: option '{key}' not recognized")

    def render(self, action: argparse.Action, negated: bool, value: str, where: str) -> list[str]:
        if action.nargs == 0:
            try:
                on = parse_bool(value)
            except ValueError:
                raise PyllamaError(f"{where}: not a boolean: '{value}' (true/false, on/off, 1/0)") from None
            negs = _negatives(action)
            if negated:
                on = not on
            positive = [o for o in action.option_strings if o not in negs]
            if on:
                return [_long(positive)]
            return [_long(sorted(negs))] if negs else []
        return [_long(action.option_strings), value]


def _negatives(action: argparse.Action) -> frozenset:
    if isinstance(action, Toggle):
        return action.negatives
    if isinstance(action, argparse.BooleanOptionalAction):
        return frozenset(o for o in action.option_strings if o.startswith("--no-"))
    return frozenset()


def _long(options: Sequence[str]) -> str:
    return next((o for o in options if o.startswith("--")), options[0])


def passthrough_args(argv: Sequence[str], parser: Optional[Parser] = None) -> tuple[list[str], set[str]]:
    """The router's own command line less the flags it keeps or decides per child (with their
    values), and the dests it sets: the children inherit the rest, above any preset option."""
    parser = parser or build_parser()
    actions = parser._option_string_actions
    out: list[str] = []
    dests: set[str] = set()
    i = 0
    while i < len(argv):
        token = argv[i]
        name, has_value, _ = token.partition("=")
        action = actions.get(name)
        takes = action is not None and action.nargs != 0
        n = 2 if takes and not has_value else 1
        if action is None or action.dest not in ROUTER_DESTS:
            out.extend(argv[i:i + n])
            if action is not None:
                dests.add(action.dest)
        i += n
    return out, dests


def estimate_memory(path: str, options: Sequence[str]) -> int:
    """A model's bytes once loaded: its file, its KV cache at the context it will get, and a
    server process. A file that is not a readable GGUF counts its size (it will fail to load)."""
    from gguf import GGML_QUANT_SIZES  # noqa: PLC0415

    from ...models.gguf_file import GGUFFile  # noqa: PLC0415
    from ...models.hparams import read_hparams  # noqa: PLC0415
    from ...runtime.cache_types import CACHE_TYPES  # noqa: PLC0415
    try:
        size = os.path.getsize(path)
    except OSError:
        return PROCESS_OVERHEAD
    try:
        args = strict_parser().parse_args(list(options))
        hp = read_hparams(GGUFFile(path))
    except Exception:  # noqa: BLE001 - anything unreadable is the load's error, not the estimate's
        return size + PROCESS_OVERHEAD
    n_ctx = args.ctx_size or hp.n_ctx_train
    per_cell = 0.0
    for name in (args.cache_type_k, args.cache_type_v):
        block, nbytes = GGML_QUANT_SIZES[CACHE_TYPES[name]]
        per_cell += hp.n_embd_kv * nbytes / block
    copies = max(args.pipeline_groups, 1) if args.kv_unified else 1  # unified KV: every group holds the whole
    return size + int(hp.n_layer * n_ctx * per_cell) * copies + PROCESS_OVERHEAD


class ModelRegistry:
    """The models of --models-dir and --models-preset, read once at start; any error in them is
    one PyllamaError (the router does not start on a half-read configuration)."""

    def __init__(self, models_dir: Optional[str], preset_path: Optional[str], argv: Sequence[str]) -> None:
        self._opts = _Options()
        self.base_args, cli_dests = passthrough_args(argv, self._opts.parser)
        found: dict[str, tuple[str, str]] = {}  # name -> (path, source)
        if models_dir:
            for name, path in scan_models_dir(models_dir).items():
                found[name] = (path, "models_dir")
        sections: dict[str, dict[str, str]] = {}
        if preset_path:
            try:
                with open(preset_path, encoding="utf-8") as fh:
                    text = fh.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise PyllamaError(f"--models-preset {preset_path}: cannot read it "
                                   f"({getattr(exc, 'strerror', None) or exc})") from None
            sections = parse_ini(text, preset_path)
        top = {k: v for k, v in sections.pop("", {}).items() if k != "version"}
        if top:
            raise PyllamaError(f"{preset_path}: option '{next(iter(top))}' is outside any section: put it under "
                               "[*] (every model) or [NAME] (one model)")
        common = sections.pop("*", {})
        self.models: dict[str, ModelEntry] = {}
        for name in list(found) + [s for s in sections if s not in found]:
            own = sections.get(name)
            self.models[name] = self._entry(name, found.get(name), common, own, cli_dests, preset_path)
        self._names: dict[str, str] = {}
        for entry in self.models.values():
            for alias in [entry.name] + entry.aliases:
                if alias in self._names:
                    raise PyllamaError(f"model name or alias '{alias}' is given to both '{self._names[alias]}' and "
                                       f"'{entry.name}'")
                self._names[alias] = entry.name

    def find(self, name: str) -> Optional[ModelEntry]:
        """The model of a name or alias."""
        canonical = self._names.get(name)
        return self.models[canonical] if canonical is not None else None

    def _entry(self, name: str, found: Optional[tuple[str, str]], common: dict[str, str],
               own: Optional[dict[str, str]], cli_dests: set[str], preset_path: Optional[str]) -> ModelEntry:
        where = f"{preset_path} [{name}]" if preset_path else f"model '{name}'"
        merged: dict[str, tuple[str, str, str]] = {}  # dest -> (key, value, section) of the last to set it
        special: dict[str, str] = {}
        for section, options in (("*", common), (name, own or {})):
            for key, value in options.items():
                if key in PRESET_ONLY:
                    special[key] = value
                    continue
                action, _ = self._opts.lookup(key, f"{preset_path} [{section}]")
                merged[action.dest] = (key, value, section)
        path = found[0] if found else None
        source = "preset" if own is not None else "models_dir"
        if "model" in merged:
            path = os.path.abspath(merged["model"][1])  # relative to the router's directory, as llama-server
        if not path:
            raise PyllamaError(f"{where}: no model file: set 'model = PATH' (or put NAME.gguf in --models-dir)")
        tokens: list[str] = []
        aliases: list[str] = []
        tags: list[str] = []
        idle: Optional[int] = None
        for dest, (key, value, section) in merged.items():
            action, negated = self._opts.lookup(key, where)
            here = f"{preset_path} [{section}] {key}"
            if action.type is not None and action.nargs != 0:
                try:
                    parsed = action.type(value)
                except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
                    raise PyllamaError(f"{here}: '{value}': {exc}") from None
                if action.choices is not None and parsed not in action.choices:
                    raise PyllamaError(f"{here}: '{value}' is not one of {', '.join(map(str, action.choices))}")
            if dest == "alias":
                aliases = [a.strip() for a in value.split(",") if a.strip()]
            elif dest == "sleep_idle_seconds":
                idle = int(value)
            elif dest in ROUTER_DESTS or dest in cli_dests:
                continue  # the router's own, or its command line wins
            else:
                if dest == "tags":
                    tags = [t.strip() for t in value.split(",") if t.strip()]
                tokens += self._opts.render(action, negated, value, here)
        options = tokens + self.base_args
        if "sleep_idle_seconds" in cli_dests:
            idle = None  # the router's command line wins here too
        try:
            strict_parser().parse_args(options + ["-m", path])  # every value as the child will read it
        except PyllamaError as exc:
            raise PyllamaError(f"{where}: {exc}") from None
        entry = ModelEntry(name=name, path=path, source=source, options=options, aliases=aliases, tags=tags,
                           sleep_idle_seconds=idle, memory=estimate_memory(path, options))
        if "load-on-startup" in special:
            try:
                entry.load_on_startup = parse_bool(special["load-on-startup"])
            except ValueError:
                raise PyllamaError(f"{where}: load-on-startup: not a boolean: '{special['load-on-startup']}'") \
                    from None
        if "stop-timeout" in special:
            try:
                entry.stop_timeout = max(0, int(special["stop-timeout"]))
            except ValueError:
                raise PyllamaError(f"{where}: stop-timeout: not a number of seconds: '{special['stop-timeout']}'") \
                    from None
        return entry


def scan_models_dir(models_dir: str) -> dict[str, str]:
    """name -> file of each model in the folder, as llama-server lists them."""
    if not os.path.isdir(models_dir):
        raise PyllamaError(f"--models-dir {models_dir}: does not exist or is not a directory")
    out: dict[str, str] = {}
    for entry in sorted(os.scandir(models_dir), key=lambda e: e.name):
        if entry.is_dir():
            files = sorted(f.name for f in os.scandir(entry.path) if f.is_file() and f.name.endswith(".gguf")
                           and "mmproj" not in f.name)
            shard = next((f for f in files if "-00001-of-" in f), None)
            chosen = shard or next((f for f in files if "-of-" not in f), None)
            if chosen:
                out[entry.name] = os.path.join(os.path.abspath(entry.path), chosen)
        elif entry.name.endswith(".gguf") and "mmproj" not in entry.name:
            out[entry.name[:-len(".gguf")]] = os.path.abspath(entry.path)
    return out


def describe(entry: ModelEntry) -> dict[str, Any]:
    """The fields of /models that do not change with the model's state."""
    return {"id": entry.name, "aliases": entry.aliases, "tags": entry.tags, "object": "model", "owned_by": "pyllama",
            "path": entry.path, "source": entry.source, "can_remove": False,
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]}}
