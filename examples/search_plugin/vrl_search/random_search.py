"""Random search: sample N seeded perturbations of θ and θ itself, keep the best if it beats θ.

A complete update rule behind vrl's ask/tell contract, in one module. It moves weights the way ES
does (seeded perturbations through the host, `vrl.policy.PolicyHost`), so it runs on any backend and
runtime that ES runs on, and its state is a list of accepted seeds: resume replays them.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

from pydantic import Field

import vrl
from vrl.config import Section
from vrl.policy import HostNeeds, PerturbationSpec, PolicyHost
from vrl.weights.noise import noise_scale
from vrl.weights.update import FullRankUpdate

STATE = "random_search.json"


class RandomSearchConfig(Section):
    """Random search: keep the best of N seeded perturbations when it beats the current weights."""

    population_size: int = Field(8, ge=1, description="Perturbed members tried per iteration (θ itself is tried too).")
    sigma: float = Field(0.5, gt=0, description="Perturbation scale σ (standard deviation of each weight's noise).")
    include: list[str] = Field(default_factory=lambda: ["*"], description="fnmatch patterns of parameters to perturb.")
    exclude: list[str] = Field(default_factory=list, description="fnmatch patterns of parameters to leave untouched.")


class RandomSearch(vrl.Optimizer):
    """Each iteration: θ (variant 0) and N members θ + σ·ε(seedᵢ); θ moves to the best member if its
    mean reward beats θ's."""

    name = "random_search"
    Config = RandomSearchConfig
    # What it can do, which the loop, the launch and preflight ask (never its name):
    moves = "perturbations"  # seeded perturbations through the host, as ES: any backend and runtime ES runs on
    staleness = None  # no asynchronous rollouts: each iteration's members are drawn when it starts
    ranks = False  # one process; a torchrun launch is refused in one line
    fixed_on_resume = ("sigma", "include", "exclude")  # the accepted seeds mean θ only with these

    def __init__(self, config: RandomSearchConfig, seed: int = 0):
        self.config, self.seed = config, seed
        self.accepted: list[tuple[int, int]] = []  # (iteration, seed) of every member kept
        self._iteration = 0
        self._seeds: list[int] = []

    @classmethod
    def from_config(cls, config: Any) -> RandomSearch:
        return cls(config.random_search, seed=config.seed)

    def spec(self) -> PerturbationSpec:
        c = self.config
        return PerturbationSpec(tuple(c.include), tuple(c.exclude), c.sigma)

    def needs(self) -> HostNeeds:
        return HostNeeds(self.moves, self.spec(), variants=self.config.population_size + 1)

    def setup(self, host: PolicyHost) -> None:
        super().setup(host)
        host.perturbations(self.spec())

    @property
    def iteration(self) -> int:
        return self._iteration

    def ask(self) -> list[vrl.Variant]:
        rng = random.Random(f"random-search-{self.seed}-{self._iteration}")
        self._seeds = [rng.getrandbits(31) for _ in range(self.config.population_size)]
        center = vrl.Variant(index=0)
        return [center, *(vrl.Variant(index=i + 1, seed=s) for i, s in enumerate(self._seeds))]

    def tell(self, results: list[vrl.Result]) -> dict[str, float]:
        rewards: dict[int, list[float]] = defaultdict(list)
        for r in results:
            rewards[r.completion.variant].append(r.reward)
        mean = {v: sum(rs) / len(rs) for v, rs in rewards.items()}
        center = mean.get(0, float("-inf"))
        best = max((v for v in mean if v != 0), key=lambda v: mean[v], default=None)
        keep = best is not None and mean[best] > center
        if keep:
            seed = self._seeds[best - 1]
            self._move(seed)
            self.accepted.append((self._iteration, seed))
        self._iteration += 1
        return {"random_search/center_reward": center,
                "random_search/best_reward": mean[best] if best is not None else center,
                "random_search/accepted": float(keep)}

    def _move(self, seed: int) -> None:
        """θ ← θ + σ·ε(seed): exactly the member that was sampled."""
        self.host.update(FullRankUpdate(((seed, noise_scale(self.config.sigma)),)))

    def samples_per_task(self) -> int:
        return self.config.population_size + 1

    def save(self, run_dir: Path, final: bool = False) -> None:
        path = Path(run_dir) / STATE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"iteration": self._iteration, "accepted": self.accepted}))
        tmp.replace(path)

    def load(self, run_dir: Path, completed: int) -> None:
        path = Path(run_dir) / STATE
        if not path.exists():
            return
        state = json.loads(path.read_text())
        self.accepted = [(int(t), int(s)) for t, s in state["accepted"] if int(t) < completed]
        for _, seed in self.accepted:
            self._move(seed)
        self._iteration = min(completed, int(state["iteration"]))
