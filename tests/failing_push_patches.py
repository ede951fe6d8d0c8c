"""Rank 0's host fails to take the trained weights at its second push (not a test module), as an engine that
loses its GPU in the middle of a push: tests/test_grpo_fsdp.py runs a `vrl train` job with `patched()`
held around it on every rank (tests/torchrun_jobs.py, a job's `"patch"`).

The failing push draws one bucket of the stream, then raises; everything else is the real `vrl train`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from vrl.generate.hf import HFGenerator

publish = HFGenerator.publish


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """On rank 0, the second `HFGenerator.publish` inside the block fails half-way; the original back after."""
    pushes = [0]

    def failing(self, model):
        pushes[0] += 1
        if pushes[0] == 2:
            next(iter(model), None)
            raise RuntimeError("the engine lost its GPU in the middle of the push")
        return publish(self, model)

    if os.environ.get("RANK") == "0":
        HFGenerator.publish = failing
    try:
        yield
    finally:
        HFGenerator.publish = publish
