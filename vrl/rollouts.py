"""Asynchronous rollouts: sample and verify the next iterations while the rule trains on this one.

A rule that trains weights and declares a staleness setting (`Optimizer.staleness`: GRPO's
`grpo.max_staleness`; a plugin's rule names its own) runs this way when the setting is S > 0: a
producer thread runs the sampling passes (and hands their completions to the verification pool)
while the main thread waits for verdicts, shapes and trains::

    producer:  sample j+1 ─────┐ sample j+2 ──────┐ ...           (verification streams behind each pass)
    trainer:   train j ── publish ─ train j+1 ── publish ─ ...

The weights the producer samples change only by `publish`, never during a pass: the host is
`decouple`d (the trained model is a separate copy; a vLLM engine always is) and wrapped in a
`VersionedHost`, whose `publish` waits for the pass in flight. The schedule is fixed, so a run's
numbers do not depend on thread timing: the pass of iteration j samples the weights after update
max(start, j − S), and the publish of update v + 1 waits until the pass of iteration v + S has
finished. Each batch is therefore trained exactly min(j − start, S) updates after the weights that
sampled it (`Completion.weights_version`; checked before every update), and GRPO corrects for
that with the sampler's log-probs (`grpo.vllm_importance_sampling_*`).

Under torchrun the producer runs on rank 0 only and makes no collective call: every collective (the
update, the streamed push, checkpoints) stays on the main thread, whose order the other ranks follow.

S = 0 never comes here: the trainer runs its synchronous loop, unchanged.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vrl.errors import UsageError
from vrl.optim import optimizer_class
from vrl.policy import PolicyHost, Trainable, Variant
from vrl.types import Attempt, Completion, Task, Verdict

_POLL_S = 0.1  # how often a waiting thread looks for a stop or a failure on the other side


def staleness(config: Any) -> tuple[str, int]:
    """The run's asynchronous-rollouts setting, as (its dotted name, its value): how many updates sampling
    may run ahead of training. ("", 0) for a rule that declares none (`Optimizer.staleness`)."""
    field_ = optimizer_class(config.optimizer).staleness
    if field_ is None:
        return "", 0
    return f"{config.optimizer}.{field_}", int(getattr(getattr(config, config.optimizer), field_))


def asynchronous(config: Any) -> bool:
    """Whether a run samples ahead of its updates (its rule's `staleness` setting is > 0)."""
    return staleness(config)[1] > 0


def check(config: Any) -> None:
    """Refuse, before anything starts, an asynchronous run that cannot work (one line, what to change)."""
    for name in getattr(type(config), "optimizers", ()):  # another rule's setting, given to a run of this one
        other = optimizer_class(name).staleness
        if name != config.optimizer and other and getattr(getattr(config, name), other) > 0:
            raise UsageError(f"{name}.{other}={getattr(getattr(config, name), other)} pipelines {name}'s rollouts; "
                             f"optimizer={config.optimizer} samples and updates in turn: leave {name}.{other} at 0")
    setting, stale = staleness(config)
    if stale == 0:
        return
    rule = optimizer_class(config.optimizer)
    if rule.moves != "trained":
        raise UsageError(f"{setting}={stale}: optimizer={config.optimizer} moves {rule.moves}, which cannot be sampled "
                         f"ahead of its updates (only a rule that trains weights can): set {setting}=0")
    if config.runtime.kind != "local":
        raise UsageError(f"{setting}={stale} needs runtime.kind=local (runtime {config.runtime.kind!r} samples "
                         f"in step with its updates): set {setting}=0")
    from vrl.generate import generator_class

    backend = config.generator.backend
    if generator_class(backend).decouple is PolicyHost.decouple:
        raise UsageError(f"{setting}={stale}: generator.backend={backend} cannot sample while the policy "
                         f"trains (no `decouple`); use generator.backend=hf or set {setting}=0")
    section = getattr(config.generator, backend, None)
    if not getattr(section, "sampling_logprobs", True):
        raise UsageError(f"{setting}={stale} trains on batches sampled by older weights, which only the "
                         f"sampler's log-probs correct for: set generator.{backend}.sampling_logprobs=true")
    if getattr(section, "sleep", False):
        raise UsageError(f"{setting}={stale} keeps the engine sampling while the policy trains, and "
                         f"generator.{backend}.sleep=true frees its memory for training between passes: use one of them")
    if getattr(section, "sync_every", 1) > 1:
        raise UsageError(f"{setting}={stale} and generator.{backend}.sync_every={section.sync_every} both "
                         "delay the sampler's weights, and staleness is counted in publishes: use one of them")


class VersionedHost(PolicyHost):
    """A decoupled host whose sampled weights change only between passes, counting the versions published.

    `version` is the number of updates published (the optimizer's iteration once `open`ed). Until
    `open`, `publish` only waits for a pass in flight (a resume's `load` publishes before the
    pipeline starts); after it, publishing update v + 1 also waits for the pass of iteration v + S.
    """

    def __init__(self, host: PolicyHost, lead: int):
        host.decouple()  # a HostPool decouples each of its hosts
        self.host, self.lead, self.name = host, lead, host.name
        self.version = 0
        self.publish_wait_s = 0.0  # the trainer's wait in `publish` since the pipeline last reset it
        self._cond = threading.Condition()
        self._sampling = self._publishing = False
        self._sampled = -1  # the newest iteration whose pass finished
        self._last: int | None = None  # the run's last iteration (None: not pipelined yet)
        self._failed: BaseException | None = None

    # -- the handshake ---------------------------------------------------------------------------------
    def open(self, version: int, last: int) -> None:
        """Start pipelining: the weights are update `version`'s; the run ends with iteration `last`."""
        with self._cond:
            self.version, self._last, self._sampled = version, last, version - 1

    def fail(self, error: BaseException) -> None:
        """The other side stopped (the producer failed, or the run is closing): waiters raise `error`."""
        with self._cond:
            self._failed = self._failed or error
            self._cond.notify_all()

    def begin_pass(self, min_version: int, stop: threading.Event) -> int | None:
        """Wait until the weights are at least `min_version` and no publish runs, then hold them for one
        pass; the version sampled, or None when `stop` was set first."""
        with self._cond:
            while self.version < min_version or self._publishing:
                if stop.is_set():
                    return None
                self._cond.wait(_POLL_S)
            self._sampling = True
            return self.version

    def end_pass(self, iteration: int | None) -> None:
        """The pass is over (`iteration`: the one it sampled, None when it did not finish)."""
        with self._cond:
            self._sampling = False
            if iteration is not None:
                self._sampled = max(self._sampled, iteration)
            self._cond.notify_all()

    def _may_publish(self) -> bool:
        if self._sampling:
            return False
        return self._last is None or self._sampled >= min(self.version + self.lead, self._last)

    # -- PolicyHost ------------------------------------------------------------------------------------
    def sample(self, tasks: Sequence[Task], variants: Sequence[Variant], seed: int | None = None
               ) -> Iterator[list[Completion]]:
        """One pass at the current version (not the pipeline's: it sets its own minimum), tagged with it."""
        version = self.begin_pass(0, threading.Event())
        try:
            for batch in self.host.sample(tasks, variants, seed):
                for c in batch:
                    c.weights_version = version
                yield batch
        finally:
            self.end_pass(None)

    def trainable(self) -> Trainable:
        return self.host.trainable()

    def publish(self, model: Any) -> None:
        t0 = time.perf_counter()
        with self._cond:
            while not self._may_publish():
                if self._failed is not None:
                    raise self._failed
                self._cond.wait(_POLL_S)
            self._publishing = True
        self.publish_wait_s += time.perf_counter() - t0
        published = False
        try:
            self.host.publish(model)
            published = True
        finally:
            with self._cond:
                self._publishing = False
                self.version += published
                self._cond.notify_all()

    def counters(self) -> dict[str, float]:
        return self.host.counters()

    def close(self) -> None:
        self.host.close()


@dataclass
class _Rollout:
    """One iteration's sampling pass, handed from the producer to the trainer."""

    iteration: int
    tasks: list[Task]
    version: int
    pending: list[tuple[list[Attempt], Future[list[Verdict]]]] = field(default_factory=list)
    generation_s: float = 0.0
    waited_s: float = 0.0  # the producer's wait for the weights it was to sample (the trainer's publish)


class _Stopped(Exception):
    """The pipeline was closed while a waiter waited."""


class Rollouts:
    """The producer thread and the trainer's side of the pipeline (see the module docstring)."""

    def __init__(self, trainer: Any, host: VersionedHost, optimizer: Any, pool: Any, shaper: Callable[..., float],
                 task_pool: list[Task], progress: Any, bar: Any, make_stats: Callable[[], Any]):
        self.trainer, self.host, self.optimizer, self.pool, self.shaper = trainer, host, optimizer, pool, shaper
        self.task_pool, self.progress, self.bar, self.make_stats = task_pool, progress, bar, make_stats
        self.lead = host.lead
        self._queue: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy = pool.busy_s

    # -- producer ----------------------------------------------------------------------------------------
    def _start(self, first: int) -> None:
        self.first, last = first, self.trainer.config.iterations - 1
        self.host.open(self.optimizer.iteration, last)
        self._thread = threading.Thread(target=self._produce, args=(first, last), name="vrl-rollouts", daemon=True)
        self._thread.start()

    def _produce(self, first: int, last: int) -> None:
        try:
            for j in range(first, last + 1):
                tasks = self.trainer.tasks_for(self.task_pool, j)
                t0 = time.perf_counter()
                version = self.host.begin_pass(max(first, j - self.lead), self._stop)
                if version is None:
                    return
                waited = time.perf_counter() - t0
                done = None
                try:
                    item = self._sample(j, tasks, version)
                    done = j if item is not None else None
                finally:
                    self.host.end_pass(done)
                if item is None:
                    return
                item.waited_s = waited
                self._queue.put(item)
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread, which raises it
            self.host.fail(exc)
            self._queue.put(exc)

    def _sample(self, iteration: int, tasks: list[Task], version: int) -> _Rollout | None:
        """One pass: sample every variant, hand batches to the verifiers as they come (None: stopped)."""
        item = _Rollout(iteration, tasks, version)
        by_id = {t.id: t for t in tasks}
        seed = random.Random(f"{self.trainer.config.seed}-sampling-{iteration}").randrange(2**31)  # as the sync loop
        variants = self.optimizer.ask()
        expected = len(tasks) * sum(v.samples_per_task for v in variants)
        sampled = 0
        t0 = time.perf_counter()
        stream = self.host.host.sample(tasks, variants, seed)
        try:
            for batch in stream:
                if self._stop.is_set():
                    return None
                for c in batch:
                    c.weights_version = version
                item.pending += self.pool.submit([Attempt(task=by_id[c.task_id], completion=c) for c in batch])
                sampled += len(batch)
                self.progress.update(self.bar, stats=f"{self.trainer._last_stats} · sampling iteration {iteration + 1}: "
                                                     f"{sampled}/{expected} · verifier queue {self.pool.queue_depth}")
        finally:
            stream.close()
        item.generation_s = time.perf_counter() - t0
        return item

    # -- trainer -----------------------------------------------------------------------------------------
    def _next(self) -> _Rollout:
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the rollout producer stopped without a batch") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def step(self, iteration: int) -> Any:
        """Iteration `iteration` on the trainer's side: wait for its batch and verdicts, check, train."""
        stats = self.make_stats()
        start = time.perf_counter()
        if self._thread is None:
            self._start(iteration)
        with self.trainer._collective_free():  # the producer makes no collective call either
            item = self._next()
            if item.iteration != iteration:
                raise RuntimeError(f"the rollout producer handed iteration {item.iteration} for iteration {iteration}")
            t_wait = time.perf_counter()
            stats.results = self.trainer._judged(item.pending, self.shaper, item.tasks)
        ready = time.perf_counter()
        stats.wait_s = ready - t_wait
        stats.generation_s = item.generation_s
        busy = self.pool.busy_s  # the verifier's busy time since the last iteration (passes overlap)
        stats.verification_s, self._busy = busy - self._busy, busy
        self.trainer._check_alarms(iteration, stats.results)
        self.trainer._check_verifier_alive(stats.results)
        behind = [self.optimizer.iteration - r.completion.weights_version for r in stats.results]
        if min(behind) < 0 or max(behind) > self.lead:  # the schedule makes this impossible: say so loudly
            raise RuntimeError(f"iteration {iteration}: a batch sampled {max(behind, default=0)} updates ago reached "
                               f"the update ({staleness(self.trainer.config)[0]}={self.lead}); this is a bug in vrl.rollouts")
        self.host.publish_wait_s = 0.0
        t_update = time.perf_counter()
        self.trainer._updating = True  # as the synchronous loop: a stop inside tell leaves nothing to save
        metrics = self.optimizer.tell(stats.results)
        self.trainer._updating = False
        stats.update_s = time.perf_counter() - t_update
        stats.optimizer_metrics = {
            **metrics,
            f"{self.trainer.config.optimizer}/staleness/mean": sum(behind) / len(behind),
            f"{self.trainer.config.optimizer}/staleness/max": max(behind),
            "time/wait_for_rollouts_s": ready - start,
            "time/wait_for_trainer_s": item.waited_s,
            "time/publish_wait_s": self.host.publish_wait_s,
        }
        stats.loop_s = time.perf_counter() - start
        return stats

    def close(self) -> None:
        """Stop the producer after the batch it is sampling (nothing trains on what it made) and wait for it."""
        self._stop.set()
        self.host.fail(_Stopped("the run is stopping"))
        if self._thread is not None:
            self._thread.join()
