"""Devices from the command line: `--device` (ordered, e.g. RPC0,CPU), `--rpc host:port,...`,
`-sm layer|none`, `--tensor-split a,b,...`, `-ngl N` and `-mg I`, as llama.cpp names them."""
from __future__ import annotations

import logging
from typing import Optional, Sequence

from ...backend.base import Backend
from ...backend.cpu import CPUBackend
from ...util.errors import PyllamaError
from ...util.settings import Settings
from ...util.settings import current as current_settings

log = logging.getLogger("pyllama.runtime.placement.devices")


def gpu_layers(text: str) -> int:
    """-ngl's value: a number of layers, 'all' or 'auto' (-1: pyllama's own split)."""
    t = text.strip().lower()
    if t == "auto":
        return -1
    if t == "all":
        return ALL_LAYERS
    n = int(t)
    if n < -1:
        raise ValueError(f"{text}: must be a number of layers, -1, 'auto' or 'all'")
    return n


ALL_LAYERS = 1 << 30


def add_device_args(p) -> None:
    p.add_argument("--rpc", llama_env="LLAMA_ARG_RPC",
                   help="comma-separated rpc server endpoints host:port (pyllama's rpc_server or llama.cpp's "
                        "rpc-server); their devices are RPC0, RPC1, ... in order (a llama.cpp rpc-server "
                        "may have several)")
    p.add_argument("-dev", "--device", llama_env="LLAMA_ARG_DEVICE",
                   help="comma-separated devices in layer order, e.g. RPC0,CPU or CUDA0,RPC0 "
                        "(default: every RPC device, then CPU); the last holds the output layer; none = CPU only")
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", type=gpu_layers, default=-1,
                   metavar="N", llama_env="LLAMA_ARG_N_GPU_LAYERS",
                   help="layers on the non-CPU devices, counted as llama.cpp does: the output layer first, then "
                        "the last blocks; the CPU keeps the rest (a number, 'all', or 'auto' = by free memory, "
                        "-ts proportions)")
    p.add_argument("-sm", "--split-mode", default="layer", choices=["layer", "none", "row", "tensor"],
                   llama_env="LLAMA_ARG_SPLIT_MODE",
                   help="layer: split the layers over the devices; none: everything on one device (-mg); "
                        "row and tensor are not supported")
    p.add_argument("-ts", "--tensor-split", llama_env="LLAMA_ARG_TENSOR_SPLIT",
                   help="comma-separated proportions of layers per device (with -ngl: per non-CPU device) "
                        "(default: by free memory; with pipeline groups the server then checks its split against "
                        "the load every minute, $PYLLAMA_SPLIT_CHECK_S, and moves blocks to even out the stages)")
    p.add_argument("-mg", "--main-gpu", type=int, default=0, metavar="INDEX", llama_env="LLAMA_ARG_MAIN_GPU",
                   help="with -sm none: the non-CPU device (0 = the first) that holds the whole model")
    p.add_argument("--list-devices", action="store_true", llama_env=None,
                   help="print the devices layers can go to besides the CPU (each --rpc server's, CUDA GPUs) "
                        "with their memory, and exit")
    p.add_argument("--rpc-token-file", metavar="PATH",
                   help="token the rpc servers require (first line of the file; also $PYLLAMA_RPC_TOKEN)")
    p.add_argument("--rpc-timeout", type=float, metavar="SECONDS",
                   help="how long to wait on an rpc server (a whole send, or the next bytes of a reply) before the "
                        "requests it serves fail and it counts as lost; set it above the longest step "
                        "(default: $PYLLAMA_RPC_TIMEOUT, else 120)")


def device_names(device: Optional[str], rpc: Optional[str],
                 rpc_map: Optional[Sequence[tuple[str, int]]] = None) -> list[str]:
    """The device names in layer order: --device's (none = CPU), else every RPC device (one per
    endpoint, or those of `rpc_map`), then CPU."""
    n_rpc = len([e for e in rpc.split(",") if e.strip()]) if rpc else 0
    if rpc_map is not None:
        n_rpc = len(rpc_map)
    if device and device.strip().lower() == "none":
        return ["CPU"]
    if device:
        return [d.strip().upper() for d in device.split(",") if d.strip()]
    return [f"RPC{i}" for i in range(n_rpc)] + ["CPU"]


def rpc_devices(rpc: Optional[str], token_file: Optional[str] = None,
                rpc_timeout: Optional[float] = None) -> list[tuple[str, int]]:
    """(endpoint, device) of RPC0, RPC1, ... as llama.cpp numbers them: each endpoint's devices in
    turn, one for a pyllama rpc server, every device of a llama.cpp rpc-server. Asks each endpoint
    once (its kind, and a llama.cpp rpc-server its device count), proving the token of `token_file`
    (else $PYLLAMA_RPC_TOKEN) to servers that require one."""
    endpoints = [e.strip() for e in rpc.split(",") if e.strip()] if rpc else []
    if not endpoints:
        return []
    from ...backend.ggml.backend import ggml_connection  # noqa: PLC0415 - only when RPC is used
    from ...backend.ggml.connection import GGML, identify, known_kind  # noqa: PLC0415
    from ...rpc.auth import read_token  # noqa: PLC0415
    from ...rpc.connection import set_timeout, set_token  # noqa: PLC0415
    set_token(read_token(token_file, "--rpc-token-file"))
    set_timeout(rpc_timeout)
    out: list[tuple[str, int]] = []
    for ep in endpoints:
        if (known_kind(ep) or identify(ep)[0]) == GGML:
            out += [(ep, d) for d in range(ggml_connection(ep).device_count())]
        else:
            out.append((ep, 0))
    return out


def plan_devices(names: Sequence[str], n_layer: int, n_gpu_layers: int = -1, split_mode: str = "layer",
                 main_gpu: int = 0, tensor_split: Optional[str] = None) -> tuple[list[str], Optional[list[float]]]:
    """The devices in layer order and their layer proportions (None: by free memory), from
    llama-server's -ngl, -sm, -mg and -ts over the named devices.

    -ngl N, as llama.cpp counts: the output layer is offloaded first, then the blocks from the last
    one down, so N layers are the output layer plus the last N-1 blocks; they go to the non-CPU
    devices in order (by -ts, else evenly), the CPU keeps the first blocks. With no non-CPU device
    -ngl changes nothing (llama-server ignores it on a CPU build)."""
    if split_mode in ("row", "tensor"):
        raise PyllamaError(f"--split-mode {split_mode} is not supported (pyllama splits by layers: layer or none)")
    accel = [n for n in names if n != "CPU"]
    if split_mode == "none":
        if not accel:
            return ["CPU"], None
        if not 0 <= main_gpu < len(accel):
            raise PyllamaError(f"--main-gpu {main_gpu}: there are {len(accel)} non-CPU devices")
        if n_gpu_layers == 0:
            return ["CPU"], None
        return [accel[main_gpu]], None
    if n_gpu_layers < 0 or not accel:
        if n_gpu_layers >= 0:
            log.info("-ngl %d: there is no non-CPU device (--device/--rpc); every layer stays on the CPU",
                     n_gpu_layers)
        return list(names), parse_split(tensor_split, len(names))
    offloaded = min(n_gpu_layers, n_layer + 1)  # the output layer counts as one
    if offloaded == 0:
        return ["CPU"], None
    gpu_blocks = offloaded - 1
    cpu_blocks = n_layer - gpu_blocks
    shares = parse_split(tensor_split, len(accel)) or [1.0] * len(accel)
    total = sum(shares)
    counts = _apportion(gpu_blocks, [s / total for s in shares])
    if gpu_blocks == 0:
        counts = [0] * len(accel)  # only the output layer: on the last device
    out_names = (["CPU"] if cpu_blocks > 0 else []) + accel
    props = ([float(cpu_blocks)] if cpu_blocks > 0 else []) + [float(c) for c in counts]
    if sum(props) == 0:  # a model of no blocks
        props = [1.0] * len(out_names)
    return out_names, props


def _apportion(n: int, fractions: Sequence[float]) -> list[int]:
    """n items split by fractions into whole numbers that add up to n (largest remainders)."""
    raw = [n * f for f in fractions]
    counts = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - counts[i], reverse=True)[:n - sum(counts)]:
        counts[i] += 1
    return counts


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
                  token_file: Optional[str] = None, rpc_timeout: Optional[float] = None,
                  names: Optional[Sequence[str]] = None, settings: Optional[Settings] = None,
                  rpc_map: Optional[Sequence[tuple[str, int]]] = None) -> list[Backend]:
    """The backends in layer order, each configured by its part of `settings` (default: the
    process's). Connections to rpc servers are opened here (once per endpoint), proving the token of
    `token_file` (else $PYLLAMA_RPC_TOKEN) to servers that require one, with `rpc_timeout` seconds
    (else $PYLLAMA_RPC_TIMEOUT, else 120) as their timeout; `rpc_map`: rpc_devices' answer, when
    the caller asked already."""
    settings = settings if settings is not None else current_settings()
    names = list(names) if names is not None else device_names(device, rpc)
    if len(set(names)) != len(names):
        raise PyllamaError(f"--device '{device}' lists a device twice")
    if rpc_map is None and any(n.startswith("RPC") for n in names):
        rpc_map = rpc_devices(rpc, token_file, rpc_timeout)
    backends: list[Backend] = []
    try:
        for name in names:
            if name == "CPU":
                backends.append(CPUBackend(n_threads, settings=settings.cpu))
            elif name.startswith("RPC") and name[3:].isdigit():
                i = int(name[3:])
                if rpc_map is None or i >= len(rpc_map):
                    n = len(rpc_map or ())
                    raise PyllamaError(f"--device {name}: the --rpc servers have {n} device{'s' if n != 1 else ''}")
                backends.append(_rpc_device(*rpc_map[i], name, settings))
            elif name.startswith("CUDA"):
                # PyCUDA is imported only when a CUDA device is asked for; without PyCUDA, a driver, the
                # device or the built kernels this is one PyllamaError saying which
                from ...backend.cuda import open_backend  # noqa: PLC0415
                backends.append(open_backend(name))
            else:
                raise PyllamaError(f"--device: unknown device '{name}' (expected CPU, CUDA<i>, RPC<i>)")
    finally:
        if rpc_map:   # a llama.cpp rpc-server serves one client at a time: none is held for nothing
            from ...backend.ggml.backend import release_if_unused  # noqa: PLC0415
            for ep in {ep for ep, _ in rpc_map}:
                release_if_unused(ep)
    if split_mode == "none":
        backends = backends[:1]
    return backends


def _rpc_device(endpoint: str, device: int, name: str, settings: Settings) -> Backend:
    """Device `device` of the rpc server at `endpoint`, as `name`: a pyllama rpc server's (its one
    device), or a llama.cpp rpc-server's (the log says which)."""
    from ...backend.ggml.backend import GGMLBackend, ggml_connection  # noqa: PLC0415
    from ...backend.ggml.connection import GGML, known_kind  # noqa: PLC0415
    from ...backend.ggml.protocol import version_text  # noqa: PLC0415
    from ...backend.rpc import RPCBackend  # noqa: PLC0415 - only when RPC is used
    from ...rpc.connection import get_connection  # noqa: PLC0415
    if known_kind(endpoint) != GGML:
        return RPCBackend(get_connection(endpoint), 0, name, settings=settings.rpc)
    conn = ggml_connection(endpoint)
    n = conn.device_count()
    log.info("%s: %s is a llama.cpp rpc-server (ggml RPC protocol %s, %d device%s); %s is its device %d",
             name, endpoint, version_text(conn.version), n, "s" if n != 1 else "", name, device)
    return GGMLBackend(conn, device, name)


def list_devices(args) -> str:
    """--list-devices, as llama.cpp prints it: the devices besides the CPU (each --rpc server's,
    then the CUDA GPUs PyCUDA sees; none without PyCUDA or a driver), with total and free memory."""
    rpc_map = rpc_devices(args.rpc, args.rpc_token_file, args.rpc_timeout)
    names = [n for n in device_names(None, args.rpc, rpc_map) if n != "CPU"]
    try:
        from ...backend.cuda import CUDAUnavailable, device_count  # noqa: PLC0415
        names += [f"CUDA{i}" for i in range(device_count())]
    except CUDAUnavailable:
        pass
    lines = ["Available devices:"]
    for b in make_backends(None, args.rpc, "layer", 1, args.rpc_token_file, args.rpc_timeout, names=names,
                           rpc_map=rpc_map):
        info = b.device_info()
        lines.append(f"  {info.name}: {info.description} ({info.total // 2**20} MiB, {info.free // 2**20} MiB free)")
        b.close()
    return "\n".join(lines if len(lines) > 1 else lines + ["  (none)"])


def check_cpu_moe(names: Sequence[str], layer_backend: Sequence[int], is_moe: bool, n: int) -> None:
    """--cpu-moe (n: every layer) / --n-cpu-moe n: llama.cpp keeps those layers' experts on the CPU
    while the rest of the layer may go elsewhere. pyllama places whole layers, so this holds when
    the first n layers of a MoE model are on the CPU; a split that puts one elsewhere is refused,
    naming the layers and the device (a dense model has no experts: nothing to keep)."""
    if not is_moe or n <= 0:
        return
    away = _off_cpu(names, layer_backend[:n])
    if away:
        raise PyllamaError(f"--cpu-moe/--n-cpu-moe: layers {away[0][0]}-{away[-1][0]} are on {_devices(away)}; "
                           "pyllama keeps a layer's experts with the layer, so give those layers to the CPU "
                           "(-ts, -ngl) or leave the flag out")


def check_kv_offload(names: Sequence[str], layer_backend: Sequence[int], kv_offload: bool) -> None:
    """--no-kv-offload: llama.cpp keeps every layer's KV cache in host memory. pyllama keeps a
    layer's cache on the layer's device, so this holds when every layer is local (the CPU) and a
    split that gives layers to another device is refused, naming it."""
    if kv_offload:
        return
    away = _off_cpu(names, layer_backend)
    if away:
        raise PyllamaError(f"--no-kv-offload: layers are on {_devices(away)}, and pyllama keeps a layer's KV cache "
                           "on its device; leave the flag out or keep the layers on the CPU")


def _off_cpu(names: Sequence[str], layer_backend: Sequence[int]) -> list[tuple[int, str]]:
    """(layer, device) of the layers that are not on the local CPU, in layer order."""
    return [(il, names[b]) for il, b in enumerate(layer_backend) if names[b] != "CPU"]


def _devices(layers: Sequence[tuple[int, str]]) -> str:
    return ", ".join(sorted({d for _, d in layers}))


def default_split(backends: Sequence[Backend]) -> list[float]:
    """Layer proportions by each device's free memory, as llama.cpp does without --tensor-split."""
    free = [max(b.device_info().free, 1) for b in backends]
    return [f / sum(free) for f in free]


def open_devices(args, model_path: str) -> tuple[list[Backend], Optional[list[float]]]:
    """The backends in layer order and their layer proportions (None: by free memory) for a
    program's device flags (--device, --rpc, -ngl, -sm, -mg, -ts)."""
    rpc_map = rpc_devices(args.rpc, args.rpc_token_file, args.rpc_timeout) if args.rpc else None
    names = device_names(args.device, args.rpc, rpc_map)
    n_gpu_layers = getattr(args, "n_gpu_layers", -1)
    n_layer = 0
    if n_gpu_layers >= 0 and args.split_mode == "layer" and any(n != "CPU" for n in names):
        from ...models.gguf_file import GGUFFile  # noqa: PLC0415 - the layer count, before placing
        from ...models.hparams import read_hparams  # noqa: PLC0415
        n_layer = read_hparams(GGUFFile(model_path)).n_layer
    names, proportions = plan_devices(names, n_layer, n_gpu_layers, args.split_mode, getattr(args, "main_gpu", 0),
                                      args.tensor_split)
    backends = make_backends(args.device, args.rpc, "layer", args.threads, args.rpc_token_file, args.rpc_timeout,
                             names=names, rpc_map=rpc_map)
    return backends, proportions
