"""The local runtime: sampling engines in this process (CPU or local GPUs), the verifier on a background loop.

`generator.engines` engines (each with its own copy of the weights) are dealt over `generator.gpus`;
one engine is the default. Several engines form a `HostPool`.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from typing import Any

from vrl.generate import make_generator
from vrl.policy import HostNeeds, PolicyHost
from vrl.runtime.base import Runtime, VerificationPool
from vrl.runtime.pool import HostPool
from vrl.verifier import Verifier


class LocalRuntime(Runtime):
    name = "local"

    def __init__(self, config: Any = None):
        """Nothing to start until `policy`: engines follow the config they are given there."""

    def policy(self, config: Any, needs: HostNeeds | None = None) -> PolicyHost:
        g = config.generator
        if g.engines == 1 and not g.gpus:
            return make_generator(config, needs)
        gpus = [str(i) for i in (g.gpus or [0])]
        placement = [gpus[i % len(gpus)] for i in range(g.engines)]
        sharing = Counter(placement)
        hosts = []
        cleanup = None
        try:
            if g.backend == "vllm":
                from vrl.generate.vllm import VLLMGenerator, save_tiny

                path = config.model
                if path == "tiny":  # written once for every engine
                    cleanup = path = save_tiny(tempfile.mkdtemp(prefix="vrl-tiny-"))
                for gpu in placement:
                    hosts.append(VLLMGenerator.from_config(
                        config, needs, gpu=gpu, memory_fraction=g.gpu_memory_utilization / sharing[gpu],
                        model_path=path))
                if cleanup:  # the first engine may load a trainable copy from it later; it removes it on close
                    hosts[0].adopt(cleanup)
                    cleanup = None
            else:
                from vrl.generate.hf import HFGenerator

                for gpu in placement:
                    device = g.device if not g.gpus else f"cuda:{gpu}"
                    hosts.append(HFGenerator.from_config(config, device=device))
        except BaseException:
            for h in hosts:
                h.close()
            raise
        finally:
            if cleanup:  # the engines loaded it
                shutil.rmtree(cleanup, ignore_errors=True)
        return HostPool(hosts, granule=config.sampling.batch_size)

    def verification(self, verifier: Verifier, config: Any, attempts_per_iteration: int | None = None) -> VerificationPool:
        v = config.verifier
        return VerificationPool(verifier, batch_size=v.batch_size, concurrency=v.concurrency, timeout_s=v.timeout_s)
