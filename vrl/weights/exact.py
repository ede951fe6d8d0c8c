"""The bounds that keep low-rank ES arithmetic exact: every one is checked before it could be broken.

With integer factors a (m×r) and b (n×r) of the counter-based noise (|a|, |b| ≤ 510,
`vrl.weights.noise`) a member's product P = a·bᵀ is an integer matrix with |P| ≤ r·510²; the
update sums integer multiples of such products. These bounds say where each sum stays exact:

* `MAX_RANK`: r·510² < 2²⁴, so P is exact in fp32 (and in any fp32 matmul);
* `Z_SCALE`: member weights z are stored with 4 decimals (`vrl.optim.es.Z_DECIMALS`), so
  Z = round(z·10⁴) is an exact integer multiplier;
* `F64_EXACT`: below 2⁵³ every partial sum is an exact float64 integer, in any order (the fast
  float64 matmul path);
* `UPDATE_BOUND`: below 2⁶² every int64 partial sum, in any order, is safe (`check_bound`
  refuses an update past it). In practice Σᵢ|zᵢ| ≤ N (z-scores have Σz² = N; Cauchy-Schwarz), so
  at r = 8 the bound holds up to N ≈ 2·10⁸ members.
"""

from __future__ import annotations

from collections.abc import Sequence

from vrl.weights.noise import BYTE_SUM_OFFSET

MAX_RANK = 64  # r·510² < 2²⁴: a member's product P is exact in fp32 (and in any fp32 matmul)
Z_SCALE = 10**4  # z is stored with 4 decimals (`vrl.optim.es.Z_DECIMALS`): Z = round(z·10⁴) is exact
PRODUCT_MAX = BYTE_SUM_OFFSET**2  # |a·b| ≤ 510²
UPDATE_BOUND = 2**62
F64_EXACT = 2**53  # below this, integer sums are exact in float64 too (the fast path)


def check_rank(rank: int) -> None:
    """Refuse a rank whose member products would not be exact in fp32."""
    if not 1 <= rank <= MAX_RANK:
        raise ValueError(f"low-rank ES needs 1 <= rank <= {MAX_RANK}, got {rank}")


def sum_bound(mults: Sequence[int], rank: int) -> int:
    """Σ|multₜ|·r·510²: no partial sum of Σₜ multₜ·aₜ·bₜᵀ, in any order, can reach it."""
    return sum(abs(w) for w in mults) * rank * PRODUCT_MAX


def exact_in_float64(mults: Sequence[int], rank: int) -> bool:
    """Whether every partial sum is an exact float64 integer, so float64 matmuls (any order) give the exact sum."""
    return sum_bound(mults, rank) < F64_EXACT


def check_bound(terms: Sequence[tuple[int, int]], rank: int) -> None:
    """Refuse an update whose exact integer sum could leave int64's safe range (see `UPDATE_BOUND`)."""
    bound = sum_bound([w for _, w in terms], rank)
    if bound >= UPDATE_BOUND:
        raise ValueError(
            f"low-rank ES update too large for exact int64 accumulation (Σ|Z|·r·510² = {bound:.3g} ≥ 2^62); "
            "use fewer members or a lower es.rank"
        )
