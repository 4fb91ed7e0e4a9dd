"""Pure FP8 math: in-place quantize / dequantize and error bounds (no engine, no refit)."""
from hybridrl.quant.fp8 import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    abs_error_bound,
    block_scale_shape,
    dequantize_,
    quantize_,
)

__all__ = [
    "BLOCK", "FP8_DTYPE", "FP8_MAX", "abs_error_bound", "block_scale_shape",
    "dequantize_", "quantize_",
]
