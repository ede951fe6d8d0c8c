"""The detached run's lease and deadline rules, on their own (no Modal, no emulator).

`RunLease` takes any store with modal.Dict's `get` / `contains` / `put(skip_if_exists=)` and any
`alive(call_id)`; `Deadline` any clock. The emulated end-to-end runs are in
tests/test_modal_emulated_lease.py and tests/test_modal_emulated_detached.py.
"""

from __future__ import annotations

import pytest

from vrl.runtime.modal.detached import Continue, Deadline
from vrl.runtime.modal.lease import RunLease, RunLeaseError


class Store:
    """modal.Dict's semantics in memory: `put(skip_if_exists=True)` writes only a missing key."""

    def __init__(self):
        self.data = {}

    def get(self, key, default=None):
        return self.data.get(key, default)

    def contains(self, key):
        return key in self.data

    def put(self, key, value, *, skip_if_exists=False):
        if skip_if_exists and key in self.data:
            return False
        self.data[key] = value
        return True


def test_one_call_owns_a_run_a_restart_keeps_it_and_a_live_owner_refuses_others():
    store, live = Store(), {"fc-a", "fc-b"}
    lease = RunLease("vrl", "run", store=store, alive=lambda call: call in live)
    assert lease.owner() is None
    assert lease.claim("fc-a") == 1
    assert lease.claim("fc-a") == 1  # Modal restarted fc-a's input: it still owns the run
    with pytest.raises(RunLeaseError, match="being trained by Modal call fc-a; .*vrl modal stop run"):
        lease.claim("fc-b")
    live.discard("fc-a")  # fc-a finished (or was stopped): a resume takes the run over
    assert lease.claim("fc-b") == 2 and lease.owner().call_id == "fc-b"
    with pytest.raises(RunLeaseError, match="taken over by Modal call fc-b"):
        lease.check_owned(1)  # fc-a, should it still run, stops before writing again
    lease.check_owned(2)


def test_a_continuation_takes_the_run_from_its_live_predecessor_and_only_it_does():
    store = Store()
    lease = RunLease("vrl", "run", store=store, alive=lambda call: True)
    lease.claim("fc-a")
    with pytest.raises(RunLeaseError):
        lease.claim("fc-c", predecessor="fc-x")  # not the owner's successor
    assert lease.claim("fc-b", predecessor="fc-a") == 2
    lease.hand_over("fc-a", "fc-b")
    assert lease.successor_of("fc-a") == "fc-b" and lease.successor_of("fc-b") is None


def test_two_claims_of_one_generation_one_wins():
    """Two resumes that both saw a finished owner: `put(skip_if_exists=True)` lets one write generation 2."""
    store = Store()
    first = RunLease("vrl", "run", store=store, alive=lambda call: False)
    first.claim("fc-a")
    stale = first.owner()
    first.claim("fc-b")
    late = RunLease("vrl", "run", store=store, alive=lambda call: False)
    late.owner = lambda: stale  # it read the owner before fc-b claimed generation 2
    with pytest.raises(RunLeaseError, match="was just started by Modal call fc-b"):
        late.claim("fc-c")


def test_leases_of_other_runs_and_volumes_are_separate():
    store = Store()
    RunLease("vrl", "a", store=store, alive=lambda call: True).claim("fc-a")
    assert RunLease("vrl", "b", store=store).owner() is None
    assert RunLease("other", "a", store=store).owner() is None


def test_the_deadline_stops_before_an_iteration_that_might_not_fit():
    now = [0.0]
    deadline = Deadline(1000.0, clock=lambda: now[0])
    assert deadline.reserve_s == 100.0
    deadline.check()  # a call runs at least one iteration, however long
    now[0] = 300.0
    deadline.iteration_done()  # the first iteration (with start-up): 300 s
    deadline.check()  # 700 s left >= 2 * 300 + 100
    now[0] = 350.0
    deadline.iteration_done()
    with pytest.raises(Continue, match="650 s left of the 1000 s"):
        deadline.check()
    assert deadline.reached and issubclass(Continue, KeyboardInterrupt)  # the trainer stops as on Ctrl-C


def test_the_latest_call_follows_a_hand_over_not_yet_claimed():
    store = Store()
    lease = RunLease("vrl", "run", store=store, alive=lambda call: True)
    assert lease.latest_call() is None
    lease.claim("fc-a")
    lease.hand_over("fc-a", "fc-b")  # fc-b was spawned and has not started yet
    assert lease.latest_call() == "fc-b"
    lease.claim("fc-b", predecessor="fc-a")
    assert lease.latest_call() == "fc-b" and lease.owner().generation == 2


def test_a_resume_is_refused_while_a_spawned_continuation_has_not_claimed_the_run_yet():
    store, live = Store(), {"fc-b"}
    lease = RunLease("vrl", "run", store=store, alive=lambda call: call in live)
    lease.claim("fc-a")
    lease.hand_over("fc-a", "fc-b")  # fc-a returned; fc-b is starting
    with pytest.raises(RunLeaseError, match="being trained by Modal call fc-b"):
        lease.check_free()
    assert lease.claim("fc-b", predecessor="fc-a") == 2


def test_a_run_directory_can_keep_its_writer_lock_outside_itself(tmp_path):
    """Defect 4: a Modal Volume refuses to reload (and so to commit) while a file of it is open; the
    detached orchestrator's run directory holds its flock on a file in `lock_dir` instead."""
    import os

    from vrl.config import build
    from vrl.errors import RunDirError
    from vrl.rundir import RunDir

    cfg = build({"logging": {"runs_dir": str(tmp_path / "volume" / "runs"), "name": "r"}})
    run = RunDir.create(cfg, lock_dir=tmp_path / "locks")
    try:
        open_files = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                      if os.path.exists(f"/proc/self/fd/{fd}")]
        assert not [f for f in open_files if f.startswith(str(tmp_path / "volume"))]
        assert run.lock_path == tmp_path / "locks" / "r.lock" and not (run.path / "lock").exists()
        with pytest.raises(RunDirError, match="is being written by process"):
            RunDir.open(run.path, tmp_path / "locks").acquire()
    finally:
        run.release()
    again = RunDir.open(run.path, tmp_path / "locks")
    again.acquire()  # released: free again
    assert again.locked
    again.release()


def test_status_shows_a_run_no_call_owns_that_recorded_no_ending_as_stopped(monkeypatch):
    """`vrl modal status`: a summary still saying "running" whose owner call is gone (stopped or killed
    before it could record its end) reads "stopped"; a live owner, or a recorded ending, is shown as is."""
    import json

    from vrl.runtime.modal import launch

    monkeypatch.setattr(launch, "require_credentials", lambda: None)
    files = {"runs/r/config.json": {"iterations": 4}, "runs/r/state.json": {"iteration": 1}}

    class Lease:
        def __init__(self, alive):
            self._alive = alive

        def latest_call(self):
            return "fc-1"

        def alive(self, call):
            return self._alive

        def outcome(self, call):
            return ("running" if self._alive else "finished"), None

        def launch(self):
            return None

    def read(volume, path):  # what `read_volume_file` does: bytes, or FileNotFoundError
        if path not in files:
            raise FileNotFoundError(path)
        return json.dumps(files[path]).encode()

    for recorded, alive, shown in (("running", False, "stopped"), ("running", True, "running"),
                                   ("interrupted", False, "interrupted"), ("finished", False, "finished")):
        files["runs/r/summary.json"] = {"status": recorded}
        info = launch.run_status("r", read=read, lease=Lease(alive))
        assert (info["status"], info["running"], info["iterations_completed"]) == (shown, alive, 1)


def test_status_of_a_run_that_failed_before_its_run_directory_shows_the_error(monkeypatch):
    """Issue 40 item 3: the launch record outlives a removed run directory. What the orchestrator recorded
    at its end is shown; when it recorded nothing (Modal failed the call before any vrl code ran, e.g. an
    argument that does not deserialize), the call's own exception; a run never launched is one line."""
    from vrl.errors import RunDirError
    from vrl.runtime.modal import launch

    monkeypatch.setattr(launch, "require_credentials", lambda: None)

    def read(volume, path):
        raise FileNotFoundError(path)  # no run directory on the Volume

    remote = "DeserializationError: Encountered an error when deserializing an object in the remote environment"
    store = Store()
    lease = RunLease("vrl", "r", store=store, alive=lambda call: False, outcome=lambda call: ("failed", remote))
    with pytest.raises(RunDirError, match="no detached run 'r'"):
        launch.run_status("r", read=read, lease=lease)
    lease.record_launch("fc-1", "ap-1")
    info = launch.run_status("r", read=read, lease=lease)
    assert (info["status"], info["error"], info["call"], info["app"]) == ("failed", remote, "fc-1", "ap-1")
    lease.record_end("OSError: no-such-org/no-such-model is not a local folder")
    info = launch.run_status("r", read=read, lease=lease)
    assert (info["status"], info["error"]) == ("failed", "OSError: no-such-org/no-such-model is not a local folder")
    running = RunLease("vrl", "r", store=store, alive=lambda call: True, outcome=lambda call: ("running", None))
    running.record_launch("fc-2", "ap-2")  # the record of a call still running is kept by a start beside it
    assert running.launch()["call"] == "fc-2"  # (fc-1 has ended: replaced)
    running.record_launch("fc-3", "ap-3")
    assert running.launch()["call"] == "fc-2"
