"""A `torchrun` launch, above the loop: what it refuses, and the loop of the ranks that follow rank 0.

`torchrun --nproc-per-node K vrl train ...` starts K copies of `vrl train` (on each of N nodes with
`--nnodes N`). Rank 0 runs the trainer's loop as a single process would: it samples, verifies,
shapes, writes the run directory, the metrics and the console. Every other rank *follows*: it
builds the same model and optimizer and then does what rank 0's optimizer tells it (sample and
verify this share, train on this batch, apply this update, save, load, stop), so the update itself
runs on every rank, and so does the verification of what each rank samples. Only a rule that
declares `Optimizer.ranks` trains this way (GRPO: each rank on its shard of the model,
`vrl.optim.grpo_dist`; ES: each rank samples its dealt members on its own engine and applies the
same seeded update to its whole θ, `vrl.optim.es`); the others run on one process.

Which process this is, and hiding the launch from processes a rank starts, sit below the optimizers
and engines in `vrl.distributed`; this module builds hosts and optimizers, so it sits beside the trainer.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from vrl.distributed import rank, start, world_size
from vrl.errors import UsageError
from vrl.generate import generator_class
from vrl.optim import make_optimizer, optimizer_class


def check(config: Any) -> None:
    """Refuse a multi-process launch this run cannot use (one line, what to change)."""
    if world_size() <= 1:
        return
    rule = optimizer_class(config.optimizer)
    if not rule.ranks:
        able = "|".join(n for n in getattr(type(config), "optimizers", ()) if optimizer_class(n).ranks)
        raise UsageError(f"a torchrun launch ({world_size()} processes) trains with optimizer={able or '?'} only; "
                         f"optimizer={config.optimizer} runs as one process (start it without torchrun)")
    rule.check_launch(config)
    if config.generator.backend == "vllm" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        # An engine inside rank 0's own process would join (or start) rank 0's torch.distributed world.
        raise UsageError(f"a torchrun launch ({world_size()} processes) runs rank 0's vLLM engine in a process "
                         "of its own: unset VLLM_ENABLE_V1_MULTIPROCESSING=0")


def follow(config: Any) -> dict[str, Any]:
    """The whole life of a rank > 0: build the model and the optimizer as rank 0 does, then serve rank 0's
    commands until it stops the run. Returns a summary like `Trainer.run`'s (status only)."""
    start()
    # Rank 0 decides when the run stops (Ctrl-C, or the SIGTERM torchrun passes on to every rank when it is
    # stopped): it still needs this rank to write the checkpoint of the last finished iteration, then sends
    # "stop". (If rank 0 is gone instead, torchrun's SIGKILL ends this rank 30 s later.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.getLogger("vrl").setLevel(logging.ERROR)  # rank 0 speaks for the run; errors still show
    optimizer = make_optimizer(config)
    verification = None
    if optimizer.samples_on_every_rank():  # this rank samples too: an engine of the run's backend on its GPU
        import torch

        gpu = str(torch.cuda.current_device()) if torch.cuda.is_available() else None
        [host] = generator_class(config.generator.backend).engines(config, optimizer.needs(), [gpu])
        from vrl import episodes
        from vrl.plugins import registry
        from vrl.runtime import runtime_class

        environment = registry().environment(config.plugin, **config.env_options)
        # its share of the batch is whole episodes where the environment answers back, as rank 0's
        episodes.attach(host, environment)
        runtime = runtime_class(config.runtime.kind)
        if runtime.verifies_in_process(config):
            # It verifies what it samples, with the run's verifier built from the same config, so rank 0
            # receives verdicts instead of verifying every rank's attempts after its own.
            attempts = config.tasks_per_iteration * optimizer.samples_per_task()
            verification = runtime.from_config(config).verification(environment.verifier(), config, attempts)
    else:
        # Only rank 0 samples: here the model is loaded for its weights alone, with the in-process backend
        # whatever rank 0 samples with (a vLLM engine per rank would hold GPU memory for nothing).
        host = generator_class("hf").from_config(config)
    try:
        optimizer.setup(host)
        optimizer.follow(verification)
        optimizer.close()  # this rank's checkpoint writes finish, then the process group goes
    finally:
        try:
            if verification is not None:
                verification.close()
        finally:
            host.close()
    return {"status": "finished", "rank": rank()}
