"""Devices from the command line: `--device` (ordered, e.g. RPC0,CPU), `--rpc host:port,...`,
`-sm layer|none` and `--tensor-split a,b,...`, as llama.cpp names them."""
from __future__ import annotations

from typing import Optional, Sequence

from .backend.base import Backend
from .backend.cpu import CPUBackend
from .errors import PyllamaError


def add_device_args(p) -> None:
    p.add_argument("--rpc", help="comma-separated rpc_server endpoints host:port; RPCi is the i-th")
    p.add_argument("-dev", "--device", help="comma-separated devices in layer order, e.g. RPC0,CPU or CUDA0,RPC0 "
                                             "(default: every RPC device, then CPU); the last holds the output layer")
    p.add_argument("-sm", "--split-mode", default="layer", choices=["layer", "none"],
                   help="layer: split the layers over the devices; none: everything on the first device")
    p.add_argument("-ts", "--tensor-split", help="comma-separated proportions of layers per device "
                                                  "(default: by free memory)")
    p.add_argument("--rpc-token-file", metavar="PATH",
                   help="token the rpc servers require (first line of the file; also $PYLLAMA_RPC_TOKEN)")
    p.add_argument("--rpc-timeout", type=float, metavar="SECONDS",
                   help="how long to wait on an rpc server (a whole send, or the next bytes of a reply) before the "
                        "requests it serves fail and it counts as lost; set it above the longest step "
                        "(default: $PYLLAMA_RPC_TIMEOUT, else 120)")


def parse_split(text: Optional[str], n_devices: int) -> Optional[list[float]]:
    if not text:
        return None
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise PyllamaError(f"--tensor-split '{text}': expected comma-separated numbers") from None
    if len(values) != n_devices:
        raise PyllamaError(f"--tensor-split has {len(values)} values for {n_devices} devices")
    if any(v < 0 for v in values) or sum(values) <= 0:
        raise PyllamaError(f"--tensor-split '{text}': proportions must be non-negative and not all zero")
    return values


def make_backends(device: Optional[str], rpc: Optional[str], split_mode: str, n_threads: int,
                  token_file: Optional[str] = None, rpc_timeout: Optional[float] = None) -> list[Backend]:
    """The backends in layer order. Connections to rpc servers are opened here (once per endpoint),
    proving the token of `token_file` (else $PYLLAMA_RPC_TOKEN) to servers that require one, with
    `rpc_timeout` seconds (else $PYLLAMA_RPC_TIMEOUT, else 120) as their timeout."""
    endpoints = [e.strip() for e in rpc.split(",") if e.strip()] if rpc else []
    names = [d.strip().upper() for d in device.split(",") if d.strip()] if device else \
        [f"RPC{i}" for i in range(len(endpoints))] + ["CPU"]
    if len(set(names)) != len(names):
        raise PyllamaError(f"--device '{device}' lists a device twice")
    backends: list[Backend] = []
    for name in names:
        if name == "CPU":
            backends.append(CPUBackend(n_threads))
        elif name.startswith("RPC") and name[3:].isdigit():
            i = int(name[3:])
            if i >= len(endpoints):
                raise PyllamaError(f"--device {name}: there are {len(endpoints)} --rpc endpoints")
            from .backend.rpc import RPCBackend  # noqa: PLC0415 - only when RPC is used
            from .rpc.auth import read_token  # noqa: PLC0415
            from .rpc.connection import get_connection, set_timeout, set_token  # noqa: PLC0415
            set_token(read_token(token_file, "--rpc-token-file"))
            set_timeout(rpc_timeout)
            backends.append(RPCBackend(get_connection(endpoints[i]), 0, name))
        elif name.startswith("CUDA"):
            # PyCUDA is imported only when a CUDA device is asked for; without PyCUDA, a driver, the
            # device or the built kernels this is one PyllamaError saying which
            from .backend.cuda import open_backend  # noqa: PLC0415
            backends.append(open_backend(name))
        else:
            raise PyllamaError(f"--device: unknown device '{name}' (expected CPU, CUDA<i>, RPC<i>)")
    if split_mode == "none":
        backends = backends[:1]
    return backends


def default_split(backends: Sequence[Backend]) -> list[float]:
    """Layer proportions by each device's free memory, as llama.cpp does without --tensor-split."""
    free = [max(b.device_info().free, 1) for b in backends]
    return [f / sum(free) for f in free]
