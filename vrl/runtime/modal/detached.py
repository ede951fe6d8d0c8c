"""The detached orchestrator's body: the whole training loop inside a Modal container, one owner per run.

It sits above the trainer (it runs one), so nothing the trainer imports imports it. It gets the
Modal runtime by name from the registry, as the CLI does: the runtime builds the app (`app.py`),
whose orchestrator function calls this module, so importing the runtime here would close a cycle.

What Modal does to a long function, and what the orchestrator does about it (`run_on_modal`):

- it restarts a preempted or crashed call on the same input (same call id, `resume=False` again):
  the restart finds the lease it holds and continues the run directory its first attempt left. A
  preemption reaches the trainer as a stop signal, which in a container is never the run's end: the
  app stays up for the restart (`_signalled`), and `stop_app` stops it only once the call has finished;
- a Volume has no cross-container lock: a run lease (`lease.py`) lets one call own the run; a second
  start is refused in one line, and an owner that lost its lease stops before writing again;
- a commit reloads the Volume, which Modal refuses while a file of it is open: the run directory's
  writer lock is kept outside the Volume (`LOCK_DIR`), GRPO checkpoints are written before the
  iteration ends (`grpo.async_save` off), and the Volume is committed after each iteration;
- a call ends at its function timeout (24 h at most): before an iteration that might not end in
  time, the orchestrator stops as Ctrl-C would (everything finished is saved), commits, and spawns a
  new call of itself that resumes the run (self-continuation); the lease passes to it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vrl.config import migrate, train_config
from vrl.errors import RunDirError
from vrl.rundir import RunDir
from vrl.runtime import runtime_class
from vrl.runtime.modal.lease import RunLease, RunLeaseError, already_exists
from vrl.runtime.modal.workers import RUNS_DIR
from vrl.trainer import Trainer  # the public loop only (a detached run is a `vrl train` run): no internals

log = logging.getLogger(__name__)

#: The run directory's writer lock, outside the Volume (an open file there blocks commit and reload).
LOCK_DIR = Path(tempfile.gettempdir()) / "vrl-run-locks"


def orchestrate(config: dict[str, Any], root: str | os.PathLike, worker: Any, resume: bool = False,
                on_iteration: Any = None, *, restarted: bool = False,
                before_sample: Callable[[], None] | None = None, lock_dir: Path = LOCK_DIR) -> dict[str, Any]:
    """Run the whole training loop here, the run directory on the Volume (`root`).

    `worker`: the app's GPU worker; `on_iteration` commits the Volume after each iteration so metrics
    and the ES history survive a lost container; `resume=True` continues the run directory found on
    the Volume with its recorded config (only `iterations` may grow); `restarted=True` (Modal re-ran
    this call's input) continues the run directory if the first attempt left one, else starts it.
    `before_sample` runs at each iteration's start (the deadline check).
    """
    path = Path(root) / RUNS_DIR / str(config["logging"]["name"])
    run_dir = None
    if resume or (restarted and (path / "config.json").is_file()):
        run_dir = RunDir.open(path, lock_dir)
        config = {**migrate(run_dir.config()), "iterations": config["iterations"]}
    if config.get("optimizer") == "grpo" and isinstance(config.get("grpo"), dict):
        # The Volume is committed after each iteration, and a commit reloads, which Modal refuses while a
        # file is open: GRPO's checkpoint is written before the iteration ends, not in the background.
        config = {**config, "grpo": {**config["grpo"], "async_save": False}}
    cfg = train_config().model_validate(config)
    cfg = cfg.model_copy(update={"logging": cfg.logging.model_copy(update={"runs_dir": Path(root) / RUNS_DIR})})
    created = run_dir is None
    if created:
        run_dir = RunDir.create(cfg, lock_dir)  # refuses a run directory that exists
    try:
        runtime = runtime_class("modal")(cfg, app=None, worker=worker, volume_root=root, in_container=True)
        runtime.before_sample = before_sample
        summary = Trainer(cfg, run_dir=run_dir, runtime=runtime, on_iteration=on_iteration).run()
    except BaseException as exc:
        # A new run that finished nothing leaves nothing behind, as `vrl train`'s (its name stays free).
        if created and not isinstance(exc, KeyboardInterrupt) and not run_dir.completed_iterations() \
                and not (run_dir.path / "alarms.jsonl").exists():
            run_dir.remove()
        else:
            run_dir.release()
        raise
    return json.loads(json.dumps(summary, default=str))


class Continue(KeyboardInterrupt):
    """Stops the trainer the way Ctrl-C does, at an iteration's start (everything finished is saved), so
    that a new call continues the run before this one reaches its function timeout."""


class Deadline:
    """When to hand the run to a new call: before an iteration that might not end within the timeout.

    The margin is twice the longest iteration of this call (its first includes the start-up) plus a
    reserve for saving, committing and spawning. A call always runs at least one iteration, so a run
    whose iterations do not fit the timeout fails at the timeout instead of spawning calls forever.
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s, self.clock = float(timeout_s), clock
        self.start = self._last = clock()
        self.reserve_s = min(300.0, 0.1 * self.timeout_s)
        self.longest = 0.0
        self.iterations = 0
        self.reached = False

    def iteration_done(self) -> None:
        now = self.clock()
        self.longest, self._last = max(self.longest, now - self._last), now
        self.iterations += 1

    def check(self) -> None:
        """Raise `Continue` when the next iteration might not end before the timeout."""
        if not self.iterations:
            return
        left = self.start + self.timeout_s - self.clock()
        if left < 2 * self.longest + self.reserve_s:
            self.reached = True
            raise Continue(f"{left:.0f} s left of the {self.timeout_s:.0f} s function timeout; continuing in a new call")


def run_on_modal(config: dict[str, Any], root: str, worker: Any, *, resume: bool, volume: str, orchestrator: Any,
                 predecessor: str | None, timeout_s: float, lease: RunLease | None = None, app_id: str | None = None,
                 stopper: Any = None) -> dict[str, Any]:
    """The `orchestrate` Modal function: own the run (lease), train, commit, continue before the timeout.

    When the run ends here (finished, failed or stopped; not handed to a continuation) its end goes into
    the launch record and `stopper` (the app's `stop_app`) stops the app `app_id` after this call returns.
    """
    import modal

    me = modal.current_function_call_id()
    lease = lease or RunLease(volume, str(config["logging"]["name"]))
    claimed: list[int] = []
    try:
        summary = _own_and_train(config, root, worker, resume=resume, volume=volume, orchestrator=orchestrator,
                                 predecessor=predecessor, timeout_s=timeout_s, lease=lease, me=me, app_id=app_id,
                                 stopper=stopper, claimed=claimed)
    except KeyboardInterrupt:
        _signalled()
        raise
    except BaseException as exc:
        # A call refused the run (or that lost it) records nothing: the run's record is its owner's.
        owned = claimed and not isinstance(exc, RunLeaseError)
        _ended(lease if owned else None, f"{type(exc).__name__}: {exc}".splitlines()[0], app_id, stopper, me)
        raise
    if summary.get("status") == "interrupted":
        _signalled()
    elif summary.get("status") != "continued":
        _ended(lease, summary.get("error"), app_id, stopper, me)
    return summary


def _signalled() -> None:
    """The trainer stopped on SIGINT or SIGTERM. Inside a Modal container nobody here sends them: Modal
    does, preempting the container ("Modal will gracefully terminate the Function and restart it on the
    same input", modal.com/docs/guide/preemption) or ending it. That is not the run's end: nothing is
    recorded and the app is not stopped, so the restarted call continues the run (`vrl modal stop`
    cancels the call and stops the app itself)."""
    log.warning("the orchestrator was stopped by a signal (Modal preempting its container?): its finished "
                "iterations are committed, and Modal's restart of this call continues the run")


def _ended(lease: RunLease | None, error: str | None, app_id: str | None, stopper: Any, me: str | None) -> None:
    """Record the run's end (`lease`) and have this call's app stopped once the call has returned (best
    effort: the run's own outcome is what matters here)."""
    try:
        if lease is not None:
            lease.record_end(error)
        if app_id and stopper is not None:
            stopper.spawn(app_id, me)
    except Exception as exc:  # noqa: BLE001
        log.warning("could not record the run's end or stop its app: %s: %s", type(exc).__name__, exc)


def _own_and_train(config: dict[str, Any], root: str, worker: Any, *, resume: bool, volume: str, orchestrator: Any,
                   predecessor: str | None, timeout_s: float, lease: RunLease, me: str | None, app_id: str | None,
                   stopper: Any, claimed: list[int]) -> dict[str, Any]:
    import modal

    deadline = Deadline(timeout_s)
    name = str(config["logging"]["name"])
    successor = lease.successor_of(me)
    if successor is not None:  # this call handed the run on, then Modal re-ran its input
        return {"name": name, "status": "continued", "call": successor}
    owner = lease.owner()
    restarted = owner is not None and owner.call_id == me  # Modal restarted this input (preemption, crash)
    exists = (Path(root) / RUNS_DIR / name / "config.json").is_file()
    if not restarted:
        if resume and not exists:
            raise RunDirError(f"no detached run {name!r} on the Volume {volume!r} (no runs/{name}/config.json)")
        if not resume and exists:
            raise RunDirError(already_exists(name, volume))
    generation = lease.claim(me, predecessor)
    claimed.append(generation)
    vol = modal.Volume.from_name(volume)

    def on_iteration(_metrics: dict[str, Any]) -> None:
        lease.check_owned(generation)  # one that lost the run commits nothing more
        vol.commit()
        deadline.iteration_done()

    try:
        summary = orchestrate(config, root, worker, resume=resume, restarted=restarted, on_iteration=on_iteration,
                              before_sample=deadline.check if orchestrator is not None else None)
    except RunLeaseError:
        raise  # another call owns the run now: commit nothing
    except BaseException:
        try:
            lease.check_owned(generation)
            vol.commit()  # the failed run's summary and last checkpoint
        except Exception as inner:  # noqa: BLE001 - the run's own error is the one to report
            log.warning("could not commit the Volume after the run failed: %s: %s", type(inner).__name__, inner)
        raise
    lease.check_owned(generation)
    vol.commit()
    if deadline.reached and summary.get("status") == "interrupted":
        nxt = orchestrator.spawn(config, True, worker=worker, orchestrator=orchestrator, predecessor=me,
                                 app_id=app_id, stopper=stopper)
        lease.hand_over(me, nxt.object_id)
        summary = {**summary, "status": "continued", "call": nxt.object_id}
    return summary
