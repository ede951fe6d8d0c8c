"""A detached run that survives, on the Modal emulator (tests/modal_emulator): issue 25, defect 3 and
"What to build" item 3.

One orchestrator owns a run (a lease in a `modal.Dict`, checked with `FunctionCall.from_id`); a second
start is refused in one line; `vrl modal status | logs | stop NAME` see and stop it; before its
function timeout the orchestrator continues itself in a new call. Before this change there was no
lease (`vrl modal resume` started a second orchestrator beside a live one, both writing the run), no
status/logs/stop, and a run past the function timeout was killed mid-iteration.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner

from tests.modal_emulated import follow, modal_config, run_detached
from vrl.cli import main


def _wait(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


def _slow_workers(emu, seconds: float) -> None:
    """Each GPU worker input starts `seconds` late (the hook runs in the worker's request): an iteration
    then takes at least that long, whatever this machine's speed."""
    emu.on("input_started", lambda function, **_: function == "sample" and time.sleep(seconds))


def _flat(output: str) -> str:
    return " ".join(output.split())  # the console may wrap a long line


def _orchestrator_busy(emu) -> bool:
    """An orchestrator container still runs an input (a stopped one may still be saving)."""
    with emu.cond:
        return any(not c.gone and c.current is not None for c in emu.containers.values()
                   if c.pool.fn["name"] == "orchestrate")


def _orchestrator_calls(emu) -> list[str]:
    return list(dict.fromkeys(row["call"] for row in emu.log if row["function"] == "orchestrate"))


def test_one_orchestrator_owns_a_run_and_status_logs_stop_resume_manage_it(emu, tmp_path):
    """Defect 3 (two orchestrators) and `vrl modal status | logs | stop`.

    Real Modal: Volumes have no cross-container lock and the last writer of a file wins, so before the
    lease `vrl modal resume NAME` beside a live orchestrator started a second one on the same run.
    Now a second start is refused in one line, from the command line and, authoritatively, inside the
    second orchestrator's container; stop cancels the owner, and a resume then continues the run.
    """
    from vrl.runtime.modal.launch import launch_detached

    gate, members = threading.Event(), []

    def hold_the_second_iteration(function, **_):
        if function == "sample":
            members.append(function)
            if len(members) > 2:  # iteration 0's two members ran: the owner waits, alive, in iteration 1
                gate.wait(300)

    emu.on("input_started", hold_the_second_iteration)
    cfg = modal_config(tmp_path, name="owned", iterations=4)
    first = launch_detached(cfg)
    volume = emu.volume("vrl")
    try:
        _wait(lambda: (volume / "runs" / "owned" / "state.json").exists())  # iteration 0 committed
        _check_the_owner(emu, cfg, first, volume, tmp_path)
    finally:
        gate.set()
    cli = CliRunner()
    resumed = cli.invoke(main, ["modal", "resume", "owned"])
    assert resumed.exit_code == 0, resumed.output
    call = _flat(resumed.output).split("(call ")[1].split(")")[0]
    summary = follow(call, timeout=300)
    assert summary["status"] == "finished" and summary["iterations_completed"] == 4
    rows = [json.loads(line) for line in (volume / "runs" / "owned" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(4))  # no iteration written twice or lost


def _check_the_owner(emu, cfg, first, volume, tmp_path):
    """With the owner alive in iteration 1: refusals, status, stop, logs."""
    import modal

    from vrl.runtime.modal.launch import launch_detached
    from vrl.runtime.modal.lease import RunLeaseError

    cli = CliRunner()

    # A second start: refused by the client in one line (exit 2) ...
    resumed = cli.invoke(main, ["modal", "resume", "owned", "--iterations", "8"])
    assert resumed.exit_code == 2, resumed.output
    assert f"is being trained by Modal call {first}" in _flat(resumed.output) and "Traceback" not in resumed.output
    again = cli.invoke(main, ["train", "--runtime", "modal", "--detach", "--name", "owned", "-n", "2",
                              "--set", f"logging.runs_dir={tmp_path / 'runs'}", "--set", "runtime.modal.verify_in=local"])
    assert again.exit_code == 2 and "already exists on the Volume 'vrl'" in _flat(again.output), again.output
    # ... and by the orchestrator itself, should a start get past the client.
    beside = launch_detached(cfg, resume=True)
    with pytest.raises(RunLeaseError, match=f"being trained by Modal call {first}"):
        modal.FunctionCall.from_id(beside).get(timeout=120)

    status = cli.invoke(main, ["modal", "status", "owned", "--json"])
    assert status.exit_code == 0, status.output
    info = json.loads(status.output)
    assert info["running"] and info["call"] == first and info["iterations"] == 4
    assert info["iterations_completed"] == 1 and info["last"]["iteration"] == 0

    stopped = cli.invoke(main, ["modal", "stop", "owned"])
    assert stopped.exit_code == 0 and f"call {first}" in _flat(stopped.output), stopped.output
    _wait(lambda: not _orchestrator_busy(emu))

    def status_now() -> dict:
        return json.loads(cli.invoke(main, ["modal", "status", "owned", "--json"]).output)

    # The cancelled input ends at once; its container may still record "interrupted" while it handles the
    # SIGINT within the grace period, or be killed first: either way no call owns the run any more, and a
    # run that recorded no ending is shown as stopped, never as running.
    _wait(lambda: not status_now()["running"])
    status = status_now()
    assert status["iterations_completed"] == 1 and status["status"] in ("interrupted", "stopped"), status
    logs = cli.invoke(main, ["modal", "logs", "owned"])
    assert logs.exit_code == 0 and logs.output.startswith("iteration 0: reward ")
    assert "not running" in _flat(cli.invoke(main, ["modal", "stop", "owned"]).output)


def test_status_of_a_run_that_is_not_there_is_one_line(emu):
    result = CliRunner().invoke(main, ["modal", "status", "nothing-here"])
    assert result.exit_code == 2 and "no detached run 'nothing-here' on the Volume 'vrl'" in result.output


def test_the_orchestrator_continues_itself_before_its_function_timeout(emu, tmp_path):
    """Item 3: a run longer than the orchestrator's function timeout finishes, in several calls.

    Real Modal ends a call at its `timeout` (24 h at most; modal.com/docs/guide/timeouts), killing the
    loop mid-iteration (a 400-iteration Lean run is ~60 h). The emulator enforces the timeout (60 s
    here); each iteration takes at least 10 s (two members, each 5 s late, one after another in the one
    GPU container), so after four at most 20 s are left, under twice the longest iteration plus the
    6 s reserve however fast the start-up was: the orchestrator stops before an iteration that might
    not end in time, commits, and a new call resumes the run. (With 4 s, a fast start fitted all five.)
    """
    import modal

    _slow_workers(emu, 5.0)
    cfg = modal_config(tmp_path, name="long", iterations=5, runtime={"orchestrator_timeout_s": 60})
    summary = run_detached(cfg, timeout=600)
    assert summary["status"] == "finished" and summary["iterations_completed"] == 5
    assert len(_orchestrator_calls(emu)) >= 2  # it continued itself at least once, and no call timed out
    rows = b"".join(modal.Volume.from_name("vrl").read_file("runs/long/metrics.jsonl")).splitlines()
    assert [json.loads(r)["iteration"] for r in rows] == list(range(5))
    history = json.loads(b"".join(modal.Volume.from_name("vrl").read_file("runs/long/es_history.json")))
    assert len(history["iterations"]) == 5
