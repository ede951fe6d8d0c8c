"""The Triton kernel that writes low-rank ES members into a vLLM engine's LoRA slots (`lora_slots`).

One launch per matrix shape writes every member of a sampling call into its slot of every matrix of
that shape, regenerating the factors from the counter-based hash (the same `_noise` as the weights
layer's kernels, `vrl.weights.flat_triton`). Each value is exact in fp32; the one rounding is the
cast to the slot dtype, to nearest even as torch does, so the slots hold bit for bit what
`vrl.generate.vllm_lora.lora_factors_many` gives. On an H100 this took the 30 members of a 1.5B
model from 0.14 s (torch ops, chunked) to 0.05 s per call; 0.37 s a matrix at a time.

Imported only on a GPU with Triton (`LowRankEngine`), never on CPU-only machines.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vrl.weights.flat_triton import _noise

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
    the slot of each member. Equal, bit for bit, to `vllm_lora.lora_factors_many` cast to the dtype.
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
