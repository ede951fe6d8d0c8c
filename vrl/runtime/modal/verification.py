"""The trainer's verification pool over a `SandboxPool`, for which an infrastructure failure is no verdict.

Apart from sandbox.py so the sandboxes (which `vrl.environment` names for `modal_sandbox()`) do not
import the runtime layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from vrl.runtime.base import VerificationPool
from vrl.runtime.modal.sandbox import SandboxFailure, SandboxPool, SandboxUnavailable
from vrl.types import Attempt, Verdict
from vrl.verifier import Verifier, verify_safely


class SandboxVerification(VerificationPool):
    """The trainer's verification pool over a `SandboxPool`: as `VerificationPool`, except that an
    infrastructure failure (`SandboxFailure`, `SandboxUnavailable`) fails the batch's future, and so the
    iteration, with its one-line message, instead of becoming `crashed` verdicts that score 0.

    No outer timeout: the sandbox pool bounds every request and every start itself (a batch that is
    retried in fresh sandboxes takes longer than one request, and must not become `timeout` verdicts).
    """

    def __init__(self, pool: SandboxPool, batch_size: int = 64, concurrency: int = 4):
        super().__init__(pool, batch_size=batch_size, concurrency=concurrency, timeout_s=None)

    async def _judge(self, chunk: list[Attempt]) -> list[Verdict]:
        return await _judge(self.verifier, chunk)


async def _judge(pool: Verifier, chunk: list[Attempt]) -> list[Verdict]:
    """`verify_safely`, but an infrastructure failure raises instead of becoming verdicts."""
    failure: list[BaseException] = []

    class _Through(Verifier):
        name = pool.name

        async def verify(self, attempts: Sequence[Attempt]) -> list[Verdict]:
            try:
                return await pool.verify(attempts)
            except (SandboxFailure, SandboxUnavailable) as exc:
                failure.append(exc)
                raise

    verdicts = await verify_safely(_Through(), chunk)
    if failure:
        raise failure[0]
    return verdicts
