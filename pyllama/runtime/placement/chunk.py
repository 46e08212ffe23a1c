"""How many prompt tokens a pipeline group's step feeds while another group generates through the
same stages (--pipeline-chunk)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

# --pipeline-chunk's default for quantized weights on CPU devices (see pipeline_chunk)
QUANT_PIPELINE_CHUNK = 64


def pipeline_chunk(option: Optional[int], model: Any, backends: Sequence[Any]) -> int:
    """--pipeline-chunk's value: the option when given, else QUANT_PIPELINE_CHUNK for a model
    whose blocks are quantized on stages that compute small batches at full speed (a CPU's
    quantized products cost about as much per token at 16 rows as at 512: medium q4_k_m, one
    thread, 762 vs 868 tok/s), else 0 (F32 products cost 2.4x as much at 16 rows, 276 vs 673
    tok/s, and a GPU needs large batches)."""
    if option is not None:
        return option
    cheap = model.blocks_quantized() and all(b.small_batches_cheap for b in backends)
    return QUANT_PIPELINE_CHUNK if cheap else 0
