"""Low-rank ES members as a vLLM engine's LoRA adapters: each member's factors, ready for a LoRA slot.

Member (seed, sign) of matrix W (m×n) with integer factors a (m×r), b (n×r) (`vrl.weights.factors`)
becomes

    lora_a = C·bᵀ          (r×n; exact in fp32)
    lora_b = t·a           (m×r; t = sign·round14(σ·C/√r), exact in fp32)

so lora_b·lora_a = σ·sign·A·Bᵀ/√r up to C·round14(σ·C/√r) vs round14(σ·C²/√r) (< 2⁻¹⁴ relative).
Both factors are O(1) and O(σ), so a 16-bit LoRA dtype holds them to its own precision. The
engine's workers write them into the slots (`vrl.generate.vllm_slots.LowRankEngine`): on a GPU with
one Triton launch per matrix shape (`vrl.generate.vllm_lora_triton.lora_slots`, the same bits),
elsewhere with `lora_factors_many`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vrl.weights import noise as nz
from vrl.weights.exact import check_rank
from vrl.weights.factors import factor_keys_many, factors_int_of_keys


def lora_scales(members: Sequence[tuple[int, int]], rank: int, sigma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Each member's lora_b scale sign·round14(σ·C/√r), fp32 (exact): what multiplies its integer factor a."""
    check_rank(rank)
    t = nz.round_sig(sigma * nz.C / math.sqrt(rank), nz.SCALE_BITS)
    return torch.tensor([sign * t for _, sign in members], dtype=torch.float32, device=device)


def lora_factors(
    members: Sequence[tuple[int, int]], name: str, shape: Sequence[int], rank: int, sigma: float,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Members (seed, sign) of matrix `name` as LoRA factors, exact in fp32: lora_a (N×r×n) = C·bᵀ and
    lora_b (N×m×r) = t·a (see the module docstring)."""
    lora_a, lora_b = lora_factors_many(members, [name], shape, rank, sigma, device)
    return lora_a[0], lora_b[0]


def lora_factors_many(
    members: Sequence[tuple[int, int]], names: Sequence[str], shape: Sequence[int], rank: int, sigma: float,
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lora_factors` of several matrices of one shape at once, cast to `dtype` (one rounding from the
    exact fp32 values): lora_a (G×N×r×n), lora_b (G×N×m×r) for G names and N members: one noise pass
    and one upload of keys for all of them. The reference for `vllm_lora_triton.lora_slots`, which a
    vLLM engine on a GPU uses instead (`LowRankEngine.load_members`)."""
    m, n = shape
    check_rank(rank)
    keys = factor_keys_many([seed for seed, _ in members], names)
    a, b = factors_int_of_keys(keys, shape, rank, device)
    scale = lora_scales(members, rank, sigma, device).repeat(len(names))
    lora_a = (b.to(torch.float32) * nz.C).to(dtype).transpose(1, 2)
    lora_b = (a.to(torch.float32) * scale[:, None, None]).to(dtype)
    g, k = len(names), len(members)
    return lora_a.reshape(g, k, rank, n), lora_b.reshape(g, k, m, rank)
