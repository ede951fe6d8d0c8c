"""The Generator interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from vrl.types import Completion, Task


class Generator(ABC):
    """Samples completions. `stream` yields one list per generation batch so the trainer can hand
    finished batches to the verifier while the next batch is being generated."""

    @abstractmethod
    def stream(
        self, tasks: Sequence[Task], n: int = 1, variant: int = 0, seed: int | None = None
    ) -> Iterator[list[Completion]]:
        """Yield completions (n per task, tagged with `variant`) one generation batch at a time."""

    def generate(
        self, tasks: Sequence[Task], n: int = 1, variant: int = 0, seed: int | None = None
    ) -> list[Completion]:
        """All completions for `tasks`, in task order, n per task."""
        return [c for batch in self.stream(tasks, n=n, variant=variant, seed=seed) for c in batch]

    def sync_weights(self) -> None:
        """Make sampling use the trainer's current weights (called after each update).

        In-process backends (`hf`) sample from the very module the optimizer updates: nothing to do.
        Backends with their own copy of the weights (vllm, remote workers) reload them here.
        """

    def close(self) -> None:
        """Free engines and memory."""


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` up to and including the earliest stop string, and whether one was found."""
    stopped = False
    for stop in stops:
        cut = text.find(stop)
        if cut >= 0:
            text, stopped = text[: cut + len(stop)], True
    return text, stopped


def tokens_covering(tokenizer: Any, ids: list[int], text: str) -> list[int]:
    """The shortest prefix of `ids` whose decoding is at least `text` long (binary search).

    Used after a stop string cut the text, so the token ids (what GRPO trains on) end where the
    text ends, whatever the backend's stop detection did.
    """
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= len(text):
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo]
