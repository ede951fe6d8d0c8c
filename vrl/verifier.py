"""The Verifier interface: judge a batch of attempts, concurrently, without ever raising for one.

A verifier runs (or inspects) text written by a model that is being optimised to make it say yes.
Isolation and integrity are the verifier's job (see docs/concepts.md); this module fixes the
contract the loop relies on and gives two helpers: `SimpleVerifier` for cheap synchronous checks and
`verify_safely`, which turns a verifier's own failure into `crashed` verdicts so no batch is lost.

A verdict made from the verifier's own failure (its `check` or `verify` raised, or it broke the
contract) has a `detail` that starts with `VERIFIER_ERROR`; `verifier_error` makes one and
`is_verifier_error` tells it from an attempt that crashed on its own (a sandboxed program that died).
The trainer stops a run whose every verdict of an iteration is such an error: the verifier is broken.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from vrl.errors import UsageError, describe
from vrl.types import Attempt, Status, Verdict


class VerifierUnavailable(UsageError, RuntimeError):
    """The verifier cannot work at all (its server is down or unreachable); the message says how to fix it."""


VERIFIER_ERROR = "verifier error: "
"""How the `detail` of a verdict made from the verifier's own failure begins (and no other verdict's)."""


def verifier_error(failure: BaseException | str, elapsed_s: float = 0.0) -> Verdict:
    """A `crashed` verdict for a failure of the verifier itself, not of the attempt.

    `failure` is the exception the verifier's code raised (the detail gets its type, message and the
    line it was raised on) or a sentence. Use it wherever a verifier catches its own bug, so the
    trainer can tell a broken verifier from attempts that crash.
    """
    text = describe(failure) if isinstance(failure, BaseException) else failure
    return Verdict.fail(Status.CRASHED, VERIFIER_ERROR + text, elapsed_s=elapsed_s)


def is_verifier_error(verdict: Verdict) -> bool:
    """Whether `verdict` was made from the verifier's own failure (see `verifier_error`)."""
    return verdict.status is Status.CRASHED and verdict.detail.startswith(VERIFIER_ERROR)


class Verifier(ABC):
    """Judges attempts. `verify` returns exactly one verdict per attempt, in order."""

    name: str = "verifier"

    @abstractmethod
    async def verify(self, attempts: Sequence[Attempt]) -> list[Verdict]:
        """Judge a batch. A bad attempt becomes a verdict (failed, timeout, crashed, rejected)."""

    async def check_ready(self) -> None:
        """Raise `VerifierUnavailable` if the verifier cannot judge anything now (its server is down...).

        Called once before the first generation (train, eval, verify), so a missing server costs
        seconds instead of a run of `crashed` verdicts, and again during training when a whole
        iteration crashed. The message says how to bring the verifier up. Default: always ready.
        """

    async def aclose(self) -> None:
        """Release servers, sandboxes or pools. Called once when the run ends."""


class SimpleVerifier(Verifier):
    """Base for verifiers whose check is a cheap, pure-Python function of one attempt.

    Subclasses implement `check`; batches run in a thread so the event loop stays responsive.
    Heavy or untrusted execution belongs in a sandboxed verifier, not here.
    """

    @abstractmethod
    def check(self, attempt: Attempt) -> Verdict:
        """Judge one attempt."""

    def _check_timed(self, attempt: Attempt) -> Verdict:
        start = time.perf_counter()
        try:
            verdict = self.check(attempt)
        except Exception as exc:  # a checker bug costs this verdict; the trainer stops if it costs them all
            verdict = verifier_error(exc)
        if not verdict.elapsed_s:
            verdict = verdict.model_copy(update={"elapsed_s": time.perf_counter() - start})
        return verdict

    async def verify(self, attempts: Sequence[Attempt]) -> list[Verdict]:
        return await asyncio.to_thread(lambda: [self._check_timed(a) for a in attempts])


def down_after_crashes(verdicts: Sequence[Verdict], check_ready: Callable[[], None]) -> VerifierUnavailable | None:
    """Whether the verifier behind `verdicts` is down: at least half of them crashed and `check_ready`
    raises VerifierUnavailable. The error to raise then (saying how many crashed), or None. One rule for
    rank 0's own iteration (`Trainer._check_verifier_alive`) and a follower rank's share (`sample_calls`)."""
    crashed = sum(v.status is Status.CRASHED for v in verdicts)
    if not verdicts or crashed * 2 < len(verdicts):
        return None
    try:
        check_ready()
    except VerifierUnavailable as exc:
        return VerifierUnavailable(f"{crashed} of {len(verdicts)} verdicts crashed and the verifier is down: {exc}")
    return None


def ensure_ready(verifier: Verifier) -> None:
    """Run `verifier.check_ready()` from synchronous code, then release what the check opened.

    Use a verifier made for the check: its connections belong to the event loop made here.
    """

    async def check() -> None:
        try:
            await verifier.check_ready()
        finally:
            await verifier.aclose()

    asyncio.run(check())


def close_unused(verifier: Verifier) -> None:
    """Release a verifier built but not used (to check its options, or one a runtime replaces with its
    own sandboxes) from synchronous code; a failure to close is logged, never raised."""
    try:
        asyncio.run(verifier.aclose())
    except Exception as exc:  # noqa: BLE001 - closing an unused verifier must not stop the run
        logging.getLogger(__name__).debug("closing an unused verifier: %s", exc)


async def verify_safely(verifier: Verifier, attempts: Sequence[Attempt], timeout_s: float | None = None) -> list[Verdict]:
    """Run `verifier.verify`, guaranteeing one verdict per attempt whatever the verifier does.

    An exception, a wrong-length answer or a batch that overruns `timeout_s` becomes a verdict for
    every attempt in the batch (crashed or timeout) with the reason in `detail`; a crash here is the
    verifier's own failure (`is_verifier_error`), a timeout is not.
    """
    if not attempts:
        return []
    start = time.perf_counter()
    try:
        verdicts = await asyncio.wait_for(verifier.verify(attempts), timeout_s)
    except asyncio.TimeoutError:
        elapsed = time.perf_counter() - start
        return [Verdict.fail(Status.TIMEOUT, f"verifier batch exceeded {timeout_s:g} s", elapsed_s=elapsed) for _ in attempts]
    except Exception as exc:
        elapsed = time.perf_counter() - start
        msg = f"verifier {verifier.name!r} raised {describe(exc)}"
        return [verifier_error(msg, elapsed_s=elapsed) for _ in attempts]
    if len(verdicts) != len(attempts):
        msg = f"verifier {verifier.name!r} returned {len(verdicts)} verdicts for {len(attempts)} attempts"
        return [verifier_error(msg) for _ in attempts]
    return list(verdicts)
