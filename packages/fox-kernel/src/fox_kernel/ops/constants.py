"""Constants shared by the host code and the Triton and Gluon kernels.

The numbers the kernels read are ``tl.constexpr`` (Triton kernels may read no other globals; Gluon shares
the type); host code takes their ``.value``.
"""

from __future__ import annotations

import triton.language as tl

from fox_kernel.options import FixedRows

LOG2E = tl.constexpr(1.4426950408889634)
"""log2(e): the kernels keep scores and the bias in log2 units and exponentiate with exp2."""
LN2 = tl.constexpr(0.6931471805599453)
"""ln(2), back from log2 units to natural ones (the log-sum-exp)."""

FIXED_BOUND_GAP = 80.0
"""How far (log2 units) below a fixed softmax bound every row's largest term may lie: terms 2^-GAP below
the bound stay 2^(126 - GAP) above float32's smallest normal numbers."""

# FixedRows for the kernels (a kernel may not read an enum's attributes)
BOUND_PER_TILE = tl.constexpr(FixedRows.TILE)
BOUND_PER_ROW = tl.constexpr(FixedRows.ROW)
BOUND_PER_TILE_OR_ROW = tl.constexpr(FixedRows.TILE_OR_ROW)
