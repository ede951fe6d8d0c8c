"""The ask/tell contract every update rule implements.

One iteration of the loop::

    variants = optimizer.ask()                   # which policies to sample
    for v in variants:
        with optimizer.activate(v):              # the generator now holds v's weights
            completions += generator.generate(tasks, n=v.samples_per_task, variant=v.index)
    ... verify, shape ...
    metrics = optimizer.tell(results)            # update the policy from rewarded results

ES asks for N seeded perturbations with one sample each; GRPO asks for the current policy with G
samples per task. Everything else in the loop is shared.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vrl.generate.base import Generator
from vrl.types import Result


@dataclass(frozen=True)
class Variant:
    """One policy to sample this iteration."""

    index: int
    samples_per_task: int = 1
    seed: int | None = None  # ES: the member's noise seed
    sign: int = 1  # ES: +1 or -1 for antithetic pairs


class Optimizer(ABC):
    """An update rule. Subclasses keep their own state and persist it under the run directory."""

    name: str = "optimizer"

    def setup(self, generator: Generator) -> None:
        """Attach to the generator whose weights this optimizer moves. Called once before `ask`."""
        self.generator = generator

    @abstractmethod
    def ask(self) -> list[Variant]:
        """The policy variants to sample in this iteration."""

    @contextlib.contextmanager
    def activate(self, variant: Variant) -> Iterator[None]:
        """Make `variant` the generator's current policy for the duration of the block."""
        yield

    @abstractmethod
    def tell(self, results: list[Result]) -> dict[str, float]:
        """Update from this iteration's rewarded results; return metrics to log."""

    def save(self, run_dir: Path, final: bool = False) -> None:
        """Persist what `load` needs to continue exactly (called after every iteration).

        `final`: the run stops here (Ctrl-C or an error between two updates): write even what is
        otherwise written only every k iterations.
        """

    def load(self, run_dir: Path) -> None:
        """Restore the state saved by `save` (resume)."""

    def describe(self) -> dict[str, Any]:
        """Short description for logs and summaries."""
        return {"optimizer": self.name}
