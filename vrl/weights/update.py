"""What an optimizer sends a host to change θ: a seeded update, typed, never tensors.

One kind per noise mode (`PerturbationSpec.noise`), each a frozen dataclass of tuples (hashable,
comparable, picklable):

- `FullRankUpdate(terms)`: θ ← θ + Σⱼ cⱼ·s(seedⱼ), summed in term order in fp32, where s is the
  integer noise of `vrl.weights.noise` and each (seed, c) coefficient has 14 significant bits, so
  every product is exact in fp32.
- `LowRankUpdate(terms, coeff, rank)`: θ ← θ + fp32(fp32(U)·coeff) with U = Σₜ multₜ·aₜ·bₜᵀ the
  exact integer sum of each seed's factor product (`vrl.weights.factors`) times its integer
  multiplier; one fp32 coefficient for all terms.

`Update` is either. `from_members` builds each from an ES iteration's members (seed, sign) and
their weights z; hosts apply them (`FlatParams.update`, `LowRankParams.update`, a vLLM engine's
workers). To cross a process (a vLLM engine's `collective_rpc`, a Modal call) an update travels as
its `to_wire` form, plain JSON data: {"kind": "full", "terms": [[seed, c], ...]} or {"kind":
"lowrank", "rank": r, "coeff": c, "terms": [[seed, mult], ...]}. JSON writes floats exactly (their
repr) and ints unbounded, so `update_from_wire(json.loads(json.dumps(u.to_wire()))) == u`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from vrl.weights import noise as nz
from vrl.weights.exact import Z_SCALE, check_bound, check_rank


@dataclass(frozen=True)
class FullRankUpdate:
    """θ ← θ + Σⱼ cⱼ·s(seedⱼ): (seed, coefficient of the integer noise) terms, applied in order."""

    terms: tuple[tuple[int, float], ...] = ()
    kind: ClassVar[Literal["full"]] = "full"

    def __bool__(self) -> bool:
        return bool(self.terms)

    @classmethod
    def from_members(cls, members: Sequence[tuple[int, int]], z: Sequence[float], alpha: float) -> FullRankUpdate:
        """The update Σᵢ (α/N)·zᵢ·signᵢ·ε(seedᵢ) of one iteration, from its members (seed, sign) and weights z.

        Members sharing a seed (antithetic pairs) are merged, so the noise is generated once per seed;
        coefficients are rounded to 14 significant bits, which keeps each product exact in fp32.
        """
        n = len(z)
        merged: dict[int, float] = defaultdict(float)
        for (seed, sign), zi in zip(members, z):
            merged[seed] += sign * zi
        terms = [(seed, nz.round_sig(alpha / n * w * nz.C, nz.SCALE_BITS)) for seed, w in merged.items()]
        return cls(tuple((seed, c) for seed, c in terms if c != 0.0))

    def to_wire(self) -> dict[str, Any]:
        """Plain JSON data (see the module docstring)."""
        return {"kind": self.kind, "terms": [[int(s), float(c)] for s, c in self.terms]}


@dataclass(frozen=True)
class LowRankUpdate:
    """θ ← θ + coeff·Σₜ multₜ·a(seedₜ)·b(seedₜ)ᵀ: integer multipliers per seed and one fp32 coefficient."""

    terms: tuple[tuple[int, int], ...]  # (seed, integer multiplier Σ signᵢ·Zᵢ over the members of that seed)
    coeff: float
    rank: int
    kind: ClassVar[Literal["lowrank"]] = "lowrank"

    def __bool__(self) -> bool:
        return bool(self.terms) and self.coeff != 0.0

    @classmethod
    def from_members(cls, members: Sequence[tuple[int, int]], z: Sequence[float], alpha: float, rank: int
                     ) -> LowRankUpdate:
        """The update α/N·Σᵢ zᵢ·signᵢ·Aᵢ·Bᵢᵀ/√r of one iteration, from its members (seed, sign) and stored z.

        Members sharing a seed (antithetic pairs) are merged, so each seed's product is formed once.
        The stored z have 4 decimals, so Zᵢ = round(zᵢ·10⁴) is an exact integer and the sum is exact
        (bounded by `check_bound`); the one coefficient is round14(α/N·10⁻⁴·C²/√r).
        """
        check_rank(rank)
        if len(members) != len(z):
            raise ValueError(f"{len(members)} members but {len(z)} weights z")
        merged: dict[int, int] = defaultdict(int)
        for (seed, sign), zi in zip(members, z):
            merged[seed] += sign * round(zi * Z_SCALE)
        terms = tuple((seed, w) for seed, w in merged.items() if w != 0)
        coeff = nz.round_sig(alpha / len(z) / Z_SCALE * nz.C * nz.C / math.sqrt(rank), nz.SCALE_BITS)
        check_bound(terms, rank)
        return cls(terms, coeff, rank)

    def to_wire(self) -> dict[str, Any]:
        """Plain JSON data (see the module docstring); multipliers stay ints."""
        return {"kind": self.kind, "rank": int(self.rank), "coeff": float(self.coeff),
                "terms": [[int(s), int(w)] for s, w in self.terms]}


Update = FullRankUpdate | LowRankUpdate


def update_from_wire(data: Mapping[str, Any]) -> Update:
    """The update whose `to_wire` form `data` is (after JSON, msgpack or pickle)."""
    kind = data.get("kind") if isinstance(data, Mapping) else None
    try:
        if kind == FullRankUpdate.kind:
            return FullRankUpdate(tuple((int(s), float(c)) for s, c in data["terms"]))
        if kind == LowRankUpdate.kind:
            if any(float(w) != int(w) for _, w in data["terms"]):
                raise ValueError("low-rank multipliers must be integers")
            return LowRankUpdate(tuple((int(s), int(w)) for s, w in data["terms"]), float(data["coeff"]),
                                 int(data["rank"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed {kind} update message: {exc}") from None
    raise ValueError(f"not an update message: {str(data)[:80]}; expected FullRankUpdate.to_wire() or "
                     "LowRankUpdate.to_wire() data")


def check_kind(update: Any, kind: str) -> None:
    """Raise a clear error unless `update` is an `Update` of `kind` (what a host set up for one noise mode got)."""
    if not isinstance(update, (FullRankUpdate, LowRankUpdate)):
        raise TypeError(f"expected a FullRankUpdate or LowRankUpdate, got {type(update).__name__} "
                        "(send updates as vrl.weights.update types, or their to_wire() data to a process boundary)")
    if update.kind != kind:
        raise ValueError(f"these update terms are not {'low-rank' if kind == 'lowrank' else 'full-rank'} terms: a "
                         f"host set up for es.noise={kind} got a {type(update).__name__}")
