"""The process's settings from its environment (`PYLLAMA_*`), read once at start-up into typed records.

Every entry point (the server, `generate`, the rpc server) calls `load()` before it opens anything,
so a bad value is one clear error at start-up, naming the variable, and not a failure in the middle
of serving. The records are frozen; each part goes to the component it configures (a CPU device gets
`Settings.cpu`, an rpc device `Settings.rpc`, ...). Code used as a library without an entry point
reads `current()`, which loads on first use. Command-line flags and their `PYLLAMA_ARG_<NAME>`
variables are not here: `util/cli.py` reads those with the command line.

`python -m pyllama.util.settings` prints every variable with its value and its meaning.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

from .errors import PyllamaError

STAGING_ALIGN = 64  # an rpc connection's staging arena hands out regions at this alignment


@dataclass(frozen=True)
class CpuSettings:
    native: bool = True      # bound kernels run as native runs (False: one Python callable per node)
    repack: bool = True      # quantized weights get an interleaved copy for the x8 kernels
    blas_only: bool = False  # every F32 product goes to BLAS (no streaming kernel for decode rows)


@dataclass(frozen=True)
class RpcSettings:
    timeout_s: float = 120.0            # without --rpc-timeout: bound on every wait on a peer
    staging_bytes: int = 64 << 20       # a connection's staging arena
    async_copy: bool = True             # split copies without a host round trip
    batched_get: bool = True            # GET_TENSORS for several reads in one command
    token: Optional[bytes] = None       # without --rpc-token-file / --auth-token-file
    server_caps: Optional[int] = None   # an rpc server advertises only these capability bits


@dataclass(frozen=True)
class SplitSettings:
    probe: bool = False      # split layers by each device's measured step time (not by free memory)
    check_s: float = 60.0    # seconds between checks of a split against its load (0: off)


@dataclass(frozen=True)
class ObsSettings:
    trace: Optional[str] = None  # without --trace: the trace file
    pipe_prof: bool = False      # print where each pipeline group's time goes
    pipe_prof_s: float = 5.0
    rpc_stats: bool = False      # print rpc command counts and bytes per command type
    rpc_stats_s: float = 5.0


@dataclass(frozen=True)
class CudaSettings:
    kernels: Optional[str] = None  # a folder of built kernels (instead of the package's)
    weights: str = "f16"           # the type F16/BF16-able weights are kept in: f16 or bf16
    cublas: Optional[str] = None   # the cuBLAS library to load
    toolkit: tuple[str, ...] = ()  # CUDA_HOME, CUDA_PATH: where to look for the toolkit


@dataclass(frozen=True)
class Settings:
    cpu: CpuSettings = CpuSettings()
    rpc: RpcSettings = RpcSettings()
    split: SplitSettings = SplitSettings()
    obs: ObsSettings = ObsSettings()
    cuda: CudaSettings = CudaSettings()
    cache_dir: str = ""  # where the built-in default model is made

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> "Settings":
        """The settings `environ` (default: os.environ) asks for; a value that does not parse is a
        PyllamaError naming the variable, its value and what was expected."""
        env = os.environ if environ is None else environ
        parts: dict[str, dict[str, Any]] = {}
        for v in VARIABLES:
            raw = env.get(v.name, "").strip()
            if v.part is None or not raw:
                continue
            try:
                value = v.parse(raw)
            except ValueError:
                raise PyllamaError(f"{v.name}={raw!r}: expected {v.expected}") from None
            parts.setdefault(v.part, {})[v.field] = value
        toolkit = tuple(p for p in (env.get("CUDA_HOME"), env.get("CUDA_PATH")) if p)
        parts.setdefault("cuda", {})["toolkit"] = toolkit
        made = {name: type(getattr(cls, name))(**fields) for name, fields in parts.items()}
        return cls(**made, cache_dir=_cache_dir(env))


# --- parsing -----------------------------------------------------------------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(raw)


def _off_flag(raw: str) -> bool:
    """A PYLLAMA_..._NO_X variable: set (true) means the feature is off."""
    return not _flag(raw)


def _checked(parse: Callable[[str], Any], valid: Callable[[Any], bool]) -> Callable[[str], Any]:
    def run(raw: str) -> Any:
        value = parse(raw)
        if not valid(value):
            raise ValueError(raw)
        return value
    return run


def _ms(raw: str) -> float:
    return int(raw) / 1000


def _to_ms(seconds: float) -> int:
    return round(seconds * 1000)


def _positive_s(v: float) -> bool:
    return 0 < v < float("inf")


@dataclass(frozen=True)
class Variable:
    name: str
    part: Optional[str]  # the Settings field it sets (None: read elsewhere, listed for the help)
    field: str
    parse: Callable[[str], Any]
    expected: str
    meaning: str
    show: Callable[[Any], Any] = lambda value: value  # the field's value as the variable says it


_BOOL = "1 or 0 (true/false, yes/no, on/off)"

VARIABLES: tuple[Variable, ...] = (
    Variable("PYLLAMA_CPU_NATIVE", "cpu", "native", _flag, _BOOL,
             "0: every node of a CPU graph runs as a Python callable (for A/B runs)"),
    Variable("PYLLAMA_CPU_REPACK", "cpu", "repack", _flag, _BOOL,
             "0: quantized weights keep only the file's layout (as --no-repack)"),
    Variable("PYLLAMA_CPU_BLAS_ONLY", "cpu", "blas_only", _flag, _BOOL,
             "1: every F32 product goes to BLAS (for A/B runs)"),
    Variable("PYLLAMA_RPC_TIMEOUT", "rpc", "timeout_s", _checked(float, _positive_s),
             "a positive number of seconds", "seconds to wait on an rpc server without --rpc-timeout (120)"),
    Variable("PYLLAMA_RPC_STAGING_BYTES", "rpc", "staging_bytes", _checked(lambda r: int(r, 0),
             lambda n: n >= STAGING_ALIGN), f"an integer number of bytes, at least {STAGING_ALIGN}",
             "bytes of each rpc connection's staging arena (64 MiB)"),
    Variable("PYLLAMA_RPC_NO_ASYNC_COPY", "rpc", "async_copy", _off_flag, _BOOL,
             "1: split copies go through host bytes (for A/B runs)", show=lambda on: not on),
    Variable("PYLLAMA_RPC_NO_BATCHED_GET", "rpc", "batched_get", _off_flag, _BOOL,
             "1: one GET_TENSOR per read, never GET_TENSORS (for A/B runs)", show=lambda on: not on),
    Variable("PYLLAMA_RPC_TOKEN", "rpc", "token", str.encode, "a token",
             "the rpc token without --rpc-token-file / --auth-token-file"),
    Variable("PYLLAMA_RPC_SERVER_CAPS", "rpc", "server_caps",
             _checked(lambda r: int(r, 0), lambda m: 0 <= m <= 0xFFFFFFFF), "an integer 32-bit mask",
             "an rpc server advertises only these capability bits (e.g. 0x1)"),
    Variable("PYLLAMA_SPLIT_PROBE", "split", "probe", _flag, _BOOL,
             "1: split layers by each device's measured step time instead of its free memory"),
    Variable("PYLLAMA_SPLIT_CHECK_S", "split", "check_s", _checked(float, lambda v: 0 <= v < float("inf")),
             "a number of seconds (0 turns the check off)",
             "seconds between checks of a split against its measured load (60; 0: off)"),
    Variable("PYLLAMA_TRACE", "obs", "trace", str, "a path", "the trace file without --trace"),
    Variable("PYLLAMA_PIPE_PROF", "obs", "pipe_prof", _flag, _BOOL,
             "1: print where each pipeline group's time goes"),
    Variable("PYLLAMA_PIPE_PROF_MS", "obs", "pipe_prof_s", _checked(_ms, lambda s: s > 0),
             "a whole number of milliseconds", "the pipe profile's period (5000)", show=_to_ms),
    Variable("PYLLAMA_RPC_STATS", "obs", "rpc_stats", _flag, _BOOL,
             "1: print rpc command counts and bytes per command type"),
    Variable("PYLLAMA_RPC_STATS_MS", "obs", "rpc_stats_s", _checked(_ms, lambda s: s > 0),
             "a whole number of milliseconds", "the rpc statistics' period (5000)", show=_to_ms),
    Variable("PYLLAMA_CUDA_KERNELS", "cuda", "kernels", str, "a folder", "built CUDA kernels to load"),
    Variable("PYLLAMA_CUDA_WEIGHTS", "cuda", "weights", _checked(str.lower, lambda w: w in ("f16", "bf16")),
             "f16 or bf16", "the type a CUDA device keeps F16/BF16/F32 weights in (f16)"),
    Variable("PYLLAMA_CUBLAS", "cuda", "cublas", str, "a path", "the cuBLAS library to load"),
    Variable("PYLLAMA_CACHE", None, "", str, "a folder",
             "where the built-in default model is made ($XDG_CACHE_HOME/pyllama, ~/.cache/pyllama)"),
)


def _cache_dir(env: Mapping[str, str]) -> str:
    return env.get("PYLLAMA_CACHE") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pyllama")


# --- the process's settings --------------------------------------------------------------------------

_current: Optional[Settings] = None


def load(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Reads the settings (from `environ`, default os.environ) and makes them the process's: an
    entry point calls this once, first."""
    global _current
    _current = Settings.from_environ(environ)
    return _current


def current() -> Settings:
    """The process's settings (read from the environment on first use when no entry point did)."""
    return _current if _current is not None else load()


@contextlib.contextmanager
def override(**parts: Mapping[str, Any]) -> Iterator[Settings]:
    """The process's settings with some fields changed while the block runs, e.g.
    `override(cpu={"native": False})`; the previous settings come back after it."""
    global _current
    before = current()
    changed = {name: dataclasses.replace(getattr(before, name), **fields) for name, fields in parts.items()}
    _current = dataclasses.replace(before, **changed)
    try:
        yield _current
    finally:
        _current = before


def describe(settings: Settings) -> str:
    """Every variable, its value in `settings` and its meaning (secrets masked)."""
    lines = []
    for v in VARIABLES:
        value: Any = settings.cache_dir if v.part is None else v.show(getattr(getattr(settings, v.part), v.field))
        if v.field == "token" and value is not None:
            value = "(set)"
        lines.append(f"{v.name:28} {value!s:12} {v.meaning}")
    lines.append(f"{'CUDA_HOME, CUDA_PATH':28} {':'.join(settings.cuda.toolkit) or None!s:12} where the CUDA "
                 "toolkit is looked for (then /usr/local/cuda)")
    return "\n".join(lines)


def main() -> int:
    try:
        print(describe(Settings.from_environ()))
    except PyllamaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
