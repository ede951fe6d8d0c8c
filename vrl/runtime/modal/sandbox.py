"""Verifier sandboxes: a pool of long-lived, warm sandboxes that judge batches of attempts.

Each sandbox runs `python -m vrl.runtime.modal.verify_server` (the plugin's own verifier, loaded
inside the sandbox) and speaks JSON lines over stdin/stdout; a plugin may add a sidecar server
(kimina-lean-server) that the verify server waits for. The pool is written against the abstract
`SandboxHandle`, so the same logic drives Modal Sandboxes (`ModalSandbox`) and local processes
(`ProcessSandbox`, used by the tests).

Pool rules: started lazily and all at once (a Lean REPL importing Mathlib costs seconds, so warm
sandboxes are reused); a sandbox that dies is restarted and its batch retried (`trials` tries in all);
a batch that still kills its sandbox is split in halves, so an attempt that kills the sandbox on its
own scores `crashed` without zeroing its neighbours; a batch of which nothing can be judged, while
nothing else is judged either, is an infrastructure failure (`SandboxFailure`), and so is a sandbox
that fails to start twice in a row (`SandboxUnavailable`): `SandboxVerification` (verification.py)
fails the iteration with them rather than score them as wrong answers (issue 25, defect 10). A batch
that overruns its timeout scores `timeout` and the sandbox is replaced (its state is unknown); a
sandbox older than its lifetime is replaced before Modal kills it; idle sandboxes are pinged every
`keepalive_s`, and a sandbox busy with a request (a batch, its start-up) gets a blank line on its stdin
as often, so Modal's `idle_timeout` (stdin writes are activity, the work of its process is not) ends
only the sandboxes of an orchestrator that died. `per_attempt` mode starts a fresh sandbox for every
attempt instead.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from vrl.environment import SandboxSpec  # the type environments return (`Environment.modal_sandbox`)
from vrl.types import Attempt, Status, Verdict
from vrl.verifier import Verifier, VerifierUnavailable

log = logging.getLogger(__name__)

LINE_LIMIT = 64 * 1024 * 1024  # one response line carries a whole batch of verdicts


class SandboxDied(RuntimeError):
    """The sandbox's process ended (or its stream closed) while a request was in flight."""


class SandboxUnavailable(VerifierUnavailable):
    """A sandbox could not be started or did not become healthy in time (twice in a row). `reason`: what the
    sandbox's verify server said when it answered unhealthy (its verifier's own start-up error), if it did."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


class SandboxFailure(VerifierUnavailable):
    """The sandboxes, not the attempts, failed a batch: it died in fresh sandboxes on every try."""


def sandbox_memory_mb(spec: SandboxSpec, configured: int) -> int:
    """The sandbox's memory: `runtime.modal.sandbox_memory_mb`, raised to what the spec's sidecar needs
    (kimina-lean-server takes up to 8 GiB per REPL: four REPLs do not fit the default 8 GiB)."""
    if spec.memory_mb and spec.memory_mb > configured:
        log.warning("the %s sandbox needs %d MiB (runtime.modal.sandbox_memory_mb=%d): giving it %d MiB",
                    spec.plugin, spec.memory_mb, configured, spec.memory_mb)
        return spec.memory_mb
    return configured


def spec_for(environment: Any, plugin: str, options: dict[str, Any]) -> SandboxSpec:
    """The environment's own sandbox (`Environment.modal_sandbox()`), or the default (it returns None):
    its verifier, no network."""
    spec = environment.modal_sandbox()
    if spec is None:
        return SandboxSpec(plugin=plugin, options=dict(options))
    if isinstance(spec, Mapping):
        spec = SandboxSpec(**{"plugin": plugin, "options": options, **spec})
        if not isinstance(spec.warmup, tuple) or not isinstance(spec.apt, tuple):
            spec = replace(spec, warmup=tuple(spec.warmup), apt=tuple(spec.apt))
    if not isinstance(spec, SandboxSpec):
        raise TypeError(f"{plugin}: modal_sandbox() must return a SandboxSpec, a dict or None, got {type(spec).__name__}")
    return spec


# -- handles ------------------------------------------------------------------------------------------


class SandboxHandle(ABC):
    """One sandbox: start it, exchange lines with its verify server, stop it."""

    started_at: float = 0.0

    @abstractmethod
    async def start(self) -> None:
        """Launch the sandbox (returns once launched; readiness is a ping away)."""

    @abstractmethod
    async def send(self, line: str) -> None:
        """Write one request line to the verify server."""

    @abstractmethod
    async def receive(self) -> str:
        """Read one response line; raise `SandboxDied` if the stream ended."""

    @abstractmethod
    async def stop(self) -> None:
        """Terminate the sandbox and release what it holds; safe to call twice."""

    @abstractmethod
    async def running(self) -> bool:
        """Whether the sandbox is still alive (a coroutine: asking Modal is a round trip)."""

    def describe(self) -> str:
        return type(self).__name__


def _scrubbed_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A minimal environment for a local sandbox: no tokens or credentials from this process."""
    keep = ("PATH", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(PYTHONUNBUFFERED="1", HOME=os.environ.get("TMPDIR", "/tmp"))
    env.update(extra or {})
    return env


class ProcessSandbox(SandboxHandle):
    """A local child process standing in for a sandbox (same command, same protocol, scrubbed env)."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None):
        self.argv, self.env, self.cwd = list(argv), _scrubbed_env(env), cwd
        self._proc: asyncio.subprocess.Process | None = None
        self._stderr: collections.deque[str] = collections.deque(maxlen=40)
        self._drain: asyncio.Task | None = None

    @classmethod
    def for_spec(cls, spec: SandboxSpec, wait_timeout_s: float = 600.0) -> ProcessSandbox:
        return cls(spec.command(sys.executable, wait_timeout_s), env=spec.env, cwd=spec.workdir)

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=self.env, cwd=self.cwd, limit=LINE_LIMIT,
            start_new_session=True,  # a stop kills the whole group (sidecar included)
        )
        self.started_at = time.monotonic()
        self._drain = asyncio.create_task(self._keep_stderr(self._proc))

    async def _keep_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            self._stderr.append(raw.decode(errors="replace").rstrip())

    async def send(self, line: str) -> None:
        proc = self._require()
        try:
            proc.stdin.write(line.encode() + b"\n")  # type: ignore[union-attr]
            await proc.stdin.drain()  # type: ignore[union-attr]
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise SandboxDied(self._why("its stdin closed")) from exc

    async def receive(self) -> str:
        proc = self._require()
        raw = await proc.stdout.readline()  # type: ignore[union-attr]
        if not raw:
            await asyncio.sleep(0.05)  # let the exit status and last stderr lines arrive
            raise SandboxDied(self._why("its output ended"))
        return raw.decode()

    def _why(self, what: str) -> str:
        code = self._proc.returncode if self._proc else None
        tail = " | ".join(list(self._stderr)[-3:])
        return f"local sandbox {what} (exit code {code}){': ' + tail if tail else ''}"

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
        await proc.wait()
        if self._drain is not None:
            self._drain.cancel()
        for stream in (proc.stdin,):
            if stream is not None:
                stream.close()

    async def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def _require(self) -> asyncio.subprocess.Process:
        if self._proc is None:
            raise SandboxDied("local sandbox is not started")
        return self._proc

    def describe(self) -> str:
        return f"process {self._proc.pid if self._proc else '-'}"


STDIN_CHUNK_CHARS = 512 * 1024
"""Characters per stdin write to a Modal sandbox: at most 4 bytes each in UTF-8, so at most 2 MiB."""


class ModalSandbox(SandboxHandle):
    """A Modal Sandbox running the verify server (exercised on the Modal emulator, tests/modal_emulator)."""

    def __init__(self, app: Any, image: Any, argv: Sequence[str], *, cpu: float, memory_mb: int, timeout_s: int,
                 block_network: bool, workdir: str | None = None, env: dict[str, str] | None = None,
                 idle_timeout_s: int | None = None):
        self.app, self.image, self.argv = app, image, list(argv)
        # idle_timeout: a sandbox whose stdin nobody writes (its orchestrator died) ends on its own; a live
        # pool pings idle sandboxes more often than that (SandboxPool keepalive_s).
        self.options = {"cpu": cpu, "memory": memory_mb, "timeout": timeout_s, "block_network": block_network,
                        "workdir": workdir, "env": env or None, "idle_timeout": idle_timeout_s}
        self._sb: Any = None
        self._chunks: Any = None
        self._buffer = ""

    async def start(self) -> None:
        import modal

        # No secrets are passed: the sandbox runs model-written code.
        self._sb = await modal.Sandbox.create.aio(*self.argv, app=self.app, image=self.image, **self.options)
        self._chunks = self._sb.stdout.__aiter__()
        self._buffer = ""
        self.started_at = time.monotonic()

    async def send(self, line: str) -> None:
        # Modal's sandbox stdin holds at most 2 MiB between drains (modal/io_streams.py MAX_BUFFER_SIZE); a
        # batch of 64 long Lean attempts is about that size, so it goes in chunks, drained one by one.
        data = line + "\n"
        try:
            for start in range(0, len(data), STDIN_CHUNK_CHARS):
                self._sb.stdin.write(data[start : start + STDIN_CHUNK_CHARS])
                await self._sb.stdin.drain.aio()
        except Exception as exc:  # the client raises several types once the sandbox is gone
            raise SandboxDied(f"Modal sandbox stdin failed: {exc}") from exc

    async def receive(self) -> str:
        while "\n" not in self._buffer:
            try:
                self._buffer += await self._chunks.__anext__()
            except StopAsyncIteration:
                raise SandboxDied(f"Modal sandbox output ended (exit code {self._sb.returncode})") from None
        line, self._buffer = self._buffer.split("\n", 1)
        return line

    async def stop(self) -> None:
        sb, self._sb = self._sb, None
        if sb is not None:
            try:
                await sb.terminate.aio()
            except Exception as exc:  # noqa: BLE001 - already gone
                log.debug("terminating sandbox: %s", exc)

    async def running(self) -> bool:
        # The async interface: the blocking `poll()` would stall the pool's event loop for one round trip
        # (Modal warns AsyncUsageWarning).
        return self._sb is not None and await self._sb.poll.aio() is None

    def describe(self) -> str:
        return f"modal sandbox {getattr(self._sb, 'object_id', '-')}"


# -- the pool ------------------------------------------------------------------------------------------


def pool_size(attempts_per_iteration: int, batch_size: int, concurrency: int, fixed: int = 0) -> int:
    """Sandboxes to keep: `fixed`, or as many as batches can be in flight (at most `concurrency`)."""
    if fixed > 0:
        return fixed
    batches = -(-attempts_per_iteration // batch_size)
    return max(1, min(concurrency, batches))


class _Slot:
    """A pool position: the current handle in it, and its request counter."""

    def __init__(self, index: int):
        self.index, self.handle, self.ids = index, None, itertools.count(1)
        self.beats = 0  # keep-alive lines written during requests

    async def request(self, payload: dict[str, Any], timeout_s: float, keepalive_s: float | None = None
                      ) -> dict[str, Any]:
        """Send one request and wait (at most `timeout_s`) for its answer; meanwhile, every `keepalive_s`, a
        blank line to the sandbox's stdin. Modal counts only stdin writes (and exec) as a sandbox's activity
        ("Idle Timeouts", modal.com/docs/guide/sandbox), not the work of its process: a batch, or a Lean
        warm-up, longer than the idle timeout would otherwise end the sandbox under it. The verify server
        skips blank lines."""
        rid = next(self.ids)
        await self.handle.send(json.dumps({"id": rid, **payload}))

        async def answer() -> dict[str, Any]:
            while True:
                line = await self.handle.receive()
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    log.debug("sandbox %d: ignoring non-protocol line %r", self.index, line[:200])
                    continue
                if msg.get("id") == rid:
                    return msg

        beat = asyncio.create_task(self._beat(keepalive_s)) if keepalive_s else None
        try:
            return await asyncio.wait_for(answer(), timeout_s)
        finally:
            if beat is not None:
                beat.cancel()
                await asyncio.gather(beat, return_exceptions=True)

    async def _beat(self, every_s: float) -> None:
        handle = self.handle
        while True:
            await asyncio.sleep(every_s)
            try:
                await handle.send("")
            except SandboxDied:
                return  # the answer's wait sees the end too
            self.beats += 1


class SandboxPool(Verifier):
    """A Verifier that sends each batch to a warm sandbox, restarting sandboxes that die or hang."""

    name = "sandbox-pool"

    def __init__(
        self,
        factory: Callable[[], SandboxHandle],
        size: int,
        *,
        mode: str = "pool",
        request_timeout_s: float = 600.0,
        start_timeout_s: float = 600.0,
        lifetime_s: float | None = None,
        trials: int = 2,
        keepalive_s: float | None = None,
    ):
        if size < 1:
            raise ValueError("a sandbox pool needs at least one sandbox")
        if mode not in ("pool", "per_attempt"):
            raise ValueError(f"sandbox mode {mode!r}; choose pool or per_attempt")
        self.factory, self.size, self.mode = factory, size, mode
        self.request_timeout_s, self.start_timeout_s, self.lifetime_s = request_timeout_s, start_timeout_s, lifetime_s
        self.trials = max(1, trials)  # tries of a batch in fresh sandboxes before it is split
        self.keepalive_s = keepalive_s  # ping idle sandboxes this often (their idle_timeout must not end them)
        self._keepalive: asyncio.Task | None = None
        self._unreported_starts: list[float] = []  # seconds each sandbox took to become ready, not yet in metrics
        self.stats = {"starts": 0, "restarts": 0, "crashes": 0, "timeouts": 0, "batches": 0, "judged": 0,
                      "attempt_crashes": 0, "failures": 0, "keepalives": 0}
        self._slots = [_Slot(i) for i in range(size)]
        self._idle: asyncio.Queue[_Slot] | None = None
        self._started = False
        self._start_lock: asyncio.Lock | None = None
        self._sem: asyncio.Semaphore | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every sandbox of the pool at once and wait until each answers a ping."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            self._idle = asyncio.Queue()
            results = await asyncio.gather(*(self._boot(s) for s in self._slots), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            for slot in self._slots:
                self._idle.put_nowait(slot)  # a failed slot is rebooted when it is next used
            self._started = True
            if self.keepalive_s:
                self._keepalive = asyncio.create_task(self._keep_alive())
            if len(failed) == len(self._slots):
                raise SandboxUnavailable(f"no verifier sandbox started: {failed[0]}", getattr(failed[0], "reason", None))
            for exc in failed:
                log.warning("a verifier sandbox failed to start (it will be retried): %s", exc)

    async def _boot(self, slot: _Slot) -> None:
        if slot.handle is not None:
            await slot.handle.stop()
        slot.handle = self.factory()
        slot.ids = itertools.count(1)
        self.stats["starts"] += 1
        t0 = time.monotonic()
        await slot.handle.start()
        try:
            reply = await slot.request({"op": "ping"}, self.start_timeout_s, self.keepalive_s)
        except asyncio.TimeoutError:
            await slot.handle.stop()
            raise SandboxUnavailable(f"sandbox {slot.index} was not healthy after {self.start_timeout_s:g} s") from None
        except SandboxDied as exc:
            await slot.handle.stop()
            raise SandboxUnavailable(f"sandbox {slot.index} died while starting: {exc}") from None
        if not reply.get("ok"):
            await slot.handle.stop()
            error = str(reply.get("error", reply))
            raise SandboxUnavailable(f"sandbox {slot.index} is unhealthy: {error}", error)
        ready_s = time.monotonic() - t0
        self._unreported_starts.append(ready_s)  # into the metrics of the next batch judged (`_measured`)
        log.info("verifier sandbox %d ready in %.1f s (%s)", slot.index, ready_s, slot.handle.describe())

    async def _restart(self, slot: _Slot, reason: str) -> None:
        """A fresh sandbox in the slot; a start that fails is tried once more, then `SandboxUnavailable`."""
        log.warning("restarting verifier sandbox %d: %s", slot.index, reason)
        self.stats["restarts"] += 1
        try:
            await self._boot(slot)
        except SandboxUnavailable as exc:
            log.warning("verifier sandbox %d failed to start (%s); trying once more", slot.index, exc)
            await self._boot(slot)

    def _expired(self, slot: _Slot) -> bool:
        return self.lifetime_s is not None and time.monotonic() - slot.handle.started_at > self.lifetime_s

    async def _keep_alive(self) -> None:
        """Ping every idle sandbox each `keepalive_s`: a live run's sandboxes stay up between batches, while
        those of a dead orchestrator reach their idle timeout and go away."""
        assert self._idle is not None
        while True:
            await asyncio.sleep(self.keepalive_s)
            for _ in range(self._idle.qsize()):
                try:
                    slot = self._idle.get_nowait()
                except asyncio.QueueEmpty:
                    break
                try:
                    if slot.handle is not None:
                        await slot.request({"op": "ping"}, self.start_timeout_s, self.keepalive_s)
                        self.stats["keepalives"] += 1
                except (SandboxDied, asyncio.TimeoutError) as exc:
                    log.info("verifier sandbox %d did not answer a keep-alive ping (%s); it restarts when next used",
                             slot.index, exc or "timeout")
                    await _stop(slot.handle)
                    slot.handle = None
                finally:
                    self._idle.put_nowait(slot)

    async def aclose(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            await asyncio.gather(self._keepalive, return_exceptions=True)
            self._keepalive = None
        await asyncio.gather(*(s.handle.stop() for s in self._slots if s.handle is not None), return_exceptions=True)
        self._started = False

    # -- judging ------------------------------------------------------------------------------------
    async def verify(self, attempts: Sequence[Attempt]) -> list[Verdict]:
        if self.mode == "per_attempt":
            return await self._per_attempt(attempts)
        await self.start()
        assert self._idle is not None
        slot = await self._idle.get()
        try:
            return await self._judge(slot, attempts)
        finally:
            self._idle.put_nowait(slot)

    async def _judge(self, slot: _Slot, attempts: Sequence[Attempt]) -> list[Verdict]:
        """Verdicts for a batch; raises `SandboxFailure` when the sandboxes, not the attempts, failed it.

        A batch whose sandbox dies on every try is split in halves, each tried on its own: an attempt
        that kills a fresh sandbox alone, while the sandboxes judge its neighbours (or other batches),
        crashed on its own and scores `crashed`; when nothing of the batch can be judged and nothing
        else was judged meanwhile, the failure is the infrastructure's, never a wrong answer.
        """
        self.stats["batches"] += 1
        judged_before = self.stats["judged"]
        verdicts = await self._try(slot, list(attempts))
        if verdicts is None:
            verdicts = await self._settle(slot, list(attempts), lambda: self.stats["judged"] > judged_before)
        if verdicts is None:
            self.stats["failures"] += 1
            raise SandboxFailure(
                f"the verifier sandboxes died on every try of a batch of {len(attempts)} attempt(s) "
                f"({self.trials} tries, then each half alone) and judged nothing else meanwhile: an infrastructure "
                "failure, not a verdict; the iteration is not scored (resume the run once Modal's sandboxes work)")
        return verdicts

    async def _try(self, slot: _Slot, attempts: list[Attempt]) -> list[Verdict] | None:
        """The batch judged in the slot's sandbox, restarted between tries; None if it died on every try."""
        payload = {"op": "verify", "attempts": [a.model_dump(mode="json") for a in attempts]}
        for trial in range(self.trials):
            if slot.handle is None or not await slot.handle.running():
                await self._restart(slot, "not running")
            elif self._expired(slot):
                await self._restart(slot, f"older than its lifetime ({self.lifetime_s:g} s)")
            start = time.monotonic()
            try:
                reply = await slot.request(payload, self.request_timeout_s, self.keepalive_s)
            except asyncio.TimeoutError:
                self.stats["timeouts"] += 1
                await self._restart(slot, f"a batch overran {self.request_timeout_s:g} s")
                elapsed = time.monotonic() - start
                return [Verdict.fail(Status.TIMEOUT, f"sandbox batch exceeded {self.request_timeout_s:g} s",
                                     elapsed_s=elapsed) for _ in attempts]
            except SandboxDied as exc:
                self.stats["crashes"] += 1
                log.warning("verifier sandbox %d died during a batch of %d (%s)%s", slot.index, len(attempts), exc,
                            "; retrying in a fresh one" if trial + 1 < self.trials else "")
                await _stop(slot.handle)
                slot.handle = None
                continue
            except asyncio.CancelledError:
                # The caller gave up mid-request: the stream is out of step, so replace the sandbox.
                await _stop(slot.handle)
                slot.handle = None
                raise
            if "verdicts" not in reply:
                raise RuntimeError(f"verifier sandbox error: {reply.get('error', reply)}")
            self.stats["judged"] += 1
            return self._measured([Verdict.model_validate(v) for v in reply["verdicts"]], time.monotonic() - start)
        return None

    def _measured(self, verdicts: list[Verdict], batch_s: float) -> list[Verdict]:
        """The batch's verdicts, the first carrying the pool's own counters (`Verdict.metrics`, summed per
        iteration into metrics.jsonl): this batch's seconds in its sandbox, and the start-up seconds of every
        sandbox that became ready since the last batch (import and warm-up included)."""
        if verdicts:
            starts, self._unreported_starts = self._unreported_starts, []
            verdicts[0].metrics.update({"modal/sandbox_batches": 1.0, "modal/sandbox_batch_s": batch_s})
            if starts:
                verdicts[0].metrics.update({"modal/sandbox_starts": float(len(starts)),
                                            "modal/sandbox_start_s": sum(starts)})
        return verdicts

    async def _settle(self, slot: _Slot, attempts: list[Attempt], judged: Callable[[], bool]) -> list[Verdict] | None:
        """Verdicts for a batch that killed its sandbox on every try: each half tried alone, and a half
        that dies again split further while anything else is being judged; None if nothing could be."""
        if len(attempts) == 1:
            if not judged():
                return None
            self.stats["attempt_crashes"] += 1
            return [Verdict.fail(Status.CRASHED, f"the verifier sandbox died {self.trials} times judging this attempt "
                                 "alone, while it judged others")]
        half = len(attempts) // 2
        parts = [attempts[:half], attempts[half:]]
        tried = [await self._try(slot, part) for part in parts]
        if all(t is None for t in tried) and not judged():
            return None
        out: list[Verdict] = []
        for part, verdicts in zip(parts, tried):
            if verdicts is None:
                verdicts = await self._settle(slot, part, judged)
                if verdicts is None:
                    return None
            out += verdicts
        return out

    async def _per_attempt(self, attempts: Sequence[Attempt]) -> list[Verdict]:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.size)

        async def one(attempt: Attempt) -> Verdict:
            async with self._sem:
                slot = _Slot(-1)
                try:
                    await self._boot(slot)
                    return (await self._judge(slot, [attempt]))[0]
                finally:
                    if slot.handle is not None:
                        await slot.handle.stop()

        return list(await asyncio.gather(*(one(a) for a in attempts)))


async def _stop(handle: SandboxHandle | None) -> None:
    if handle is not None:
        await handle.stop()
