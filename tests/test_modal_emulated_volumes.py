"""vrl's use of the Modal Volume on the Modal emulator (tests/modal_emulator): issue 25, defect 4.

Each test reproduces one part of the defect and fails on the code it was written against (strict
xfail: the fix turns it into a pass); its docstring says what real Modal would do.
"""

from __future__ import annotations

import pytest

from tests.modal_emulated import modal_config, run_detached


@pytest.mark.xfail(strict=True, reason="issue 25 defect 4: GRPO with the loop on the user's machine calls "
                   "volume.commit(), which Modal refuses outside a container, so workers never see the weights")
def test_grpo_with_the_loop_here_publishes_weights_the_workers_load(emu, tmp_path):
    """Defect 4 (local loop). GRPO trains here and samples on Modal GPU workers for two iterations.

    Real Modal: `ModalPolicy.publish` writes the weights to a local directory and calls
    `app.volume.commit()` from the client: "commit() can only be called on a mounted volume inside a
    container" (RuntimeError), so the first update stops the run; and the path it hands the workers is
    a path on this machine. Weights from a local loop must reach the Volume by upload (batch_upload).
    """
    import modal

    from vrl.runtime.modal.app import build_app
    from vrl.runtime.modal.runtime import ModalRuntime
    from vrl.trainer import Trainer

    cfg = modal_config(tmp_path, name="grpo", optimizer="grpo", grpo={"num_generations": 2})
    # The local staging directory is this test's (today's default, /vrl, is a path on the user's machine).
    runtime = ModalRuntime(cfg, app=build_app(cfg), volume_root=tmp_path / "staging")
    summary = Trainer(cfg, runtime=runtime).run()
    assert summary["status"] == "finished" and summary["iterations_completed"] == 2
    published = modal.Volume.from_name("vrl").listdir("runs/grpo/weights")  # runtime volume: the default
    assert any(entry.path.endswith(".safetensors") for entry in published)


@pytest.mark.xfail(strict=True, reason="issue 25 defect 4: volume.commit() reloads, and Modal refuses a reload "
                   "while files of the Volume are open: the detached run holds its run-directory lock open")
def test_a_detached_run_commits_the_volume_after_each_iteration(emu, tmp_path):
    """Defect 4 (detached). A detached run finishes two iterations, committing after each.

    Real Modal: `Volume.commit()` commits and then reloads (modal/volume.py), and "Reloading will fail
    if there are open files for the volume": the orchestrator's `RunDir` keeps runs/<name>/lock open
    (its flock) for the whole run, so the first `on_iteration` commit raises RuntimeError ("there are
    open files preventing the operation") and the run fails after one iteration.
    """
    import modal

    summary = run_detached(modal_config(tmp_path, name="committed"))
    assert summary["status"] == "finished" and summary["iterations_completed"] == 2
    metrics = b"".join(modal.Volume.from_name("vrl").read_file("runs/committed/metrics.jsonl")).splitlines()
    assert len(metrics) == 2
