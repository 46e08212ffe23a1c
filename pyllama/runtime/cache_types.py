"""The types a KV cache may be stored in, under llama.cpp's names (`-ctk` / `-ctv`).

F16 is the default, as in llama.cpp. A token's k and v are rounded into the cache type when they
are written (the block types q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl: blocks of 32 with an F16 scale, so
a row must be a whole number of blocks; rounded as ggml's CPU backend rounds them) and converted back
when attention reads them; see `_fast/ops.pyx` for the arithmetic.
"""
from __future__ import annotations

from typing import Union

from gguf import GGML_QUANT_SIZES

from ..util.errors import PyllamaError
from ..ir.tensor import DType

CACHE_TYPES: dict[str, DType] = {"f32": DType.F32, "f16": DType.F16, "bf16": DType.BF16, "q8_0": DType.Q8_0,
                                 "q4_0": DType.Q4_0, "q4_1": DType.Q4_1, "q5_0": DType.Q5_0, "q5_1": DType.Q5_1,
                                 "iq4_nl": DType.IQ4_NL}
DEFAULT_CACHE_TYPE = "f16"

__all__ = ["CACHE_TYPES", "DEFAULT_CACHE_TYPE", "cache_type", "cache_type_name", "check_cache_row"]


def cache_type(value: Union[str, DType, int]) -> DType:
    """A cache type from its name ("f16") or its DType; PyllamaError for anything else."""
    if isinstance(value, str):
        dt = CACHE_TYPES.get(value.strip().lower())
        if dt is None:
            raise PyllamaError(f"KV cache type {value!r}: must be one of {', '.join(CACHE_TYPES)}")
        return dt
    dt = DType(value)
    if dt not in CACHE_TYPES.values():
        raise PyllamaError(f"a KV cache cannot be stored as {dt.name} (only {', '.join(CACHE_TYPES)})")
    return dt


def cache_type_name(dtype: DType) -> str:
    """The -ctk / -ctv name of a cache type ("q8_0")."""
    return dtype.name.lower()


def check_cache_row(dtype: DType, width: int, which: str) -> None:
    """Refuses a cache type whose blocks do not tile a row of `width` elements (`which`: "K"/"V")."""
    block = GGML_QUANT_SIZES[dtype][0]
    if width % block:
        flag = "-ctk" if which == "K" else "-ctv"
        raise PyllamaError(f"{flag} {cache_type_name(dtype)}: a {cache_type_name(dtype)} {which} cache stores rows "
                           f"in blocks of {block}, but this model's K/V rows have {width} elements; use f16 or f32")
