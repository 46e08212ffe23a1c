"""--check-tensors: every tensor's data checked for values that are not finite, as llama.cpp's
option does: every element of F32 / F16 / BF16 tensors, the scales (and minimums) of each block
of the quantized ones. It reads the whole file, so it is opt-in."""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
from gguf import GGMLQuantizationType as Q

from ..util.errors import ModelFileError
from .gguf_file import TensorInfo

# block bytes and the byte offsets of its F16 scales / minimums
_SCALES = {Q.Q4_0: (18, (0,)), Q.Q4_1: (20, (0, 2)), Q.Q5_0: (22, (0,)), Q.Q5_1: (24, (0, 2)),
           Q.Q8_0: (34, (0,)), Q.Q2_K: (84, (80, 82)), Q.Q3_K: (110, (108,)), Q.Q4_K: (144, (0, 2)),
           Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}


def bad_element(info: TensorInfo) -> Optional[int]:
    """The index of the first element (F32 / F16 / BF16) or block (quantized) holding a value that
    is not finite, or None. Tensors of other types are not checked."""
    raw = info.raw.reshape(-1)
    if info.qtype == Q.F32:
        bad = ~np.isfinite(raw[:raw.size // 4 * 4].view(np.float32))
    elif info.qtype == Q.F16:
        bad = ~np.isfinite(raw[:raw.size // 2 * 2].view(np.float16))
    elif info.qtype == Q.BF16:
        bad = (raw[:raw.size // 2 * 2].view(np.uint16) & 0x7F80) == 0x7F80  # exponent all ones: inf or NaN
    elif info.qtype in _SCALES:
        size, offsets = _SCALES[Q(info.qtype)]
        blocks = raw[:raw.size // size * size].reshape(-1, size)
        bad = np.zeros(len(blocks), dtype=bool)
        for off in offsets:
            bad |= ~np.isfinite(np.ascontiguousarray(blocks[:, off:off + 2]).view(np.float16).reshape(-1))
    else:
        return None
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else None


def check_tensors(path: str, infos: Iterable[TensorInfo]) -> int:
    """Raises ModelFileError naming the first tensor with a value that is not finite; returns how
    many tensors were checked."""
    n = 0
    for info in infos:
        at = bad_element(info)
        if at is not None:
            what = "element" if info.qtype in (Q.F32, Q.F16, Q.BF16) else "block"
            raise ModelFileError(f"{path}: tensor '{info.name}' has invalid data: a value that is not finite in "
                                 f"{what} {at} (--check-tensors)")
        n += 1
    return n
