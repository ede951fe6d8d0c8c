"""The low-rank view's kernels: a member's perturbation and the exact update, in pure torch (any device).

* perturb: ``w = cast(θ + fp32(s·P))`` with P = a·bᵀ the member's integer product and
  ``s = sign·round14(σ·C²/√r)`` (`vrl.weights.factors.perturbation_scale`);
* update: ``θ ← θ + fp32(fp32(U)·c)`` with U = Σₜ multₜ·Pₜ the exact integer sum of a
  `LowRankUpdate` (bounded by `vrl.weights.exact.check_bound`) and its ONE coefficient c.

Every step is either exact or one IEEE round-to-nearest of a well-defined value (int → fp32, one
multiply, one add, one cast), so the three ways of forming the update give the same bits:
`update_reference` (row blocks, float64 or int64 sums), `update_batched` (the matrices of one shape
in one float64 `bmm`, below 2⁵³) and `update_triton` (`vrl.weights.lowrank_triton`, launched with
``enable_fp_fusion=False`` so no multiply-add is contracted; int64 sums up to 2⁶²). Nothing depends
on summation order: the only sums are of integers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from vrl.weights.exact import check_bound, exact_in_float64
from vrl.weights.factors import factor_keys_many, factors_int, factors_int_many, factors_int_of_keys, perturbation_scale
from vrl.weights.update import LowRankUpdate

_CHUNK = 1 << 22  # output elements per row block: bounds the float64/int64 temporaries (32 MB)


def _rows(m: int, n: int) -> int:
    return max(1, _CHUNK // max(n, 1))


def product_sum(a: torch.Tensor, b: torch.Tensor, mults: Sequence[int]) -> torch.Tensor:
    """fp32(Σₜ multₜ·aₜ·bₜᵀ) for integer factors a (T×m×r) and b (T×n×r): the exact integer, rounded once.

    Below 2⁵³ every partial sum is an exact float64 integer, so one float64 matmul (any order) is
    exact; above, int64 accumulation (slower). Both give the same integer, rounded to fp32 once.
    """
    t, m, r = a.shape
    if exact_in_float64(mults, r):
        w = torch.tensor(list(mults), dtype=torch.float64, device=a.device)
        lhs = (a.to(torch.float64) * w[:, None, None]).permute(1, 0, 2).reshape(m, t * r)
        rhs = b.to(torch.float64).permute(1, 0, 2).reshape(b.shape[1], t * r)
        return (lhs @ rhs.T).to(torch.float32)
    acc = torch.zeros(m, b.shape[1], dtype=torch.int64, device=a.device)
    for ai, bi, w in zip(a, b, mults):
        acc += (ai.to(torch.float64) @ bi.to(torch.float64).T).to(torch.int64) * w
    return acc.to(torch.float32)


def perturb_reference(
    masters: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], names: Sequence[str],
    seed: int, sign: int, sigma: float, rank: int,
) -> None:
    """weights[t] = cast(masters[t] + fp32(s·P)) for member (seed, sign); P = a·bᵀ, s from `perturbation_scale`."""
    s = sign * perturbation_scale(sigma, rank)
    for master, weight, name in zip(masters, weights, names):
        a, b = factors_int(seed, name, master.shape, rank, master.device)
        b64 = b.to(torch.float64)
        step = _rows(*master.shape)
        for i in range(0, master.shape[0], step):
            p = (a[i : i + step].to(torch.float64) @ b64.T).to(torch.float32)  # exact integers (< 2²⁴)
            weight[i : i + step].copy_(master[i : i + step] + p * s)  # two roundings: the product, the sum


def update_reference(
    masters: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], names: Sequence[str], update: LowRankUpdate
) -> None:
    """masters[t] += fp32(fp32(U)·coeff) with U = Σ multₜ·aₜ·bₜᵀ exact; then weights[t] = cast(masters[t])."""
    if not update:
        return
    check_bound(update.terms, update.rank)
    mults = [w for _, w in update.terms]
    for master, weight, name in zip(masters, weights, names):
        a, b = factors_int_many([seed for seed, _ in update.terms], name, master.shape, update.rank, master.device)
        step = _rows(*master.shape)
        for i in range(0, master.shape[0], step):
            u = product_sum(a[:, i : i + step], b, mults)
            master[i : i + step] += u * update.coeff  # the product rounds once, then the sum once
        weight.copy_(master)


def update_triton(
    masters: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], names: Sequence[str], update: LowRankUpdate
) -> None:
    """`update_reference`'s bits by the Triton kernel (one launch per matrix, int64 accumulation: any
    sum below 2⁶², where `update_batched`'s float64 matmuls stop at 2⁵³)."""
    from vrl.weights import lowrank_triton

    if not update:
        return
    check_bound(update.terms, update.rank)
    device, terms = masters[0].device, len(update.terms)
    # Every matrix's keys and the multipliers reach the device in two copies, not two per matrix.
    keys = factor_keys_many([seed for seed, _ in update.terms], names).to(device)
    mults = torch.tensor([w for _, w in update.terms], dtype=torch.int64, device=device)
    for i, (m, w) in enumerate(zip(masters, weights)):
        lowrank_triton.update(m, w, keys[i * terms:(i + 1) * terms], mults, update.coeff, update.rank)


_BATCH_ELEMENTS = 1 << 25  # output elements of one batched matmul: 256 MB of float64 at most


def update_batched(
    masters: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], names: Sequence[str], update: LowRankUpdate,
    max_elements: int = _BATCH_ELEMENTS,
) -> None:
    """`update_reference`'s bits in a few large launches (the GPU path): matrices of one shape are
    taken together, their factors for every term generated in one pass and the exact integer sums
    formed by one float64 `bmm` (exact below 2⁵³, checked; above, `update_reference`'s int64 path).
    The host never waits for the device (one upload of the multipliers), so a 1.5 B model's 196
    matrices cost a few dozen matmuls instead of one synchronised round per matrix. A matrix of more
    than `max_elements` elements goes through `update_reference` (row blocks)."""
    if not update:
        return
    check_bound(update.terms, update.rank)
    mults = [w for _, w in update.terms]
    r, t = update.rank, len(mults)
    if not exact_in_float64(mults, r):
        update_reference(masters, weights, names, update)
        return
    seeds = [seed for seed, _ in update.terms]
    w = torch.tensor(mults, dtype=torch.float64).to(masters[0].device, non_blocking=True)
    by_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, master in enumerate(masters):
        by_shape[(master.shape[0], master.shape[1])].append(i)
    for (m, n), idx in by_shape.items():
        if m * n > max_elements:
            update_reference([masters[i] for i in idx], [weights[i] for i in idx], [names[i] for i in idx], update)
            continue
        per = max_elements // (m * n)
        for j in range(0, len(idx), per):
            part = idx[j : j + per]
            a, b = factors_int_of_keys(factor_keys_many(seeds, [names[i] for i in part]), (m, n), r, masters[0].device)
            lhs = (a.view(len(part), t, m, r).to(torch.float64) * w[None, :, None, None]).permute(0, 2, 1, 3)
            rhs = b.view(len(part), t, n, r).to(torch.float64).permute(0, 2, 1, 3)
            u = torch.bmm(lhs.reshape(len(part), m, t * r), rhs.reshape(len(part), n, t * r).transpose(1, 2))
            u = u.to(torch.float32) * update.coeff  # the integer rounds once, the product once
            for k, i in enumerate(part):
                masters[i].add_(u[k])  # the sum once
                weights[i].copy_(masters[i])

