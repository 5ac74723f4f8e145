"""One key tile of flash attention's online softmax, shared by the prefill kernels (paged,
MLA absorbed and MLA expanded): base 2, the scale folded in, masked tiles apart from whole ones.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_tile(s, seen, m_i, l_i, qk_scale, MASKED: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    """Raw scores s [M, N] of a key tile against the running max m_i and sum l_i [M]:
    (p [M, N], alpha [M] to rescale the accumulator by, the new max, the new sum). MASKED:
    keys where `seen` is false count as -inf (seen is not read otherwise). EMPTY_ROWS: a row
    may have seen no key yet; its max stays -inf and it subtracts 0, so exp2 gives 0, not NaN.
    """
    if MASKED:
        s = tl.where(seen, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
        if EMPTY_ROWS:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s - m_ref[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_ref = m_new
        s = s * qk_scale - m_new[:, None]
    p = tl.math.exp2(s)
    alpha = tl.math.exp2(m_i - m_ref)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)
