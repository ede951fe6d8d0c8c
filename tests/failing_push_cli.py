"""`vrl train` whose rank-0 host fails to take the trained weights at its second push, started by `torchrun`
from tests/test_grpo_fsdp.py (not a test module): as an engine that loses its GPU in the middle of a push.

    torchrun --nproc-per-node 2 tests/failing_push_cli.py train …

The failing push draws one bucket of the stream, then raises; everything else is the real `vrl train`.
"""

from __future__ import annotations

import os

from vrl.cli import main
from vrl.generate.hf import HFGenerator

pushes = [0]
publish = HFGenerator.publish


def failing(self, model):
    pushes[0] += 1
    if pushes[0] == 2:
        next(iter(model), None)
        raise RuntimeError("the engine lost its GPU in the middle of the push")
    return publish(self, model)


if os.environ.get("RANK") == "0":
    HFGenerator.publish = failing

if __name__ == "__main__":
    main()
