"""Which process of a `torchrun` launch this is, and the loop of the ranks that follow rank 0.

`torchrun --nproc-per-node K vrl train ...` starts K copies of `vrl train` (on each of N nodes with
`--nnodes N`). Rank 0 runs the trainer's loop as a single process would: it samples, verifies,
shapes, writes the run directory, the metrics and the console. Every other rank *follows*: it
builds the same model and optimizer and then does what rank 0's optimizer tells it (train on this
batch, save, load, stop), so the update itself (forward, backward, the AdamW step) runs on every
rank on its shard of the model (`vrl.optim.grpo_dist`; with LoRA, on its whole copy of the model and
adapter, data-parallel). Only GRPO trains this way; ES runs on one process (its workers are engines,
not ranks).

Standard library only at import: the trainer imports this module, and `import vrl` must not load torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

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


def check(config: Any) -> None:
    """Refuse a multi-process launch this run cannot use (one line, what to change)."""
    from vrl.errors import UsageError

    if world_size() <= 1:
        return
    if config.optimizer != "grpo":
        raise UsageError(f"a torchrun launch ({world_size()} processes) trains with optimizer=grpo only; "
                         f"optimizer={config.optimizer} runs as one process (start it without torchrun)")
    if config.grpo.sample_on_every_rank and config.grpo.max_staleness > 0:
        raise UsageError("grpo.sample_on_every_rank samples on every rank between training steps; it cannot run "
                         "with asynchronous rollouts: set grpo.max_staleness=0 or grpo.sample_on_every_rank=false")
    if config.generator.backend == "vllm" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        # An engine inside rank 0's own process would join (or start) rank 0's torch.distributed world.
        raise UsageError(f"a torchrun launch ({world_size()} processes) runs rank 0's vLLM engine in a process "
                         "of its own: unset VLLM_ENABLE_V1_MULTIPROCESSING=0")


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
    builds land there. (What the launch cannot train was refused by `check` when the `Trainer` was built.)"""
    if world_size() <= 1:
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def follow(config: Any) -> dict[str, Any]:
    """The whole life of a rank > 0: build the model and the optimizer as rank 0 does, then serve rank 0's
    commands until it stops the run. Returns a summary like `Trainer.run`'s (status only)."""
    import signal

    from vrl.generate import generator_class
    from vrl.optim import make_optimizer

    start()
    # Rank 0 decides when the run stops (Ctrl-C, or the SIGTERM torchrun passes on to every rank when it is
    # stopped): it still needs this rank to write the checkpoint of the last finished iteration, then sends
    # "stop". (If rank 0 is gone instead, torchrun's SIGKILL ends this rank 30 s later.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.getLogger("vrl").setLevel(logging.ERROR)  # rank 0 speaks for the run; errors still show
    optimizer = make_optimizer(config)
    if config.grpo.sample_on_every_rank:  # this rank samples too: an engine of the run's backend on its GPU
        import torch

        gpu = str(torch.cuda.current_device()) if torch.cuda.is_available() else None
        [host] = generator_class(config.generator.backend).engines(config, optimizer.needs(), [gpu])
        from vrl.plugins import registry

        environment = registry().environment(config.plugin, **config.env_options)
        if environment.multi_turn:  # its share of the batch is whole episodes, as rank 0's
            from vrl.episodes import Episodes

            host.episodes(Episodes(environment))
    else:
        # Only rank 0 samples: here the model is loaded for its weights alone, with the in-process backend
        # whatever rank 0 samples with (a vLLM engine per rank would hold GPU memory for nothing).
        host = generator_class("hf").from_config(config)
    try:
        optimizer.setup(host)
        optimizer.follow()
        optimizer.close()  # this rank's checkpoint writes finish, then the process group goes
    finally:
        host.close()
    return {"status": "finished", "rank": rank()}
