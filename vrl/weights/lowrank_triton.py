"""Triton kernels of the low-rank view: a member's perturbation and the update, bit-equal to the
reference kernels of `vrl.weights.lowrank_kernels`.

Each program owns a BM×BN tile of one matrix and regenerates the integer factors it needs from the
counter-based hash (the same `_noise` as the full-rank kernels): column k of a (rows of the tile)
and of b (columns of the tile), accumulated as outer products in int32 (one member: |P| ≤ r·510² <
2²⁴) and, for the update, multiplied by the member's integer weight into an int64 accumulator
(bounded below 2⁶² by `vrl.weights.exact.check_bound`). Integer sums do not depend on order, so the only
roundings are the int → fp32 conversion (round to nearest even, as torch does on CPU), one multiply
and one add; the kernels are launched with ``enable_fp_fusion=False`` so Triton never contracts that
multiply and add into an FMA (which would round once instead of twice, as the CPU reference does).

One launch per matrix; the matrices may be any contiguous tensors on the device (the hf flat buffers
or rows of a vLLM engine's fused weights). The update kernel serves sums past 2⁵³ only
(`lowrank_kernels.update_triton`): below, `lowrank_kernels.update_batched`'s float64 matmuls give the same bits 2.6×
faster (0.10 s against 0.26 s for 30 members of a 1.5 B model on an H100), since this kernel
regenerates every factor in every tile for every term.

The kernel that writes members into a vLLM engine's LoRA slots is the vLLM host's
(`vrl.generate.vllm_lora_triton`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from vrl.weights.flat_triton import _noise

BM, BN = 32, 64


@triton.jit
def _member_product(keys_ptr, t, rows, cols, RANK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """P = a[rows]·b[cols]ᵀ of term t (int32, exact), a and b regenerated from the term's four keys."""
    k1a = tl.load(keys_ptr + 4 * t).to(tl.uint32)
    k2a = tl.load(keys_ptr + 4 * t + 1).to(tl.uint32)
    k1b = tl.load(keys_ptr + 4 * t + 2).to(tl.uint32)
    k2b = tl.load(keys_ptr + 4 * t + 3).to(tl.uint32)
    p = tl.zeros([BM, BN], dtype=tl.int32)
    for k in range(RANK):
        # Element (i, k) of an m×r factor has row-major index i·r + k (< 2³², checked by the caller).
        a = _noise((rows * RANK + k).to(tl.uint32), k1a, k2a).to(tl.int32)
        b = _noise((cols * RANK + k).to(tl.uint32), k1b, k2b).to(tl.int32)
        p += a[:, None] * b[None, :]
    return p


@triton.jit
def _tile(m, n, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    mask = (rows < m)[:, None] & (cols < n)[None, :]
    return rows, cols, rows[:, None] * n + cols[None, :], mask


@triton.jit
def _perturb_kernel(master_ptr, weight_ptr, keys_ptr, scale, m, n, RANK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows, cols, offs, mask = _tile(m, n, BM, BN)
    p = _member_product(keys_ptr, 0, rows, cols, RANK, BM, BN)
    w = tl.load(master_ptr + offs, mask=mask, other=0.0) + p.to(tl.float32) * scale
    tl.store(weight_ptr + offs, w.to(weight_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _update_kernel(
    master_ptr, weight_ptr, keys_ptr, mults_ptr, n_terms, coeff, m, n,
    RANK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    rows, cols, offs, mask = _tile(m, n, BM, BN)
    acc = tl.zeros([BM, BN], dtype=tl.int64)
    for t in range(n_terms):
        p = _member_product(keys_ptr, t, rows, cols, RANK, BM, BN)
        acc += p.to(tl.int64) * tl.load(mults_ptr + t)
    theta = tl.load(master_ptr + offs, mask=mask, other=0.0) + acc.to(tl.float32) * coeff
    tl.store(master_ptr + offs, theta, mask=mask)
    tl.store(weight_ptr + offs, theta.to(weight_ptr.dtype.element_ty), mask=mask)


def _check(master: torch.Tensor, weight: torch.Tensor, rank: int) -> tuple[int, int]:
    if master.dim() != 2 or master.shape != weight.shape or master.dtype != torch.float32:
        raise ValueError("low-rank kernels need an fp32 2-D master and a weight of the same shape")
    if not (master.is_contiguous() and weight.is_contiguous()):
        raise ValueError("low-rank kernels need contiguous master and weight")
    m, n = master.shape
    if max(m, n) * rank >= 2**32:
        raise ValueError(f"a {m}×{n} matrix at rank {rank} has factor indices beyond 2**32")
    return m, n


def perturb(master: torch.Tensor, weight: torch.Tensor, keys: Sequence[int], scale: float, rank: int) -> None:
    """weight = cast(master + fp32(scale·P)) for one member (`keys` = its four factor keys)."""
    m, n = _check(master, weight, rank)
    keys_t = torch.tensor(list(keys), dtype=torch.int64, device=master.device)
    grid = (triton.cdiv(m, BM), triton.cdiv(n, BN))
    _perturb_kernel[grid](master, weight, keys_t, scale, m, n, RANK=rank, BM=BM, BN=BN, num_warps=4, enable_fp_fusion=False)


def update(
    master: torch.Tensor, weight: torch.Tensor, keys: Sequence[Sequence[int]] | torch.Tensor,
    mults: Sequence[int] | torch.Tensor, coeff: float, rank: int,
) -> None:
    """master += fp32(fp32(Σₜ multₜ·Pₜ)·coeff); weight = cast(master), in one launch.

    `keys` (T×4) and `mults` (T) may already be int64 tensors on the device (no copy then)."""
    m, n = _check(master, weight, rank)
    keys_t = torch.as_tensor(keys, dtype=torch.int64).to(master.device).contiguous()
    mults_t = torch.as_tensor(mults, dtype=torch.int64).to(master.device).contiguous()
    grid = (triton.cdiv(m, BM), triton.cdiv(n, BN))
    _update_kernel[grid](
        master, weight, keys_t, mults_t, len(mults), coeff, m, n, RANK=rank, BM=BM, BN=BN, num_warps=4, enable_fp_fusion=False,
    )
