"""A generator backend with canned completions: the policy is a softmax over a fixed list of texts.

Its weights are one logit per completion, held in a torch module, so seeded perturbations (ES,
random search) move them exactly as they move a language model's weights; a run learns which
completion the verifier likes. No model, no tokenizer, no GPU: a backend in about 60 lines.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from pydantic import Field

import vrl
from vrl.config import Section
from vrl.policy import HostNeeds, PerturbationSpec
from vrl.weights.lowrank import perturbable

DEFAULT = ["abcdefghijklmnop", "hello world", "xyz xyz xyz", "<answer>1 + 2</answer>"]


class CannedConfig(Section):
    """The `canned` backend (`generator.backend: canned`): a softmax over fixed completions."""

    completions: list[str] = Field(default_factory=lambda: list(DEFAULT), min_length=1,
                                   description="The texts the policy chooses among.")


class CannedGenerator(vrl.Generator):
    """Samples completion k with probability softmax(logits / temperature)[k]; greedy at temperature 0."""

    name = "canned"
    Config = CannedConfig

    def __init__(self, completions: Sequence[str], sampling: Any):
        self.completions, self.sampling = list(completions), sampling
        self.model = torch.nn.Module()
        self.model.logits = torch.nn.Parameter(torch.zeros(len(self.completions)))

    @classmethod
    def from_config(cls, config: Any, needs: HostNeeds | None = None, *, gpu: str | None = None) -> CannedGenerator:
        return cls(config.generator.canned.completions, config.sampling)

    def _perturbable(self, spec: PerturbationSpec) -> Any:
        return perturbable(self.model, spec)  # the flat fp32 master θ every in-process backend uses

    def stream(self, tasks: Sequence[vrl.Task], n: int = 1, variant: int = 0, seed: int | None = None
               ) -> Iterator[list[vrl.Completion]]:
        temperature = self.sampling.temperature
        with torch.no_grad():
            logits = self.model.logits.detach().float()
            probs = torch.softmax(logits / temperature, dim=0) if temperature > 0 else None
        size = self.sampling.batch_size
        for start in range(0, len(tasks), size):
            batch = []
            for i, task in enumerate(tasks[start : start + size], start):
                if probs is None:
                    picks = [int(torch.argmax(logits))] * n
                else:  # task i's samples are seeded from seed + i·n, as every backend's are
                    rng = torch.Generator().manual_seed(seed + i * n) if seed is not None else None
                    picks = torch.multinomial(probs, n, replacement=True, generator=rng).tolist()
                batch += [vrl.Completion(task_id=task.id, text=self.completions[k], variant=variant, sample=j,
                                         completion_tokens=len(self.completions[k])) for j, k in enumerate(picks)]
            yield batch
