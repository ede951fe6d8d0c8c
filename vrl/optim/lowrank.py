"""Low-rank ES members (EGGROLL: Sarkar et al. 2025, "Evolution Strategies at the Hyperscale", arXiv 2511.16652).

Member i perturbs each selected weight matrix W (m×n, a linear layer's `weight`, out × in) by

    σ·signᵢ·Aᵢ·Bᵢᵀ/√r,   Aᵢ = ε(seedᵢ, name + ":A", (m, r)),   Bᵢ = ε(seedᵢ, name + ":B", (n, r))

where ε is the full-rank scheme's counter-based noise (`vrl.optim.noise`): each factor *is* the
noise of a virtual m×r (n×r) tensor, so factors are device-independent and replay from seeds. Each
element of Aᵢ·Bᵢᵀ/√r has mean 0 and variance 1, like a full-rank ε. All members share the base
weights and differ only by r·(m+n) numbers per matrix, which is what lets the whole population run
as one batch (`population`). The update, a weighted sum of N rank-r products, has rank up to N·r.

**Exact arithmetic.** With a = ε_A/C and b = ε_B/C the integer noise (|a|, |b| ≤ 510) and
Pᵢ = a·bᵀ (an integer matrix, |P| ≤ r·510² < 2²⁴ for r ≤ 64, so exact in fp32):

* perturb: ``w = cast(θ + fp32(s·P))`` with ``s = sign·round14(σ·C²/√r)``;
* update: the stored zᵢ have 4 decimals, so Zᵢ = round(zᵢ·10⁴) is an integer and
  ``U = Σᵢ Zᵢ·signᵢ·Pᵢ`` is an exact integer (bounded below 2⁶² by `check_bound`); then
  ``θ ← θ + fp32(fp32(U)·c)`` with ONE coefficient ``c = round14(α/N·10⁻⁴·C²/√r)``.

Every step is either exact or one IEEE round-to-nearest of a well-defined value (int → fp32, one
multiply, one add, one cast), so the pure-torch reference here and the Triton kernels
(`vrl.optim.lowrank_triton`, launched with ``enable_fp_fusion=False`` so no multiply-add is
contracted) give the same bits. Nothing depends on summation order: the only sums are of integers.

**What is perturbed.** Only 2-D weights of `torch.nn.Linear` layers matched by es.include /
es.exclude. EGGROLL's reference code gives matrices low-rank noise, gives other parameters
(biases, norm scales: vectors) ordinary full-rank noise unless ``freeze_nonlora`` is set, and never
perturbs or updates embeddings. Here vectors and embeddings are left out altogether: a per-member
vector would break "members share the base weights" (a norm scale is not a linear layer that an
engine's LoRA path can serve), they hold a tiny share of the parameters, and the embedding (and a
`lm_head` tied to it) is a lookup table that LoRA engines do not perturb per request.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from vrl.errors import SelectionError
from vrl.optim import noise as nz
from vrl.optim.params import FlatParams

log = logging.getLogger(__name__)

MAX_RANK = 64  # r·510² < 2²⁴: a member's product P is exact in fp32 (and in any fp32 matmul)
Z_SCALE = 10**4  # z is stored with 4 decimals (`vrl.optim.es.Z_DECIMALS`): Z = round(z·10⁴) is exact
PRODUCT_MAX = nz.BYTE_SUM_OFFSET**2  # |a·b| ≤ 510²
# |U| ≤ Σᵢ|Zᵢ|·r·510² is checked against this before any update, so every int64 partial sum (in
# any order) stays below 2⁶² and nothing can overflow. In practice Σᵢ|zᵢ| ≤ N (z-scores have
# Σz² = N; Cauchy-Schwarz), so at r = 8 the bound holds up to N ≈ 2·10⁸ members.
UPDATE_BOUND = 2**62
_F64_EXACT = 2**53  # below this, integer sums are exact in float64 too (the fast CPU path)


def _check_rank(rank: int) -> None:
    if not 1 <= rank <= MAX_RANK:
        raise ValueError(f"low-rank ES needs 1 <= rank <= {MAX_RANK}, got {rank}")


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
    _check_rank(rank)
    return _factors_int_of_keys(factor_keys_many(seeds, [name]), shape, rank, device)


def _factors_int_of_keys(
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
    _check_rank(rank)
    return nz.round_sig(sigma * nz.C * nz.C / math.sqrt(rank), nz.SCALE_BITS)


def lora_scales(members: Sequence[tuple[int, int]], rank: int, sigma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Each member's lora_b scale sign·round14(σ·C/√r), fp32 (exact): what multiplies its integer factor a."""
    _check_rank(rank)
    t = nz.round_sig(sigma * nz.C / math.sqrt(rank), nz.SCALE_BITS)
    return torch.tensor([sign * t for _, sign in members], dtype=torch.float32, device=device)


def lora_factors(
    members: Sequence[tuple[int, int]], name: str, shape: Sequence[int], rank: int, sigma: float,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Members (seed, sign) of matrix `name` as LoRA factors, exact in fp32: lora_a (N×r×n) = C·bᵀ and
    lora_b (N×m×r) = t·a with t = sign·round14(σ·C/√r), so lora_b·lora_a = σ·sign·A·Bᵀ/√r up to
    C·round14(σ·C/√r) vs round14(σ·C²/√r) (< 2⁻¹⁴ relative). Both factors are O(1) and O(σ), so a
    16-bit LoRA dtype holds them to its own precision (an engine's LoRA slots: `vllm_worker`)."""
    lora_a, lora_b = lora_factors_many(members, [name], shape, rank, sigma, device)
    return lora_a[0], lora_b[0]


def lora_factors_many(
    members: Sequence[tuple[int, int]], names: Sequence[str], shape: Sequence[int], rank: int, sigma: float,
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lora_factors` of several matrices of one shape at once, cast to `dtype` (one rounding from the
    exact fp32 values): lora_a (G×N×r×n), lora_b (G×N×m×r) for G names and N members: one noise pass
    and one upload of keys for all of them. The reference for `lowrank_triton.lora_slots`, which a
    vLLM engine on a GPU uses instead (`LowRankEngine.load_members`)."""
    m, n = shape
    _check_rank(rank)
    keys = factor_keys_many([seed for seed, _ in members], names)
    a, b = _factors_int_of_keys(keys, shape, rank, device)
    scale = lora_scales(members, rank, sigma, device).repeat(len(names))
    lora_a = (b.to(torch.float32) * nz.C).to(dtype).transpose(1, 2)
    lora_b = (a.to(torch.float32) * scale[:, None, None]).to(dtype)
    g, k = len(names), len(members)
    return lora_a.reshape(g, k, rank, n), lora_b.reshape(g, k, m, rank)


# -- the update as data ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LowRankUpdate:
    """θ ← θ + coeff·Σₜ multₜ·a(seedₜ)·b(seedₜ)ᵀ: integer multipliers per seed and one fp32 coefficient."""

    terms: tuple[tuple[int, int], ...]  # (seed, integer multiplier Σ signᵢ·Zᵢ over the members of that seed)
    coeff: float
    rank: int

    def __bool__(self) -> bool:
        return bool(self.terms) and self.coeff != 0.0


def update_for(members: Sequence[tuple[int, int]], z: Sequence[float], alpha: float, rank: int) -> LowRankUpdate:
    """The update α/N·Σᵢ zᵢ·signᵢ·Aᵢ·Bᵢᵀ/√r of one iteration, from its members (seed, sign) and stored z.

    Members sharing a seed (antithetic pairs) are merged, so each seed's product is formed once.
    """
    _check_rank(rank)
    if len(members) != len(z):
        raise ValueError(f"{len(members)} members but {len(z)} weights z")
    merged: dict[int, int] = defaultdict(int)
    for (seed, sign), zi in zip(members, z):
        merged[seed] += sign * round(zi * Z_SCALE)
    terms = tuple((seed, w) for seed, w in merged.items() if w != 0)
    coeff = nz.round_sig(alpha / len(z) / Z_SCALE * nz.C * nz.C / math.sqrt(rank), nz.SCALE_BITS)
    check_bound(terms, rank)
    return LowRankUpdate(terms, coeff, rank)


COEFF_SEED = -1  # the head pair of `to_terms` (member seeds are never negative)


def to_terms(update: LowRankUpdate) -> list[tuple[int, float]]:
    """The update as `PolicyHost.update` terms: [(−1, coeff), (seed, float(mult)), ...] ([] when empty).

    The same list-of-(int, float)-pairs shape as full-rank terms, so it crosses the host contract
    and the Modal wire (JSON) unchanged; multipliers are integers below 2⁵³, exact as floats. The
    rank is not in the terms: the host has it from its `PerturbationSpec`.
    """
    if not update:
        return []
    return [(COEFF_SEED, update.coeff), *((seed, float(w)) for seed, w in update.terms)]


def from_terms(terms: Sequence[tuple[int, float]], rank: int) -> LowRankUpdate:
    """The `LowRankUpdate` that `to_terms` wrote (a clear error for full-rank terms sent to a low-rank host)."""
    if not terms:
        return LowRankUpdate((), 0.0, rank)
    (head, coeff), rest = terms[0], terms[1:]
    if int(head) != COEFF_SEED or any(float(w) != int(w) for _, w in rest):
        raise ValueError(
            "these update terms are not low-rank terms (vrl.optim.lowrank.to_terms); a host set up for "
            "es.noise=lowrank got full-rank terms"
        )
    return LowRankUpdate(tuple((int(s), int(w)) for s, w in rest), float(coeff), rank)


def _sum_bound(mults: Sequence[int], rank: int) -> int:
    """Σ|multₜ|·r·510²: no partial sum of Σₜ multₜ·aₜ·bₜᵀ, in any order, can reach it."""
    return sum(abs(w) for w in mults) * rank * PRODUCT_MAX


def _exact_in_float64(mults: Sequence[int], rank: int) -> bool:
    """Whether every partial sum is an exact float64 integer, so float64 matmuls (any order) give the exact sum."""
    return _sum_bound(mults, rank) < _F64_EXACT


def check_bound(terms: Sequence[tuple[int, int]], rank: int) -> None:
    """Refuse an update whose exact integer sum could leave int64's safe range (see `UPDATE_BOUND`)."""
    bound = _sum_bound([w for _, w in terms], rank)
    if bound >= UPDATE_BOUND:
        raise ValueError(
            f"low-rank ES update too large for exact int64 accumulation (Σ|Z|·r·510² = {bound:.3g} ≥ 2^62); "
            "use fewer members or a lower es.rank"
        )


# -- reference kernels (pure torch, any device) -----------------------------------------------------

_CHUNK = 1 << 22  # output elements per row block: bounds the float64/int64 temporaries (32 MB)


def _rows(m: int, n: int) -> int:
    return max(1, _CHUNK // max(n, 1))


def product_sum(a: torch.Tensor, b: torch.Tensor, mults: Sequence[int]) -> torch.Tensor:
    """fp32(Σₜ multₜ·aₜ·bₜᵀ) for integer factors a (T×m×r) and b (T×n×r): the exact integer, rounded once.

    Below 2⁵³ every partial sum is an exact float64 integer, so one float64 matmul (any order) is
    exact; above, int64 accumulation (slower). Both give the same integer, rounded to fp32 once.
    """
    t, m, r = a.shape
    if _exact_in_float64(mults, r):
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
    from vrl.optim import lowrank_triton

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
    if not _exact_in_float64(mults, r):
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
            a, b = _factors_int_of_keys(factor_keys_many(seeds, [names[i] for i in part]), (m, n), r, masters[0].device)
            lhs = (a.view(len(part), t, m, r).to(torch.float64) * w[None, :, None, None]).permute(0, 2, 1, 3)
            rhs = b.view(len(part), t, n, r).to(torch.float64).permute(0, 2, 1, 3)
            u = torch.bmm(lhs.reshape(len(part), m, t * r), rhs.reshape(len(part), n, t * r).transpose(1, 2))
            u = u.to(torch.float32) * update.coeff  # the integer rounds once, the product once
            for k, i in enumerate(part):
                masters[i].add_(u[k])  # the sum once
                weights[i].copy_(masters[i])


# -- which matrices ---------------------------------------------------------------------------------


def select_linear(
    model: torch.nn.Module, include: Sequence[str], exclude: Sequence[str], *, report: bool = True
) -> list[tuple[str, torch.nn.Linear]]:
    """Linear layers whose weight name matches an `include` and no `exclude` pattern (vectors, embeddings
    and a weight tied to an embedding are never selected; matched ones are logged as skipped when
    `report`)."""
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    linear_by_weight = {id(m.weight): m for m in model.modules() if isinstance(m, torch.nn.Linear)}
    chosen, skipped = [], []
    for name, p in model.named_parameters():  # tied weights appear once, under their first name
        if not any(fnmatch.fnmatchcase(name, pat) for pat in include) or any(fnmatch.fnmatchcase(name, pat) for pat in exclude):
            continue
        module = linear_by_weight.get(id(p))
        if module is None or id(p) in embedding_weights or p.dim() != 2:
            skipped.append(name)
        else:
            chosen.append((name, module))
    if not chosen:
        sample = ", ".join(f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
        raise SelectionError(
            f"es.include={list(include)} / es.exclude={list(exclude)} select no linear-layer weight for low-rank ES; "
            f"set es.include to shell-style patterns of their names, which look like: {sample[:200]}..."
        )
    if skipped and report:
        log.info("low-rank ES leaves %d matched non-matrix or embedding parameters untouched (e.g. %s)", len(skipped), skipped[0])
    return chosen


# -- the parameters low-rank ES moves -------------------------------------------------------------


class LowRankParams:
    """θ (fp32 master) of the selected matrices, stored as `vrl.optim.es.FlatParams` stores full-rank θ
    (so restore, state, load_state and snapshots are shared); perturb and update are low-rank."""

    def __init__(self, flat: FlatParams, rank: int):
        _check_rank(rank)
        bad = [n for g in flat.groups for n, v in zip(g.names, g.master_views) if v.dim() != 2]
        if bad:
            raise ValueError(f"low-rank ES perturbs matrices only; {bad[0]} is not 2-D")
        self.flat, self.rank = flat, rank

    @classmethod
    def from_model(cls, model: torch.nn.Module, include: Sequence[str], exclude: Sequence[str], rank: int) -> LowRankParams:
        """θ for the model's selected linear weights (they move into flat buffers, as with full-rank ES)."""
        return cls(FlatParams([(n, m.weight) for n, m in select_linear(model, include, exclude)]), rank)

    @property
    def names(self) -> list[str]:
        return self.flat.names

    @property
    def numel(self) -> int:
        return self.flat.numel

    @property
    def dtype(self) -> str:
        return self.flat.dtype

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        for g in self.flat.groups:
            yield from zip(g.names, g.master_views, g.weight_views)

    def perturb(self, seed: int, sign: int, sigma: float) -> None:
        """weights ← cast(θ + σ·sign·A·Bᵀ/√r) (a member materialised: the sequential path and the tests)."""
        if self.flat.use_triton:
            from vrl.optim import lowrank_triton

            scale = sign * perturbation_scale(sigma, self.rank)
            for name, m, w in self._tensors():
                lowrank_triton.perturb(m, w, factor_keys(seed, name), scale, self.rank)
        else:
            names, masters, weights = zip(*self._tensors())
            perturb_reference(masters, weights, names, seed, sign, sigma, self.rank)

    def restore(self) -> None:
        """weights ← cast(θ), bit-exact."""
        self.flat.restore()

    def update(self, update: LowRankUpdate | Sequence[tuple[int, float]]) -> None:
        """θ ← θ + coeff·Σ multₜ·aₜ·bₜᵀ (exact integer sum, one fp32 multiply and add); weights ← cast(θ).

        `update` is a `LowRankUpdate` or its `to_terms` form (what a host's `update(terms)` gets)."""
        if not isinstance(update, LowRankUpdate):
            update = from_terms(update, self.rank)
        if update.rank != self.rank:
            raise ValueError(f"update has rank {update.rank}, these parameters rank {self.rank}")
        if not update:
            return
        names, masters, weights = zip(*self._tensors())
        if not self.flat.use_triton:
            update_reference(masters, weights, names, update)
        elif _exact_in_float64([w for _, w in update.terms], self.rank):
            update_batched(masters, weights, names, update)  # float64 matmuls: faster than the kernel
        else:
            update_triton(masters, weights, names, update)

    def state(self) -> dict[str, torch.Tensor]:
        return self.flat.state()

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.flat.load_state(state)


# -- the population as one batch (hf backend) ------------------------------------------------------


@contextlib.contextmanager
def population(
    layers: Sequence[tuple[str, torch.nn.Linear]],
    members: Sequence[tuple[int, int]],
    sigma: float,
    rank: int,
    row_member: torch.Tensor | Sequence[int],
) -> Iterator[None]:
    """Inside the block, batch row j of every forward runs member `row_member[j]` (−1: the base weights).

    Each selected linear layer's output gains s·signᵢ·(x·bᵢ)·aᵢᵀ for its row's member i (forward
    hooks), so one `model.generate` call samples all members. The factors of all members are formed
    once, as integer-valued fp32 matrices (exact), concatenated per layer: b_cat (n × N·r) and
    a_cat (m × N·r); a row's low-rank term is (x·b_cat ⊙ mask)·a_catᵀ, where the mask keeps its
    member's r columns and carries the scale. That is two dense matmuls per layer, costing
    N·r·(1/m + 1/n) of the layer's own work (N times what per-member products would cost, traded
    for no per-row gathers or regrouping; measured on CPU: 2.0× the base forward of a hidden-256
    model at N = 30, r = 8). The batch must keep its rows in order (sampling and greedy decoding
    do; beam search does not).

    Memory: 4·N·r·Σ(m+n) bytes of factors (fp32) for the block's lifetime.
    """
    _check_rank(rank)
    if not members:
        raise ValueError("no members")
    n_members = len(members)
    rows = torch.as_tensor(row_member, dtype=torch.int64).cpu()
    if rows.dim() != 1 or bool(((rows < -1) | (rows >= n_members)).any()):
        raise ValueError(f"row_member must list one member index in [-1, {n_members}) per batch row; got {rows.tolist()[:8]}")
    # mask[j, i·r + k] = signᵢ·s if row j runs member i, else 0 (row −1: all zero, the base weights).
    signs = torch.tensor([sign for _, sign in members], dtype=torch.float32)
    live = (rows >= 0).nonzero().squeeze(1)
    mask = torch.zeros(len(rows), n_members, dtype=torch.float32)
    mask[live, rows[live]] = signs[rows[live]] * perturbation_scale(sigma, rank)
    mask = mask.repeat_interleave(rank, dim=1)
    handles = []
    try:
        for name, module in layers:
            device = module.weight.device
            a, b = factors_int_many([seed for seed, _ in members], name, module.weight.shape, rank, device)
            a_cat = a.permute(1, 0, 2).reshape(a.shape[1], -1).to(torch.float32)  # m × N·r, member-major columns
            b_cat = b.permute(1, 0, 2).reshape(b.shape[1], -1).to(torch.float32)  # n × N·r
            handles.append(module.register_forward_hook(_LowRankHook(a_cat, b_cat, mask.to(device))))
        yield
    finally:
        for h in handles:
            h.remove()


class _LowRankHook:
    """Forward hook of one linear layer: output += ((x·b_cat) ⊙ mask)·a_catᵀ, in fp32."""

    def __init__(self, a_cat: torch.Tensor, b_cat: torch.Tensor, mask: torch.Tensor):
        self.a_cat, self.b_cat, self.mask = a_cat, b_cat, mask

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if x.shape[0] != self.mask.shape[0]:
            raise RuntimeError(
                f"low-rank population: a forward with batch {x.shape[0]} inside a block set up for {self.mask.shape[0]} rows"
            )
        h = x.to(torch.float32) @ self.b_cat  # (batch, ..., N·r)
        h = h * self.mask.view(self.mask.shape[0], *([1] * (h.dim() - 2)), -1)
        return output + (h @ self.a_cat.T).to(output.dtype)
