"""float32 -> bfloat16 rounding to nearest even in NumPy, as compiled Triton and torch round
(the Triton interpreter truncates; conftest.gpu_bf16_rounding patches it with this)."""
import numpy as np


def rtne_bf16(data: np.ndarray) -> np.ndarray:
    bits = np.asarray(data, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(data), np.uint16(0x7FC0), rounded)
