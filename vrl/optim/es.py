"""Evolution Strategies (placeholder update rule until the full ES optimizer lands).

θ ← θ + α · (1/N) · Σ zᵢ εᵢ with εᵢ drawn per member and tensor from a seeded CPU generator and zᵢ
the z-scored member rewards. Restore copies the unperturbed weights back, so it is exact.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from vrl.optim.base import Optimizer, Variant
from vrl.types import Result


class ESConfig(BaseModel):
    """Evolution Strategies settings."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    population_size: int = Field(30, ge=2, description="Perturbed members N per iteration.")
    sigma: float = Field(1e-3, gt=0, description="Perturbation scale σ.")
    alpha: float | None = Field(None, gt=0, description="Step size α; default σ/2 (the paper's convention).")


class ES(Optimizer):
    name = "es"

    def __init__(self, config: ESConfig, seed: int = 0):
        self.config, self.seed = config, seed
        self.history: list[list[tuple[int, float]]] = []

    @property
    def alpha(self) -> float:
        return self.config.alpha if self.config.alpha is not None else self.config.sigma / 2

    def setup(self, generator) -> None:
        super().setup(generator)
        self.params = dict(generator.model.named_parameters())

    def _noise(self, seed: int, index: int, param: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return torch.randn(param.shape, generator=g, dtype=torch.float32)

    def ask(self) -> list[Variant]:
        base = (self.seed + 1) * 1_000_000 + len(self.history) * 1_000
        return [Variant(index=i, seed=base + i) for i in range(self.config.population_size)]

    @contextlib.contextmanager
    def activate(self, variant: Variant) -> Iterator[None]:
        saved = {name: p.detach().clone() for name, p in self.params.items()}
        try:
            with torch.no_grad():
                for i, (name, p) in enumerate(self.params.items()):
                    p.add_((self.config.sigma * self._noise(variant.seed, i, p)).to(p.dtype))
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(saved[name])

    def tell(self, results: list[Result]) -> dict[str, float]:
        variants = self.ask()
        rewards = torch.zeros(len(variants))
        counts = torch.zeros(len(variants))
        for r in results:
            rewards[r.completion.variant] += r.reward
            counts[r.completion.variant] += 1
        rewards = rewards / counts.clamp(min=1)
        std = rewards.std()
        z = (rewards - rewards.mean()) / std if std > 0 else torch.zeros_like(rewards)
        with torch.no_grad():
            for i, p in enumerate(self.params.values()):
                step = torch.zeros(p.shape, dtype=torch.float32)
                for v, zi in zip(variants, z.tolist()):
                    if zi:
                        step += zi * self._noise(v.seed, i, p)
                p.add_((self.alpha / len(variants) * step).to(p.dtype))
        self.history.append([(v.seed, float(zi)) for v, zi in zip(variants, z.tolist())])
        return {"es/member_reward_std": float(std), "es/member_reward_max": float(rewards.max())}

    def save(self, run_dir: Path) -> None:
        (run_dir / "es_history.json").write_text(json.dumps({"history": self.history}))

    def load(self, run_dir: Path) -> None:
        raise NotImplementedError("resume for the placeholder ES update rule is not implemented")
