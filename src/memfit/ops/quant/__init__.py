"""Weight quantization: 4-bit NormalFloat with double-quantized scales, and int8 per row."""

from memfit.ops.quant.nf4 import (
    NF4_BLOCK,
    dequantize_int8,
    dequantize_nf4,
    nf4_code,
    quantize_int8,
    quantize_nf4,
)

__all__ = [
    "NF4_BLOCK",
    "dequantize_int8",
    "dequantize_nf4",
    "nf4_code",
    "quantize_int8",
    "quantize_nf4",
]
