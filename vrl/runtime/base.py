"""The Runtime interface and the verification pool that lets verification overlap generation."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel

from vrl.config import Section
from vrl.policy import HostNeeds, PolicyHost
from vrl.types import Attempt, Verdict, Verified
from vrl.verifier import Verifier, verify_safely


class Runtime(ABC):
    """Places the policy's hosts (engines) and the verification pool for a run; never the update rule.

    A runtime is registered by name (the `register_runtimes` hook) and selected with `runtime.kind`;
    its `Config` is the config section `runtime.<name>`, and `from_config` builds it for a run.
    """

    name: str = "runtime"
    #: Its settings: the config section `runtime.<name>` (a `vrl.config.Section`; none by default).
    Config: ClassVar[type[BaseModel]] = Section
    #: Whether the run's weights load on this machine: then the preflight checks the model and the
    #: devices here, and update rules check their settings against the model's module tree.
    weights_here: ClassVar[bool] = True
    #: Whether its hosts can run multi-turn episodes (`PolicyHost.episodes`); the preflight refuses a
    #: multi-turn environment on a runtime that cannot.
    runs_episodes: ClassVar[bool] = False

    @classmethod
    def episodes_elsewhere(cls, config: Any) -> tuple[str, str] | None:
        """Where a run's episodes run outside this process, as (who, the setting that keeps them here): those
        hosts build the run's environment from its plugin and options (`vrl.plugins.environment_wire`), so
        the preflight refuses one made in code. None: beside this process's engines."""
        return None

    @classmethod
    def from_config(cls, config: Any) -> Runtime:
        """The runtime for a run (a `TrainConfig`; its own section is `config.runtime.<name>`)."""
        return cls()

    @classmethod
    def check(cls, config: Any) -> None:
        """Refuse settings this runtime cannot run, in seconds and before anything starts (`vrl train`'s
        and `vrl eval`'s preflight): raise a `UsageError`, one line saying what to change."""

    @classmethod
    def verifies_in_process(cls, config: Any) -> bool:
        """Whether the verifier runs in this process (the trainer then checks it is up itself)."""
        return True

    @abstractmethod
    def policy(self, config, needs: HostNeeds | None = None) -> PolicyHost:
        """The host (or pool of hosts) that holds the weights and samples whole iterations.

        `needs`: what the update rule will ask of it (`Optimizer.needs`; None: sampling only, e.g. eval).
        """

    @abstractmethod
    def verification(self, verifier: Verifier | None, config, attempts_per_iteration: int | None = None
                     ) -> VerificationPool:
        """The pool that judges attempts; `attempts_per_iteration` lets a remote runtime size its sandboxes.
        `verifier` is the environment's, built here when `verifies_in_process(config)`, else None (the
        runtime runs the plugin's verifier itself, e.g. in Modal sandboxes)."""

    def close(self) -> None:
        """Release what the runtime started (called last)."""


class VerificationPool:
    """Runs a verifier on its own event loop in a background thread.

    `submit` returns at once with futures; the trainer keeps generating while batches are judged.
    At most `concurrency` verify() calls are in flight; each is bounded by `timeout_s`.
    """

    def __init__(self, verifier: Verifier, batch_size: int = 64, concurrency: int = 4, timeout_s: float | None = None):
        self.verifier, self.batch_size, self.timeout_s = verifier, batch_size, timeout_s
        self._concurrency = concurrency
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vrl-verify", daemon=True)
        self._thread.start()
        self._sem = asyncio.run_coroutine_threadsafe(self._make_semaphore(), self._loop).result()
        self._pending = 0
        self._busy_s = 0.0
        self._lock = threading.Lock()

    async def _make_semaphore(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self._concurrency)

    @property
    def busy_s(self) -> float:
        """Total wall time spent inside verify() calls so far (summed over concurrent calls)."""
        return self._busy_s

    @property
    def queue_depth(self) -> int:
        """Attempts submitted and not yet judged."""
        return self._pending

    def submit(self, attempts: Sequence[Attempt], verified: Verified | None = None
               ) -> list[tuple[list[Attempt], concurrent.futures.Future[list[Verdict]]]]:
        """Queue attempts in chunks of `batch_size`; returns (chunk, future of its verdicts) pairs.

        `verified`: the batch the attempts were made from, when it arrived judged where it was sampled
        (`vrl.types.Verified`: a rank > 0 of a torchrun launch verifies its own share): its verdicts are
        taken as they are (one done future) and its verifier's busy time counts into `busy_s`."""
        if verified is not None:
            if len(verified.verdicts) != len(attempts):
                raise ValueError(f"{len(verified.verdicts)} verdicts arrived for {len(attempts)} attempts")
            done: concurrent.futures.Future[list[Verdict]] = concurrent.futures.Future()
            done.set_result(list(verified.verdicts))
            with self._lock:
                self._busy_s += verified.busy_s
            return [(list(attempts), done)]
        futures = []
        for start in range(0, len(attempts), self.batch_size):
            chunk = list(attempts[start : start + self.batch_size])
            with self._lock:
                self._pending += len(chunk)
            futures.append((chunk, asyncio.run_coroutine_threadsafe(self._run(chunk), self._loop)))
        return futures

    async def _run(self, chunk: list[Attempt]) -> list[Verdict]:
        from vrl.episodes import judged_verdict

        # A repair episode's last turn was judged by the run's verifier already: its verdict is the attempt's.
        known = {i: v for i, a in enumerate(chunk) if (v := judged_verdict(a)) is not None}
        rest = [a for i, a in enumerate(chunk) if i not in known]
        try:
            if not rest:
                return [known[i] for i in range(len(chunk))]
            async with self._sem:
                start = time.perf_counter()
                try:
                    judged = iter(await self._judge(rest))
                    return [known[i] if i in known else next(judged) for i in range(len(chunk))]
                finally:
                    with self._lock:
                        self._busy_s += time.perf_counter() - start
        finally:
            with self._lock:
                self._pending -= len(chunk)

    async def _judge(self, chunk: list[Attempt]) -> list[Verdict]:
        """One chunk's verdicts: whatever the verifier does wrong becomes verdicts (`verify_safely`)."""
        return await verify_safely(self.verifier, chunk, self.timeout_s)

    def check_ready(self) -> None:
        """Raise `VerifierUnavailable` if the pool's verifier cannot judge anything now (`Verifier.check_ready`,
        run on the pool's own event loop, where the verifier's connections live)."""
        asyncio.run_coroutine_threadsafe(self.verifier.check_ready(), self._loop).result()

    def close(self) -> None:
        """Cancel what is pending, close the verifier, stop the loop."""
        if self._loop.is_closed():
            return

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.verifier.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=30)
        except Exception:  # closing must never mask the run's own outcome
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()
