"""Which process of a `torchrun` launch this is, and the launch hidden from processes a rank starts.

Below the optimizers and engines, which ask it (the run directory, the vLLM host, GRPO's process
group). What a launch refuses and the loop of the ranks that follow rank 0 build hosts and
optimizers, so they live above them, beside the trainer (`vrl.launch`).

Standard library only at import: the trainer imports this module, and `import vrl` must not load torch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

# What torchrun exports to each rank (besides TORCHELASTIC_*), which a process a rank starts for its own
# use must not see: see `outside_launch`.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rank() -> int:
    """This process's global rank (0 outside a `torchrun` launch)."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """How many processes train together (1 outside a `torchrun` launch)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_follower() -> bool:
    """A rank > 0 of a multi-process launch: it writes nothing and runs no loop of its own."""
    return world_size() > 1 and rank() > 0


@contextlib.contextmanager
def outside_launch() -> Iterator[None]:
    """Inside the block, this process's environment is a standalone process's: what torchrun exported
    is hidden, and restored on leaving. For processes a rank starts for itself, which inherit the
    environment when they start: rank 0's vLLM engine. Its worker sets up a one-process torch.distributed
    group on a private port, and torchrun's TORCHELASTIC_USE_AGENT_STORE=True would make torch connect
    to that port as a client of the launcher's store, which nobody serves: the engine would wait until
    its timeout (10 min) before loading anything (seen on 2 GPUs; tests/test_distributed_env.py)."""
    hidden = {k: os.environ.pop(k) for k in [*LAUNCH_VARIABLES, *(k for k in os.environ if k.startswith("TORCHELASTIC_"))]
              if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


def start() -> None:
    """Before any model loads: give each rank of a GPU node its own GPU (`LOCAL_RANK`), so the models it
    builds land there. (What the launch cannot train was refused by `vrl.launch.check` when the `Trainer` was built.)"""
    if world_size() <= 1:
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
