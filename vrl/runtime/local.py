"""The local runtime: sampling engines on this machine (CPU or local GPUs), the verifier on a background loop.

`runtime.local.engines` engines of the run's backend (each with its own copy of the weights) are
dealt over `runtime.local.gpus`; one engine is the default. Several engines form a `HostPool`. With
`runtime.local.driver_processes` each engine is driven from a process of its own
(`vrl.runtime.driver`), so engines do not compete with each other or the loop for one interpreter.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from vrl.config import Section
from vrl.errors import DeviceUnavailable, UsageError
from vrl.generate import generator_class, make_generator
from vrl.policy import HostNeeds, PolicyHost, share_needs
from vrl.runtime.base import Runtime, VerificationPool
from vrl.runtime.driver import ELSEWHERE, DriverHost
from vrl.runtime.pool import HostPool
from vrl.verifier import Verifier


class LocalConfig(Section):
    """The local runtime (`runtime.kind: local`): engines in this process, on this machine's CPU or GPUs."""

    engines: int = Field(
        1, ge=1,
        description="Sampling engines, each with its own copy of the weights: ES deals its members over them, "
        "GRPO shards the tasks and publishes trained weights to all.",
    )
    gpus: list[int] | None = Field(
        None,
        description="GPU indices the engines are dealt over (round-robin); vllm engines sharing a GPU split "
        "generator.vllm.gpu_memory_utilization evenly. None: one GPU (vllm) or generator.device (hf).",
    )
    driver_processes: bool = Field(
        False,
        description="Drive each engine from a process of its own (commands, completions, seeded updates and trained "
        "weights in shared memory cross), so the engines' Python-side work does not compete for one interpreter "
        "with each other and the loop; each child builds the run's environment from its plugin for multi-turn "
        "episodes. One engine per GPU. Off by default: it pays for GRPO "
        "under FSDP2 with an asynchronous loop and the engine on a GPU of its own (docs/vllm.md).",
    )


def placement(local: LocalConfig) -> list[str | None]:
    """The GPU of each of the `runtime.local.engines` engines: `gpus` dealt round-robin (None: the
    backend's own device)."""
    gpus: list[str | None] = [str(i) for i in local.gpus] if local.gpus else [None]
    return [gpus[i % len(gpus)] for i in range(local.engines)]


def refuse_trained(moves: str, config: Any) -> None:
    """Driver processes serve trained weights (GRPO) only where the backend samples weights trained in
    another process (`Generator.trains_elsewhere`); otherwise the setting is refused in one line."""
    backend = config.generator.backend
    if moves == "trained" and not generator_class(backend).trains_elsewhere:
        raise UsageError(f"runtime.local.driver_processes: optimizer={config.optimizer} trains weights that generator "
                         f"backend {backend!r} can take only in the training process (its own weight transports); "
                         "set runtime.local.driver_processes=false")


class LocalRuntime(Runtime):
    name = "local"
    Config = LocalConfig
    runs_episodes = True  # when its generator backend does (`Generator.runs_episodes`)

    @classmethod
    def episodes_elsewhere(cls, config: Any) -> tuple[str, str] | None:
        return ELSEWHERE if config.runtime.local.driver_processes else None

    def __init__(self, config: Any = None):
        """Nothing to start until `policy`: engines follow the config they are given there."""

    @classmethod
    def from_config(cls, config: Any) -> LocalRuntime:
        return cls(config)

    @classmethod
    def check(cls, config: Any) -> None:
        """The model can be loaded and the devices the run names exist on this machine."""
        from vrl.generate.hf import resolve_device
        from vrl.hub import check_model

        check_model(config.model, config.generator.revision)
        device = resolve_device(config.generator.device)
        local = config.runtime.local
        gpus = local.gpus
        if local.driver_processes:  # refused here, before the run directory is written
            from vrl.optim import optimizer_class

            refuse_trained(optimizer_class(config.optimizer).moves, config)
            placed = placement(local) if gpus else None
            if (len(set(placed)) < len(placed)) if placed else (local.engines > 1 and device.type == "cuda"):
                # Each driver process would size its engine as if it were alone on the GPU.
                raise UsageError(f"runtime.local.driver_processes needs one engine per GPU, but {local.engines} "
                                 f"engines would share {f'runtime.local.gpus={gpus}' if gpus else 'one GPU'}; list "
                                 "as many distinct GPUs as engines in runtime.local.gpus, or set "
                                 "runtime.local.driver_processes=false")
        if gpus:
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            missing = [i for i in gpus if not 0 <= i < count]
            if missing:
                have = f"{count} CUDA GPU(s), numbered 0..{count - 1}" if count else "no CUDA GPU"
                raise DeviceUnavailable(f"runtime.local.gpus={gpus} names GPU {missing[0]}, but this machine has "
                                        f"{have}; list GPUs it has, or leave runtime.local.gpus unset")

    def policy(self, config: Any, needs: HostNeeds | None = None) -> PolicyHost:
        local = config.runtime.local
        if local.driver_processes and needs is not None:
            refuse_trained(needs.moves, config)
        if local.engines == 1 and not local.gpus and not local.driver_processes:
            return make_generator(config, needs)
        placed = placement(local)
        if local.driver_processes:
            hosts: list[PolicyHost] = list(DriverHost.start(config, share_needs(needs, len(placed)), placed))
        else:
            hosts = list(generator_class(config.generator.backend).engines(config, share_needs(needs, len(placed)), placed))
        if len(hosts) == 1:  # one engine placed on a GPU is that engine: a pool would draw a streamed push whole
            return hosts[0]
        return HostPool(hosts, granule=config.sampling.batch_size)

    def verification(self, verifier: Verifier, config: Any, attempts_per_iteration: int | None = None) -> VerificationPool:
        v = config.verifier
        return VerificationPool(verifier, batch_size=v.batch_size, concurrency=v.concurrency, timeout_s=v.timeout_s)
