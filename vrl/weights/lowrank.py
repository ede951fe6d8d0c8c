"""The low-rank view: θ of the selected weight matrices, moved by low-rank perturbations and updates.

Member i of low-rank ES perturbs each selected matrix W by σ·signᵢ·Aᵢ·Bᵢᵀ/√r (`vrl.weights.factors`);
an iteration's update has rank up to N·r (`LowRankUpdate`, applied by `vrl.weights.lowrank_kernels`
or the Triton kernels of `vrl.weights.lowrank_triton`, the same bits). θ is kept as the flat view
keeps it (`FlatParams`), so restore, state, load_state and snapshots are shared.

**What is perturbed.** Only 2-D weights of `torch.nn.Linear` layers matched by es.include /
es.exclude. EGGROLL's reference code gives matrices low-rank noise, gives other parameters
(biases, norm scales: vectors) ordinary full-rank noise unless ``freeze_nonlora`` is set, and never
perturbs or updates embeddings. Here vectors and embeddings are left out altogether: a per-member
vector would break "members share the base weights" (a norm scale is not a linear layer that an
engine's LoRA path can serve), they hold a tiny share of the parameters, and the embedding (and a
`lm_head` tied to it) is a lookup table that LoRA engines do not perturb per request.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterator, Sequence

import torch

from vrl.errors import SelectionError
from vrl.policy import PerturbationSpec
from vrl.weights.exact import check_rank, exact_in_float64
from vrl.weights.factors import factor_keys, perturbation_scale
from vrl.weights.flat import FlatParams, select_parameters
from vrl.weights.lowrank_kernels import perturb_reference, update_batched, update_reference, update_triton
from vrl.weights.update import LowRankUpdate, check_kind

log = logging.getLogger(__name__)


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


class LowRankParams:
    """θ (fp32 master) of the selected matrices, stored as `FlatParams` stores full-rank θ (so restore,
    state, load_state and snapshots are shared); perturb and update are low-rank. `layers`: the
    (name, linear layer) pairs when built `from_model` (a batched forward hooks them)."""

    def __init__(self, flat: FlatParams, rank: int, layers: Sequence[tuple[str, torch.nn.Linear]] = ()):
        check_rank(rank)
        bad = [n for g in flat.groups for n, v in zip(g.names, g.master_views) if v.dim() != 2]
        if bad:
            raise ValueError(f"low-rank ES perturbs matrices only; {bad[0]} is not 2-D")
        self.flat, self.rank, self.layers = flat, rank, list(layers)

    @classmethod
    def from_model(cls, model: torch.nn.Module, include: Sequence[str], exclude: Sequence[str], rank: int) -> LowRankParams:
        """θ for the model's selected linear weights (they move into flat buffers, as with full-rank ES)."""
        layers = select_linear(model, include, exclude)
        return cls(FlatParams([(n, m.weight) for n, m in layers]), rank, layers)

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
            from vrl.weights import lowrank_triton

            scale = sign * perturbation_scale(sigma, self.rank)
            for name, m, w in self._tensors():
                lowrank_triton.perturb(m, w, factor_keys(seed, name), scale, self.rank)
        else:
            names, masters, weights = zip(*self._tensors())
            perturb_reference(masters, weights, names, seed, sign, sigma, self.rank)

    def restore(self) -> None:
        """weights ← cast(θ), bit-exact."""
        self.flat.restore()

    def update(self, update: LowRankUpdate) -> None:
        """θ ← θ + coeff·Σ multₜ·aₜ·bₜᵀ (exact integer sum, one fp32 multiply and add); weights ← cast(θ)."""
        check_kind(update, "lowrank")
        if update.rank != self.rank:
            raise ValueError(f"update has rank {update.rank}, these parameters rank {self.rank}")
        if not update:
            return
        names, masters, weights = zip(*self._tensors())
        if not self.flat.use_triton:
            update_reference(masters, weights, names, update)
        elif exact_in_float64([w for _, w in update.terms], self.rank):
            update_batched(masters, weights, names, update)  # float64 matmuls: faster than the kernel
        else:
            update_triton(masters, weights, names, update)

    def state(self) -> dict[str, torch.Tensor]:
        return self.flat.state()

    def checksum(self) -> str:
        """A fingerprint of θ's exact bits (`vrl.weights.flat.checksum`)."""
        return self.flat.checksum()

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.flat.load_state(state)


def perturbable(model: torch.nn.Module, spec: PerturbationSpec) -> FlatParams | LowRankParams:
    """The view of an in-process model that `spec`'s seeded perturbations move: `FlatParams` of the
    selected parameters (es.noise=full) or `LowRankParams` of the selected linear layers (lowrank);
    the weights move into flat buffers either way."""
    if spec.noise == "lowrank":
        return LowRankParams.from_model(model, spec.include, spec.exclude, spec.rank)
    return FlatParams(select_parameters(model, spec.include, spec.exclude))
