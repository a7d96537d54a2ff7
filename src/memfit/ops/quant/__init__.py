"""Weight quantization: 4-bit NormalFloat with double-quantized scales, int8 per row, and int4
in groups of input features (asymmetric)."""

from memfit.ops.quant.int4 import (
    INT4_GROUP,
    dequantize_int4,
    int4_grid,
    int4_group,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from memfit.ops.quant.nf4 import (
    NF4_BLOCK,
    dequantize_int8,
    dequantize_nf4,
    nf4_code,
    quantize_int8,
    quantize_nf4,
)

__all__ = [
    "INT4_GROUP",
    "dequantize_int4",
    "int4_grid",
    "int4_group",
    "pack_int4",
    "quantize_int4",
    "unpack_int4",
    "NF4_BLOCK",
    "dequantize_int8",
    "dequantize_nf4",
    "nf4_code",
    "quantize_int8",
    "quantize_nf4",
]
