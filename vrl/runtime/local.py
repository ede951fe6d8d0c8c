"""The local runtime: generator in-process (CPU or GPU), verifier on a background event loop."""

from __future__ import annotations

from vrl.generate import make_generator
from vrl.generate.base import Generator
from vrl.runtime.base import Runtime, VerificationPool
from vrl.verifier import Verifier


class LocalRuntime(Runtime):
    name = "local"

    def generator(self, config) -> Generator:
        return make_generator(config)

    def verification(self, verifier: Verifier, config) -> VerificationPool:
        v = config.verifier
        return VerificationPool(verifier, batch_size=v.batch_size, concurrency=v.concurrency, timeout_s=v.timeout_s)
