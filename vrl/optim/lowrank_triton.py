"""Triton kernels for low-rank ES: a member's perturbation, the update and members' LoRA-slot factors,
bit-equal to `vrl.optim.lowrank`.

Each program owns a BM×BN tile of one matrix and regenerates the integer factors it needs from the
counter-based hash (the same `_noise` as the full-rank kernels): column k of a (rows of the tile)
and of b (columns of the tile), accumulated as outer products in int32 (one member: |P| ≤ r·510² <
2²⁴) and, for the update, multiplied by the member's integer weight into an int64 accumulator
(bounded below 2⁶² by `lowrank.check_bound`). Integer sums do not depend on order, so the only
roundings are the int → fp32 conversion (round to nearest even, as torch does on CPU), one multiply
and one add; the kernels are launched with ``enable_fp_fusion=False`` so Triton never contracts that
multiply and add into an FMA (which would round once instead of twice, as the CPU reference does).

One launch per matrix; the matrices may be any contiguous tensors on the device (the hf flat buffers
or rows of a vLLM engine's fused weights). The update kernel serves sums past 2⁵³ only
(`lowrank.update_triton`): below, `lowrank.update_batched`'s float64 matmuls give the same bits 2.6×
faster (0.10 s against 0.26 s for 30 members of a 1.5 B model on an H100), since this kernel
regenerates every factor in every tile for every term.

Members' LoRA-slot factors (`lora_slots`): one launch per matrix shape writes every member of a
sampling call into its slot of every matrix of that shape (each value exact in fp32; the one rounding
is the cast to the slot dtype, to nearest even as torch does). On an H100 this took the 30 members
of a 1.5B model from 0.14 s (torch ops, chunked) to 0.05 s per call; 0.37 s a matrix at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from vrl.optim.es_triton import _noise

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


LORA_BLOCK = 2048


@triton.jit
def _lora_slots_kernel(
    a_ptrs, b_ptrs, ref_ptr, keys_ptr, scales_ptr, slots_ptr, n_members, m, n, c,
    MAXR: tl.constexpr, RANK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (g·N + p, j): block j of member p's two slot matrices of matrix g of one shape.

    lora_a slot (MAXR×n): row q < RANK is C·b[:, q], the rest zero; lora_b slot (m×MAXR): column
    q < RANK is scale_p·a[:, q], the rest zero. Each value is exact in fp32 (a 13- or 14-bit scale
    times a 10-bit integer), so the one rounding is the cast to the slot's dtype (to nearest even).
    """
    gp = tl.program_id(0)
    g, p = gp // n_members, gp % n_members
    slot = tl.load(slots_ptr + p).to(tl.int64)
    k1a = tl.load(keys_ptr + 4 * gp).to(tl.uint32)
    k2a = tl.load(keys_ptr + 4 * gp + 1).to(tl.uint32)
    k1b = tl.load(keys_ptr + 4 * gp + 2).to(tl.uint32)
    k2b = tl.load(keys_ptr + 4 * gp + 3).to(tl.uint32)
    scale = tl.load(scales_ptr + p)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    out_ty = ref_ptr.dtype.element_ty

    q, col = offs // n, offs % n  # lora_a element (q, col) = C·b[col, q]
    a_slot = tl.load(a_ptrs + g).to(tl.pointer_type(out_ty)) + slot * (MAXR * n)
    va = _noise((col * RANK + q).to(tl.uint32), k1b, k2b) * c
    tl.store(a_slot + offs, tl.where(q < RANK, va, 0.0).to(out_ty), mask=offs < MAXR * n)

    row, q = offs // MAXR, offs % MAXR  # lora_b element (row, q) = scale·a[row, q]
    b_slot = tl.load(b_ptrs + g).to(tl.pointer_type(out_ty)) + slot * (m * MAXR)
    vb = _noise((row * RANK + q).to(tl.uint32), k1a, k2a) * scale
    tl.store(b_slot + offs, tl.where(q < RANK, vb, 0.0).to(out_ty), mask=offs < m * MAXR)


def lora_slots(
    a_stacks: torch.Tensor, b_stacks: torch.Tensor, ref: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor,
    slots: torch.Tensor, shape: tuple[int, int], max_rank: int, rank: int, c: float,
) -> None:
    """Write members into LoRA slots of G matrices of one shape (m, n), in one launch.

    `a_stacks`, `b_stacks`: int64 data pointers of the G contiguous lora_a (S×1×max_rank×n) and lora_b
    (S×1×m×max_rank) stacks; `ref`: a tensor of the stacks' dtype; `keys` (G·N×4, int64): the factor
    keys of (matrix g, member p) at row g·N + p; `scales` (N, fp32): each member's sign·t; `slots` (N):
    the slot of each member. Equal, bit for bit, to `lowrank.lora_factors_many` cast to the dtype.
    """
    m, n = shape
    if max(m, n) * rank >= 2**32:
        raise ValueError(f"a {m}×{n} matrix at rank {rank} has factor indices beyond 2**32")
    members, groups = scales.numel(), a_stacks.numel()
    grid = (groups * members, triton.cdiv(max_rank * max(m, n), LORA_BLOCK))
    _lora_slots_kernel[grid](
        a_stacks, b_stacks, ref, keys, scales, slots, members, m, n, c,
        MAXR=max_rank, RANK=rank, BLOCK=LORA_BLOCK, num_warps=4, enable_fp_fusion=False,
    )
