"""Fused GPU kernels of the flat view: noise generation and weight writes in one pass over a flat buffer.

They compute exactly what `vrl.weights.noise.perturb_reference` and `update_reference` compute (same
integer hash, same fp32 roundings, same summation order), bit for bit; `tests/test_noise_gpu.py`
checks that on the device. Triton is imported by the caller only when the parameters live on a CUDA
device, so this module is never imported on CPU-only machines.

Layout (built by `vrl.weights.flat.FlatParams`): each tensor's fp32 master starts at a multiple of
`GRANULE` elements of one flat buffer; `granule_tensor[g]` names the tensor that owns granule g, so
a program finds its tensor with one load, and the whole model is perturbed with a single launch.
Weights are written through a table of addresses (`Targets`), so they can live anywhere: in one
flat buffer beside the master (hf backend) or in the rows of a vLLM engine's fused tensors, which
are then written once, straight from the master, with no staging copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vrl.weights.noise import seed_words

PERTURB_BLOCK = 4096
UPDATE_BLOCK = 1024


@triton.jit
def _mix(x):
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _keys(words_ptr, t, lo, hi):
    n1 = tl.load(words_ptr + 2 * t).to(tl.uint32)
    n2 = tl.load(words_ptr + 2 * t + 1).to(tl.uint32)
    return _mix(_mix(n1 ^ lo) ^ hi), _mix(_mix(n2 ^ lo) ^ hi)


@triton.jit
def _noise(local, k1, k2):
    x = local * 0x9E3779B1 + k1
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= (x >> 15) ^ k2
    x *= 0x846CA68B
    x ^= x >> 16
    s = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)
    return (s.to(tl.int32) - 510).to(tl.float32)


@triton.jit
def _locate(granule_tensor_ptr, starts_ptr, BLOCK: tl.constexpr, GRANULE: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(granule_tensor_ptr + pid // (GRANULE // BLOCK))
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    local = (offs - tl.load(starts_ptr + t)).to(tl.uint32)
    return t, offs, local


@triton.jit
def _target(dst_ptrs, numels_ptr, ref_ptr, t, local):
    """Where tensor t's element `local` lives (its own storage, anywhere on the device), and a mask
    that keeps the padding of the flat master out of it."""
    dst = tl.load(dst_ptrs + t).to(tl.pointer_type(ref_ptr.dtype.element_ty))
    return dst + local, local < tl.load(numels_ptr + t).to(tl.uint32)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _perturb_kernel(
    master_ptr, dst_ptrs, numels_ptr, ref_ptr, granule_tensor_ptr, starts_ptr, words_ptr, seed_lo, seed_hi, scale,
    BLOCK: tl.constexpr, GRANULE: tl.constexpr,
):
    t, offs, local = _locate(granule_tensor_ptr, starts_ptr, BLOCK, GRANULE)
    k1, k2 = _keys(words_ptr, t, seed_lo.to(tl.uint32), seed_hi.to(tl.uint32))
    w = tl.load(master_ptr + offs) + scale * _noise(local, k1, k2)
    ptrs, mask = _target(dst_ptrs, numels_ptr, ref_ptr, t, local)
    tl.store(ptrs, w.to(ref_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _update_kernel(
    master_ptr, dst_ptrs, numels_ptr, ref_ptr, granule_tensor_ptr, starts_ptr, words_ptr, seeds_ptr, coeffs_ptr,
    n_terms, BLOCK: tl.constexpr, GRANULE: tl.constexpr,
):
    t, offs, local = _locate(granule_tensor_ptr, starts_ptr, BLOCK, GRANULE)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(n_terms):
        lo = tl.load(seeds_ptr + 2 * j).to(tl.uint32)
        hi = tl.load(seeds_ptr + 2 * j + 1).to(tl.uint32)
        k1, k2 = _keys(words_ptr, t, lo, hi)
        acc += tl.load(coeffs_ptr + j) * _noise(local, k1, k2)
    m = tl.load(master_ptr + offs) + acc
    tl.store(master_ptr + offs, m)
    ptrs, mask = _target(dst_ptrs, numels_ptr, ref_ptr, t, local)
    tl.store(ptrs, m.to(ref_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cast_kernel(
    master_ptr, dst_ptrs, numels_ptr, ref_ptr, granule_tensor_ptr, starts_ptr,
    BLOCK: tl.constexpr, GRANULE: tl.constexpr,
):
    t, offs, local = _locate(granule_tensor_ptr, starts_ptr, BLOCK, GRANULE)
    ptrs, mask = _target(dst_ptrs, numels_ptr, ref_ptr, t, local)
    tl.store(ptrs, tl.load(master_ptr + offs).to(ref_ptr.dtype.element_ty), mask=mask)


class Targets:
    """Where a group's weights are written: one address and element count per tensor.

    The tensors may be views of the group's own flat buffer (hf backend) or rows of other tensors
    anywhere on the device (a vLLM engine's fused weights); each must be contiguous and all must
    share one dtype. The caller keeps them alive (the table holds raw addresses).
    """

    def __init__(self, tensors: list[torch.Tensor]):
        if not tensors:
            raise ValueError("no target tensors")
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1 or not all(t.is_contiguous() for t in tensors):
            raise ValueError("target tensors must be contiguous and share one dtype")
        device = tensors[0].device
        self.ref = tensors[0]
        self.ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)
        self.numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64, device=device)


def perturb(
    master: torch.Tensor, targets: Targets, granule_tensor: torch.Tensor, starts: torch.Tensor,
    words: torch.Tensor, seed: int, scale: float, granule: int,
) -> None:
    """targets = cast(master + scale·s(seed)) for every tensor of a flat master, in one launch."""
    lo, hi = seed_words(seed)
    grid = (master.numel() // PERTURB_BLOCK,)
    _perturb_kernel[grid](
        master, targets.ptrs, targets.numels, targets.ref, granule_tensor, starts, words, lo, hi, scale,
        BLOCK=PERTURB_BLOCK, GRANULE=granule, num_warps=8,
    )


def update(
    master: torch.Tensor, targets: Targets, granule_tensor: torch.Tensor, starts: torch.Tensor,
    words: torch.Tensor, terms: list[tuple[int, float]], granule: int,
) -> None:
    """master += Σⱼ cⱼ·s(seedⱼ) in term order, targets = cast(master), in one launch."""
    seeds = torch.tensor([w for seed, _ in terms for w in seed_words(seed)], dtype=torch.int64)
    coeffs = torch.tensor([c for _, c in terms], dtype=torch.float32)
    grid = (master.numel() // UPDATE_BLOCK,)
    _update_kernel[grid](
        master, targets.ptrs, targets.numels, targets.ref, granule_tensor, starts, words,
        seeds.to(master.device), coeffs.to(master.device), len(terms),
        BLOCK=UPDATE_BLOCK, GRANULE=granule, num_warps=4,
    )


def cast(master: torch.Tensor, targets: Targets, granule_tensor: torch.Tensor, starts: torch.Tensor, granule: int) -> None:
    """targets = cast(master), in one launch (a restore when the targets are not one flat buffer)."""
    grid = (master.numel() // PERTURB_BLOCK,)
    _cast_kernel[grid](
        master, targets.ptrs, targets.numels, targets.ref, granule_tensor, starts,
        BLOCK=PERTURB_BLOCK, GRANULE=granule, num_warps=8,
    )
