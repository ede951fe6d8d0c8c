"""Low-rank noise: a member's factors A (m×r) and B (n×r) of one weight matrix (EGGROLL: Sarkar et al.
2025, "Evolution Strategies at the Hyperscale", arXiv 2511.16652).

Member i perturbs each selected weight matrix W (m×n, a linear layer's `weight`, out × in) by

    σ·signᵢ·Aᵢ·Bᵢᵀ/√r,   Aᵢ = ε(seedᵢ, name + ":A", (m, r)),   Bᵢ = ε(seedᵢ, name + ":B", (n, r))

where ε is the full-rank scheme's counter-based noise (`vrl.weights.noise`): each factor *is* the
noise of a virtual m×r (n×r) tensor, so factors are device-independent and replay from seeds. Each
element of Aᵢ·Bᵢᵀ/√r has mean 0 and variance 1, like a full-rank ε. With a = ε_A/C and b = ε_B/C
the integer noise (|a|, |b| ≤ 510), a perturbation is ``s·a·bᵀ`` with ``s = sign·round14(σ·C²/√r)``
(`perturbation_scale`), exact in fp32 (`vrl.weights.exact`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from vrl.weights import noise as nz
from vrl.weights.exact import check_rank


@functools.lru_cache(maxsize=4096)
def factor_words(name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """Name words of a matrix's two factors: the noise of virtual tensors `name:A` and `name:B`."""
    return nz.name_words(f"{name}:A"), nz.name_words(f"{name}:B")


def factor_keys(seed: int, name: str) -> tuple[int, int, int, int]:
    """(k1, k2) of factor A then of factor B, for one member seed and one matrix."""
    wa, wb = factor_words(name)
    return (*nz.tensor_keys(seed, wa), *nz.tensor_keys(seed, wb))


def factor_keys_many(seeds: Sequence[int], names: Sequence[str]) -> torch.Tensor:
    """`factor_keys` of every (matrix, seed) pair, int64 (len(names)·len(seeds), 4): row i·len(seeds) + j
    holds (k1, k2) of A then of B for matrix names[i] and seeds[j]."""
    words = [w for name in names for w in factor_words(name)]  # A's words, then B's, per name
    keys = nz.tensor_keys_many(seeds, words).view(len(names), 2, len(seeds), 2)  # name, factor, seed, k
    return keys.permute(0, 2, 1, 3).reshape(len(names) * len(seeds), 4)


def factors_int(
    seed: int, name: str, shape: Sequence[int], rank: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer factors a (m×r) and b (n×r), int32 in [-510, 510]: a pure function of (seed, name, shape, r)."""
    a, b = factors_int_many([seed], name, shape, rank, device)
    return a[0], b[0]


def factors_int_many(
    seeds: Sequence[int], name: str, shape: Sequence[int], rank: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`factors_int` of several members at once: a (T×m×r) and b (T×n×r), generated in one pass."""
    check_rank(rank)
    return factors_int_of_keys(factor_keys_many(seeds, [name]), shape, rank, device)


def factors_int_of_keys(
    keys: torch.Tensor, shape: Sequence[int], rank: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer factors a (T×m×r), b (T×n×r) of T rows of factor keys (`factor_keys_many`) of matrices of
    one shape; the keys reach the device in one copy."""
    m, n = shape
    keys = keys.to(device).view(-1, 4, 1)
    a = nz.noise_int((keys[:, 0], keys[:, 1]), 0, m * rank, device).view(len(keys), m, rank)
    b = nz.noise_int((keys[:, 2], keys[:, 3]), 0, n * rank, device).view(len(keys), n, rank)
    return a, b


def factors(
    seed: int, name: str, shape: Sequence[int], rank: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's A (m×r) and B (n×r): unit-variance fp32 noise, A = C·a, B = C·b (exact)."""
    a, b = factors_int(seed, name, shape, rank, device)
    return a.to(torch.float32) * nz.C, b.to(torch.float32) * nz.C


def perturbation_scale(sigma: float, rank: int) -> float:
    """s with σ·A·Bᵀ/√r = s·a·bᵀ, rounded to 14 significant bits (exact in fp32)."""
    check_rank(rank)
    return nz.round_sig(sigma * nz.C * nz.C / math.sqrt(rank), nz.SCALE_BITS)
