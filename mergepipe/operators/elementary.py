"""exp, log and softmax of fp64 tensors with the same bits on every CPU.

torch's vectorized exp and log come from different code per kernel set (SLEEF's for AVX2,
AVX-512 and NEON, the C library's for the plain kernels), each within an ulp or so of the truth
but not equal to one another. Here they are computed in fp64 from IEEE additions,
multiplications and divisions alone (range reduction by powers of two, then a fixed
polynomial, each step a separate elementwise operation so that nothing is fused), accurate to
about an fp64 ulp; callers round the result once to their dtype. They work a slab of SLAB
elements at a time, so the fp64 temporaries stay small.
"""

from __future__ import annotations

import math

from mergepipe import torch
from mergepipe.operators.reductions import sum_last

SLAB = 1 << 20

# fdlibm's split of ln 2: k * LN2_HI is exact for |k| < 2**20.
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.4426950408889634  # 1 / ln 2, rounded to fp64
EXP_TERMS = tuple(1.0 / math.factorial(n) for n in range(14))  # |r| <= ln2/2: error below 1e-17
LOG_TERMS = tuple(1.0 / (2 * n + 1) for n in range(1, 11))  # 1/3 ... 1/21, for |s| <= 0.172
EXP_MAX, EXP_MIN = 709.78, -745.2
_MANTISSA = (1 << 52) - 1


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k for integer-valued fp64 k in [-1022, 1023], from its bits."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """exp of an fp64 tensor, in fp64."""
    y = x.clamp(EXP_MIN, EXP_MAX)
    k = torch.round(y * INV_LN2)
    r = (y - k * LN2_HI) - k * LN2_LO
    p = torch.full_like(r, EXP_TERMS[-1])
    for c in reversed(EXP_TERMS[:-1]):
        p = p * r + c
    half = torch.floor(k * 0.5)  # two factors, each a normal power of two, reach subnormals
    p = p * _pow2(half) * _pow2(k - half)
    p = torch.where(x > EXP_MAX, math.inf, p)
    p = torch.where(x < EXP_MIN, 0.0, p)
    return torch.where(torch.isnan(x), x, p)


def log64(x: torch.Tensor) -> torch.Tensor:
    """Natural log of an fp64 tensor, in fp64 (-inf at 0, NaN below 0)."""
    tiny = x < 2.0**-1022
    y = torch.where(tiny, x * 2.0**54, x)
    bits = y.view(torch.int64)
    e = ((bits >> 52) & 0x7FF).to(torch.float64) - torch.where(tiny, 1023.0 + 54.0, 1023.0)
    m = ((bits & _MANTISSA) | (1023 << 52)).view(torch.float64)  # in [1, 2)
    high = m > math.sqrt(2.0)
    m = torch.where(high, m * 0.5, m)
    e = e + high.to(torch.float64)
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    q = torch.full_like(z, LOG_TERMS[-1])
    for c in reversed(LOG_TERMS[:-1]):
        q = q * z + c
    log_m = 2.0 * s + 2.0 * s * (z * q)
    out = e * LN2_HI + (e * LN2_LO + log_m)
    out = torch.where(x == 0, -math.inf, out)
    out = torch.where(x == math.inf, math.inf, out)
    return torch.where((x < 0) | torch.isnan(x), math.nan, out)


def softmax64(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of an fp64 tensor, in fp64: exp(x - max) over its sum (summed as
    sum_last sums)."""
    e = exp64(x - x.amax(dim=-1, keepdim=True))
    return e / sum_last(e)
