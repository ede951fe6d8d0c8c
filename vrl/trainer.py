"""The fixed loop: tasks -> optimizer.ask -> generate -> verify -> shape -> optimizer.tell.

One implementation for every optimizer and runtime. Generation batches stream into the
verification pool as soon as they finish, so verification overlaps the rest of generation; the
iteration waits for the last verdicts only before the update.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import random
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from vrl import console as show
from vrl import distributed, episodes, launch, rollouts, schedule
from vrl.environment import Environment
from vrl.errors import IntegrityAlarm, PluginError, RunDirError, UsageError, describe
from vrl.optim import Optimizer, make_optimizer
from vrl.optim.checkpoints import CheckpointRefused
from vrl.policy import PolicyHost
from vrl.preflight import preflight, verifies_in_process
from vrl.rundir import RunDir
from vrl.runtime.base import Runtime, VerificationPool
from vrl.sinks import Sinks
from vrl.types import Attempt, Result, Status, Task, Verdict, Verified, refuse_shared_ids
from vrl.verifier import (
    VERIFIER_ERROR,
    close_unused,
    down_after_crashes,
    ensure_ready,
    is_verifier_error,
)

if TYPE_CHECKING:
    from rich.progress import Progress

    from vrl.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass
class IterationStats:
    generation_s: float = 0.0
    verification_s: float = 0.0
    wait_s: float = 0.0
    update_s: float = 0.0
    loop_s: float = 0.0
    results: list[Result] = field(default_factory=list)
    optimizer_metrics: dict[str, float] = field(default_factory=dict)
    plan: schedule.IterationPlan | None = None  # dynamic sampling or a curriculum drew the tasks (`vrl.schedule`)


class Trainer:
    """Runs a training loop described by a `TrainConfig`, writing everything to a run directory."""

    def __init__(
        self,
        config: TrainConfig,
        run_dir: RunDir | None = None,
        environment: Environment | None = None,
        runtime: Runtime | None = None,
        console: Console | None = None,
        on_iteration: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.config = config
        self.console = console or Console(stderr=True, log_path=False)
        self.on_iteration = on_iteration
        self._follower = distributed.is_follower()
        self._stop_requested: str | None = None  # the stop signal's name (`_stop_signals`)
        self._interruptible = False  # inside `_collective_free()`: a stop signal interrupts at once
        if self._follower:  # a rank > 0 of a torchrun launch: rank 0 owns the run directory and the loop
            launch.check(config)  # refused here with rank 0's line, before this rank joins the group
            self.run_dir = run_dir
            return
        # Everything that can fail runs before the run directory is created or changed, so a bad
        # option, model or server leaves nothing behind and never alters a run it was to resume.
        if run_dir is not None:
            run_dir.acquire()  # one writer at a time: a second is refused, naming the first's pid
        try:
            if run_dir is not None:
                run_dir.check_resume(config)
            if environment is None:
                from vrl.plugins import registry

                environment = registry().environment(config.plugin, **config.env_options)
            self.env = environment
            if runtime is None:
                from vrl.runtime import make_runtime

                runtime = make_runtime(config)
            self.runtime = runtime
            self.sinks = Sinks.from_config(config.logging)  # a missing package fails here
            if run_dir is None:
                check_runs_dir(config.logging.runs_dir)
            if verifies_in_process(self.config):
                close_unused(self.env.verifier())  # its options refused before tasks load (one line)
            self._pool_tasks = self._task_pool()
            preflight(self.config, self.env)
            launch.check(self.config)  # under torchrun: what several processes cannot train
            rollouts.check(self.config)  # asynchronous rollouts: what cannot sample while it trains
            schedule.check(self.config, run_dir.config() if run_dir is not None else None)
            self.schedule = schedule.Schedule(self.config, self._pool_tasks)  # dynamic sampling, curriculum
        except BaseException:
            if run_dir is not None:
                run_dir.release()
            raise
        self._created = run_dir is None
        try:
            self.run_dir = run_dir or RunDir.create(config)
        except OSError as exc:  # what `check_runs_dir` could not foresee (a full disk, a quota)
            raise _runs_dir_error(config.logging.runs_dir, exc) from exc
        try:  # a sink that cannot start stops the run here, before iteration 0
            self.sinks.start(self.run_dir.path, self.run_dir.config())
        except BaseException:
            if self._created:  # the directory was made just now and holds only config and versions
                self.run_dir.remove()
            else:
                self.run_dir.release()
            raise
        self._resumed_summary = None if self._created else self.run_dir.summary()
        self._iterations_done = 0  # by this process: a run stopped before its first keeps nothing of it
        self.start_iteration = self.run_dir.completed_iterations()
        self._last_stats = "first iteration"  # the live line: last iteration's numbers + current queue
        self._updating = False
        self._reported_errors: set[str] = set()  # kinds of verifier error already reported on the console

    def _check_verifier_alive(self, results: list[Result]) -> None:
        """Stop before the update when the verifier is down or broken, instead of learning from its crashes.

        Down: at least half of the iteration crashed and `check_ready` raises (VerifierUnavailable).
        Broken: more than `verifier.max_error_fraction` of the iteration's verdicts (or all of them) are
        the verifier's own errors (`is_verifier_error`: its `check` or `verify` raised, or broke the
        contract), so the reward is mostly noise (PluginError). Fewer are kept as `crashed` verdicts, each
        kind of error (exception type and place) reported once on the console, and the run goes on.
        """
        if verifies_in_process(self.config):
            down = down_after_crashes([r.verdict for r in results], lambda: ensure_ready(self.env.verifier()))
            if down is not None:
                raise down
        errors = [r.verdict.detail.removeprefix(VERIFIER_ERROR) for r in results if is_verifier_error(r.verdict)]
        if not errors:
            return
        if len(errors) == len(results) or len(errors) > self.config.verifier.max_error_fraction * len(results):
            share = "all" if len(errors) == len(results) else f"{len(errors)} of"
            raise PluginError(f"environment {self.env.name!r}: its verifier raised on {share} {len(results)} attempts of "
                              f"iteration {self.start_iteration + self._iterations_done} (verifier.max_error_fraction="
                              f"{self.config.verifier.max_error_fraction:g}); the first: {errors[0]}. Fix the verifier "
                              "(`vrl verify` runs it on attempts you write); the run stopped before this iteration's update")
        for detail in errors:
            kind = error_kind(detail)
            if kind not in self._reported_errors:
                self._reported_errors.add(kind)
                self._log(f"[yellow]verifier error on {sum(error_kind(d) == kind for d in errors)} of {len(results)} "
                          f"attempts (crashed verdicts with no reward: GRPO leaves them out of its statistics and update, ES "
                          f"out of the member's fitness; reported once): {detail}")

    def _check_alarms(self, iteration: int, results: list[Result]) -> None:
        """The verifier found its own integrity breached (a canary false theorem passed): keep the
        attempts in alarms.jsonl and stop before the update can learn from a forged reward."""
        alarmed = [r for r in results if r.verdict.alarm]
        if not alarmed:
            return
        rows = [{"iteration": iteration, "task_id": r.task.id, "variant": r.completion.variant, "sample": r.completion.sample,
                 "alarm": r.verdict.alarm, "verdict": r.verdict.model_dump(mode="json"), "completion": r.completion.text}
                for r in alarmed]
        self.run_dir.append("alarms.jsonl", rows)
        raise IntegrityAlarm(f"environment {self.env.name!r}: {len(alarmed)} attempt(s) of iteration {iteration} broke the "
                             f"verifier's integrity; the first: {alarmed[0].verdict.alarm}. The attempts are kept in "
                             f"{self.run_dir.path / 'alarms.jsonl'}; the run stopped before this iteration's update")

    # -- task schedule -----------------------------------------------------------------------------
    def _task_pool(self) -> list[Task]:
        tasks = self.env.tasks(self.config.split)
        if not tasks:
            raise UsageError(f"environment {self.env.name!r} has no tasks in split {self.config.split!r}; "
                             f"choose one of {', '.join(self.env.splits)} with --set split=NAME")
        refuse_shared_ids(tasks, self.env.name, self.config.split)
        return tasks

    def tasks_for(self, pool: list[Task], iteration: int) -> list[Task]:
        """The batch of an iteration: a seeded permutation per epoch, so resume draws the same tasks."""
        k = self.config.tasks_per_iteration
        orders: dict[int, list[int]] = {}  # one shuffle per epoch the batch touches
        out: list[Task] = []
        for position in range(iteration * k, (iteration + 1) * k):
            epoch, offset = divmod(position, len(pool))
            if epoch not in orders:
                orders[epoch] = list(range(len(pool)))
                random.Random(f"{self.config.seed}-{epoch}").shuffle(orders[epoch])
            out.append(pool[orders[epoch][offset]])
        return out

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        if self._follower:
            return launch.follow(self.config)
        with self._stop_signals():
            return self._run()

    @contextlib.contextmanager
    def _stop_signals(self) -> Iterator[None]:
        """Inside the block, SIGTERM stops the run as Ctrl-C does: a job scheduler's stop, `kill`, torchrun
        stopping its launch. The finished iterations are kept (GRPO writes the checkpoint of the last) and
        the engines shut down; without it the process would end at once, losing the iterations since the
        last checkpoint. On one process the iteration in flight is dropped at once. Under torchrun (both
        signals; the other ranks ignore them and wait for rank 0) so is an iteration that is sampling or
        verifying (`_collective_free`); one that is training, checkpointing or publishing ends first, since
        its collectives must end on every rank before the stop's checkpoint and release begin (torchrun's
        SIGKILL ends a launch that takes longer than its 30 s). A signal that lands inside a `__del__` stops
        the run when the iteration ends instead. A second signal during
        the teardown is ignored (SIGKILL still ends it; vrl.reaper then ends the engines). Only in the main
        thread (where Python runs signal handlers), on signals nobody else handles."""
        own = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        deferred = distributed.world_size() > 1
        handled = [sig for sig in (signal.SIGTERM, *([signal.SIGINT] if deferred else []))
                   if signal.getsignal(sig) is own[sig]]

        def stop(signum, frame):
            for sig in handled:
                signal.signal(sig, signal.SIG_IGN)
            self._stop_requested = signal.Signals(signum).name
            # Not from inside a finalizer (a library's `__del__` the signal happened to land in): Python would
            # print the KeyboardInterrupt as "Exception ignored in ... __del__" with a traceback and drop it.
            # The flag stops the run when the iteration ends (or at the next `_collective_free`).
            in_finalizer = frame is not None and frame.f_code.co_name == "__del__"
            if (not deferred or self._interruptible) and not in_finalizer:
                raise KeyboardInterrupt(self._stop_requested)

        for sig in handled:
            signal.signal(sig, stop)
        try:
            yield
        finally:
            for sig in handled:
                signal.signal(sig, own[sig])

    @contextlib.contextmanager
    def _collective_free(self) -> Iterator[None]:
        """Inside the block rank 0 makes no collective call (sampling and verifying; with
        grpo.sample_on_every_rank the gather of the others' shares runs even when it is interrupted):
        a stop signal under torchrun interrupts it at once (`_stop_signals`)."""
        if self._stop_requested:
            raise KeyboardInterrupt(self._stop_requested)
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def _run(self) -> dict[str, Any]:
        cfg = self.config
        pool_tasks = self._pool_tasks
        shaper = _guard_shaper(self.env.shaper(), self.env.name)
        summary: dict[str, Any] = {
            "name": self.run_dir.name,
            "plugin": cfg.plugin,
            "optimizer": cfg.optimizer,
            "model": cfg.model,
            "status": "running",
            "started_at": time.time(),
        }
        if notes := self.env.summary_notes():
            summary["notes"] = list(notes)
        self.run_dir.write_summary(summary)
        show.start(self.console, self.run_dir.path, self.env.name, cfg.model, cfg.optimizer, cfg.iterations)
        policy = optimizer = pool = pipeline = None
        sinks = self.sinks
        try:
            distributed.start()  # under torchrun: this rank's GPU, before any model loads
            optimizer = make_optimizer(cfg)
            policy = self.runtime.policy(cfg, optimizer.needs())
            episodes.attach(policy, self.env)  # an environment that answers back: whole episodes
            if rollouts.asynchronous(cfg):  # sampling runs ahead in a thread, on weights only `publish` changes
                policy = rollouts.VersionedHost(policy, rollouts.staleness(cfg)[1])
            optimizer.setup(policy)
            policy = optimizer.sampler(policy)  # GRPO under torchrun may sample on every rank
            if self.start_iteration >= cfg.iterations:  # nothing to load: a checkpoint older than the end would redo iterations
                self._log(f"{self.run_dir.path} has finished its {self.start_iteration} iterations: nothing to train "
                          "(resume with a larger --iterations to train further)")
            elif self.start_iteration:
                optimizer.load(self.run_dir.path, self.start_iteration)
                resumed_at = optimizer.iteration
                if resumed_at < self.start_iteration:  # its newest checkpoint is older (grpo.save_every)
                    self._log(f"the optimizer's newest checkpoint is after iteration {resumed_at}: "
                              f"redoing iterations {resumed_at + 1}..{self.start_iteration}")
                    self.run_dir.rewind(resumed_at)
                    self.start_iteration = resumed_at
                self.run_dir.truncate_metrics(self.start_iteration)
                self._log(f"resuming {self.run_dir.path} after iteration {self.start_iteration}")
            if self.schedule.active:  # its state is the rows of the finished iterations of tasks.jsonl
                self.schedule.load(self.run_dir, self.start_iteration)
            attempts = cfg.tasks_per_iteration * optimizer.samples_per_task()
            pool = self.runtime.verification(self.env.verifier() if verifies_in_process(cfg) else None, cfg, attempts)
            with show.progress(self.console, self.start_iteration) as progress:
                bar = progress.add_task("training", total=cfg.iterations, completed=self.start_iteration, stats="")
                if isinstance(policy, rollouts.VersionedHost):
                    pipeline = rollouts.Rollouts(self, policy, optimizer, pool, shaper, pool_tasks, progress, bar,
                                                 IterationStats)
                for iteration in range(self.start_iteration, cfg.iterations):
                    if self._stop_requested:  # under torchrun, a stop signal waits for the iteration's end
                        self._log(f"{self._stop_requested}: stopping after iteration {iteration}")
                        raise KeyboardInterrupt(self._stop_requested)
                    tasks = self.tasks_for(pool_tasks, iteration)
                    self.env.begin_iteration(iteration, cfg.iterations)
                    stats = (pipeline.step(iteration) if pipeline is not None else
                             self._iteration(iteration, tasks, optimizer, policy, pool, shaper, progress, bar))
                    metrics = self._finish_iteration(iteration, stats, optimizer)
                    self._iterations_done += 1
                    sinks.log(metrics, step=iteration)
                    self._last_stats = show.short(metrics)
                    progress.update(bar, advance=1, stats=self._last_stats)
                    self._log(show.line(metrics))
            optimizer.finish()
            summary["status"] = "finished"
        except KeyboardInterrupt:
            summary["status"] = "interrupted"
            self._save_on_stop(optimizer)
            self._log("[yellow]interrupted: finished iterations are saved; continue with "
                      f"`vrl train --resume {self.run_dir.path}`")
        except BaseException as exc:
            summary.update(status="failed", error=f"{type(exc).__name__}: {exc}")
            self._save_on_stop(optimizer)
            raise
        finally:
            if pipeline is not None:  # the producer stops before the pool and the engines it uses close
                pipeline.close()
            if pool is not None:
                pool.close()
            try:
                if policy is not None:
                    policy.close()
            finally:
                self.runtime.close()
            self._close_optimizer(optimizer, summary)
            sinks.finish(summary["status"])
            summary.update(_totals(self.run_dir.metrics()), finished_at=time.time(),
                           iterations_completed=self.run_dir.completed_iterations())
            self._close_run_dir(summary)
        show.summary(self.console, summary, self.run_dir.path)
        return summary

    def _close_run_dir(self, summary: dict[str, Any]) -> None:
        """Write the summary and give up the lock; a run that did nothing leaves no trace.

        A new run that failed before finishing an iteration is removed (its name stays free); a
        resume that failed or stopped before finishing one restores the summary it found.
        """
        if self._iterations_done or summary["status"] == "finished":
            self.run_dir.write_summary(summary)
        elif self._created and summary["status"] == "failed" and not (self.run_dir.path / "alarms.jsonl").exists():
            self.run_dir.remove()  # (a run that raised an integrity alarm keeps its evidence)
        elif not self._created and self._resumed_summary is not None:
            self.run_dir.write_summary(self._resumed_summary)
        else:
            self.run_dir.write_summary(summary)
        self.run_dir.release()

    def _close_optimizer(self, optimizer: Optimizer | None, summary: dict[str, Any]) -> None:
        """Let the optimizer finish what it does in the background (GRPO: the checkpoint being written,
        overlapped with the teardown above) and release the other ranks of a torchrun launch."""
        if optimizer is None:
            return
        start = time.perf_counter()
        try:
            optimizer.close()
            summary["checkpoint_wait_s"] = time.perf_counter() - start  # what the run waited for at its end
        except Exception as exc:  # the checkpoint being written is lost; the one before it stands
            summary.update(status="failed", error=f"{type(exc).__name__}: {exc}")
            self.console.log(f"[red]writing the last checkpoint failed: {type(exc).__name__}: {exc}")

    def _save_on_stop(self, optimizer: Optimizer | None) -> None:
        """The run stops between two updates: have the optimizer write its state for the last finished
        iteration even if it only checkpoints every k (grpo.save_every), so a resume loses nothing."""
        if optimizer is None or self._updating:
            return
        try:
            finished = self.run_dir.completed_iterations()
            if finished and optimizer.iteration == finished:  # state matches the run
                optimizer.save(self.run_dir.path, final=True)
        except Exception as exc:  # the run is failing already; its last regular checkpoint still stands
            self._log(f"[yellow]could not save the optimizer's state on stopping: {type(exc).__name__}: {exc}")

    def _iteration(self, iteration: int, tasks: list[Task], optimizer: Optimizer, policy: PolicyHost,
                   pool: VerificationPool, shaper, progress: Progress, bar) -> IterationStats:
        stats = IterationStats()
        start = time.perf_counter()
        busy_before = pool.busy_s
        variants = optimizer.ask()

        def sample(batch_tasks: list[Task], batch: int) -> list[Result]:
            return self._sample(iteration, batch, batch_tasks, variants, policy, pool, shaper, progress, bar, stats)

        trained = stats.results = sample(tasks, 0) if not self.schedule.active else []
        if self.schedule.active:  # it draws the tasks, maybe several generation batches, and picks what trains
            stats.plan = self.schedule.collect(iteration, sample)
            stats.results, trained = stats.plan.results, stats.plan.trained
        stats.verification_s = pool.busy_s - busy_before
        t_update = time.perf_counter()
        self._updating = True  # a stop inside tell leaves the optimizer half-updated: nothing to save then
        stats.optimizer_metrics = optimizer.tell(trained)
        self._updating = False
        stats.update_s = time.perf_counter() - t_update
        stats.loop_s = time.perf_counter() - start
        return stats

    def _sample(self, iteration: int, batch_index: int, tasks: list[Task], variants: list[Any], policy: PolicyHost,
                pool: VerificationPool, shaper, progress: Progress, bar, stats: IterationStats) -> list[Result]:
        """One generation batch of an iteration: sample every variant on `tasks`, verify, shape, check (the
        iteration's first batch is its only one unless dynamic sampling draws more)."""
        by_id = {t.id: t for t in tasks}
        pending: list[tuple[list[Attempt], Future[list[Verdict]]]] = []
        suffix = f"-{batch_index}" if batch_index else ""  # the first batch samples as a run without filtering
        sample_seed = random.Random(f"{self.config.seed}-sampling-{iteration}{suffix}").randrange(2**31)
        expected = len(tasks) * sum(v.samples_per_task for v in variants)
        sampled = 0
        # One call samples every variant (on one engine or many); batches stream in as they finish.
        stream = policy.sample(tasks, variants, seed=sample_seed)
        with contextlib.nullcontext() if policy.collective else self._collective_free():
            try:
                t0 = time.perf_counter()
                for batch in stream:
                    stats.generation_s += time.perf_counter() - t0
                    attempts = [Attempt(task=by_id[c.task_id], completion=c) for c in batch]
                    # a batch judged where it was sampled (a follower rank's share) keeps its verdicts
                    pending += pool.submit(attempts, batch if isinstance(batch, Verified) else None)
                    sampled += len(batch)
                    progress.update(bar, stats=f"{self._last_stats} · sampled {sampled}/{expected} · "
                                               f"verifier queue {pool.queue_depth}")
                    t0 = time.perf_counter()
                stats.generation_s += time.perf_counter() - t0
            finally:
                stream.close()
        t_wait = time.perf_counter()
        with self._collective_free():
            results = self._judged(pending, shaper, tasks)
        stats.wait_s += time.perf_counter() - t_wait
        self._check_alarms(iteration, results)  # every batch's, kept or not: a forged pass stops the run
        self._check_verifier_alive(results)
        return results

    @staticmethod
    def _judged(pending: list[tuple[list[Attempt], Future[list[Verdict]]]], shaper, tasks: list[Task]) -> list[Result]:
        """The rewarded results of an iteration's verification chunks (waiting for each verdict), in one
        order whichever engine ran what and whenever it finished: by variant, task position, sample."""
        results = []
        for chunk, fut in pending:
            for attempt, verdict in zip(chunk, fut.result()):
                reward = float(shaper(attempt.task, attempt.completion, verdict))
                results.append(Result(task=attempt.task, completion=attempt.completion, verdict=verdict, reward=reward))
        position = {t.id: i for i, t in reversed(list(enumerate(tasks)))}
        results.sort(key=lambda r: (r.completion.variant, position[r.task.id], r.completion.sample))
        return results

    def _finish_iteration(self, iteration: int, stats: IterationStats, optimizer: Optimizer) -> dict[str, Any]:
        results = stats.results
        rewards = [r.reward for r in results]
        statuses = Counter(r.verdict.status.value for r in results)
        tokens = sum(r.completion.completion_tokens for r in results)
        metrics: dict[str, Any] = {
            "iteration": iteration,
            "time": time.time(),
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "reward_max": max(rewards) if rewards else 0.0,
            "pass_rate": statuses.get(Status.PASSED.value, 0) / len(results) if results else 0.0,
            "completions": len(results),
            "tokens": tokens,
            "tokens_per_s": tokens / stats.generation_s if stats.generation_s else 0.0,
            "generation_s": stats.generation_s,
            "verification_s": stats.verification_s,
            "verify_wait_s": stats.wait_s,
            "update_s": stats.update_s,
            "loop_s": stats.loop_s,
        }
        metrics.update({f"status/{s.value}": statuses.get(s.value, 0) for s in Status})
        metrics["reasons"] = _reasons(results)
        metrics.update(self.env.iteration_metrics(_verifier_sums(results)))
        metrics.update(episodes.iteration_metrics(results))
        metrics.update(stats.optimizer_metrics)
        if stats.plan is not None:
            metrics.update(stats.plan.metrics)
        start = time.perf_counter()
        refused = None
        try:
            optimizer.save(self.run_dir.path)
        except CheckpointRefused as exc:  # no room on disk (grpo.on_disk_full=stop): record the iteration, then stop
            refused = exc
        # ES: a few hundred bytes; GRPO: the copy to host memory (its files are written in the background)
        metrics["save_s"] = time.perf_counter() - start
        self.run_dir.append("metrics.jsonl", [metrics])
        self.run_dir.append("samples.jsonl", _samples(iteration, results, self.config.logging.samples_per_iteration))
        if stats.plan is not None:
            self.run_dir.append(schedule.TASKS_FILE, stats.plan.rows)
        self.run_dir.finish_iteration(iteration)
        if refused is not None:
            raise refused
        if self.on_iteration:
            self.on_iteration(metrics)
        return metrics

    def _log(self, text: str) -> None:
        show.log(self.console, text)


def check_runs_dir(runs_dir: Path) -> None:
    """`logging.runs_dir` can take new run directories (it, or the nearest folder above it that exists, is a
    writable directory); else a `RunDirError` naming the setting. Creates nothing: a refused run leaves no trace."""
    runs_dir = Path(runs_dir)
    existing = next((p for p in (runs_dir, *runs_dir.absolute().parents) if os.path.lexists(p)), None)
    if existing is None:
        return
    if not existing.is_dir():
        raise _runs_dir_error(runs_dir, NotADirectoryError(errno.ENOTDIR, "not a directory"))
    if _read_only(existing):
        raise _runs_dir_error(runs_dir, OSError(errno.EROFS, os.strerror(errno.EROFS)))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _runs_dir_error(runs_dir, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _runs_dir_error(runs_dir: Path, exc: OSError) -> RunDirError:
    reason = exc.strerror or str(exc) or type(exc).__name__
    if isinstance(exc, (FileExistsError, NotADirectoryError)):
        reason = "a file is in the way"
    return RunDirError(f"logging.runs_dir={runs_dir}: cannot create run directories there ({reason}); choose a "
                       "writable directory with --set logging.runs_dir=PATH")


def error_kind(detail: str) -> str:
    """A verifier error's kind: its exception type and place (`describe`'s text without the message)."""
    kind = detail.split(":", 1)[0]
    place = re.search(r" \(([^()]*:\d+ in [^()]*)\)$", detail)
    return f"{kind} at {place.group(1)}" if place else kind


def _guard_shaper(shaper: Callable[[Task, Any, Verdict], float], env_name: str) -> Callable[[Task, Any, Verdict], float]:
    """The environment's reward shaper, made to stop the run with a `PluginError` when it raises or
    returns something that is not a finite number: a broken reward must not train (on zeros) silently.
    Called before the optimizer's update, so the iteration it breaks is never told."""

    def shape(task: Task, completion: Any, verdict: Verdict) -> float:
        try:
            reward = float(shaper(task, completion, verdict))
        except Exception as exc:  # a KeyboardInterrupt passes through: Ctrl-C stays an interruption
            raise PluginError(f"environment {env_name!r}: its reward shaper raised {describe(exc)} on task {task.id!r} "
                              f"(verdict {verdict.status.value}); fix the shaper; the run stopped before this "
                              "iteration's update") from exc
        if not math.isfinite(reward):
            raise PluginError(f"environment {env_name!r}: its reward shaper returned {reward} on task {task.id!r} "
                              f"(verdict {verdict.status.value}); a reward must be a finite number; the run stopped "
                              "before this iteration's update")
        return reward

    return shape


def _verifier_sums(results: list[Result]) -> dict[str, float]:
    """The verifiers' own per-attempt counters (`Verdict.metrics`), summed over the iteration."""
    sums: dict[str, float] = {}
    for r in results:
        for key, value in r.verdict.metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return sums


def _samples(iteration: int, results: list[Result], limit: int) -> list[dict[str, Any]]:
    # Keep the best attempts and a spread of the rest: passes are the rare, informative ones.
    order = sorted(range(len(results)), key=lambda i: -results[i].reward)
    best = order[: (limit + 1) // 2]
    taken = set(best)
    rest = [i for i in range(len(results)) if i not in taken]
    step = max(1, len(rest) // max(1, limit - len(best)))
    chosen = [results[i] for i in best + rest[::step][: limit - len(best)]]
    return [
        {
            "iteration": iteration,
            "task_id": r.task.id,
            # The prompt the model saw: an episode's own where its environment changed it (TRL's reset text)
            "prompt": r.task.prompt if r.completion.episode is None or r.completion.episode.prompt is None
            else r.completion.episode.prompt,
            "variant": r.completion.variant,
            "sample": r.completion.sample,
            "completion": r.completion.text,
            "finish_reason": r.completion.finish_reason,
            "verdict": r.verdict.model_dump(mode="json"),
            "reward": r.reward,
            # A multi-turn attempt: the whole conversation after the prompt (`completion` is its last model turn).
            **({"episode": r.completion.episode.model_dump(mode="json")} if r.completion.episode is not None else {}),
        }
        for r in chosen[:limit]
    ]


def _reasons(results: list[Result], top: int = 8) -> dict[str, int]:
    """The most common reasons for verdicts that did not pass, digits folded so they group."""
    counts = Counter(
        f"{r.verdict.status.value}: {re.sub(r'[0-9]+', 'N', r.verdict.detail.splitlines()[0] if r.verdict.detail else '')[:80]}"
        for r in results
        if not r.verdict.passed
    )
    return dict(counts.most_common(top))


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {}
    return {
        "reward_first": rows[0]["reward_mean"],
        "reward_last": rows[-1]["reward_mean"],
        "reward_best": max(r["reward_mean"] for r in rows),
        "pass_rate_last": rows[-1]["pass_rate"],
        "tokens_total": sum(r["tokens"] for r in rows),
        "generation_s_total": sum(r["generation_s"] for r in rows),
        "verification_s_total": sum(r["verification_s"] for r in rows),
        "loop_s_total": sum(r["loop_s"] for r in rows),
    }
