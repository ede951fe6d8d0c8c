"""vrl's use of the Modal Volume on the Modal emulator (tests/modal_emulator): issue 25, defect 4.

Each test reproduces one part of the defect and failed on the code it was written against; its
docstring says what real Modal would do and what the fix does.
"""

from __future__ import annotations

import io

import pytest

from tests.modal_emulated import modal_config, run_detached


def test_grpo_with_the_loop_here_publishes_weights_the_workers_load(emu, tmp_path):
    """Defect 4 (local loop). GRPO trains here and samples on Modal GPU workers for two iterations.

    Real Modal: `ModalPolicy.publish` writes the weights to a local directory and calls
    `app.volume.commit()` from the client: "commit() can only be called on a mounted volume inside a
    container" (RuntimeError), so the first update stops the run; and the path it hands the workers is
    a path on this machine. Fixed: weights from a local loop reach the Volume by `batch_upload()`
    (vrl/runtime/modal/volume.py) and the workers get the path under their own mount.
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


def test_a_detached_run_commits_the_volume_after_each_iteration(emu, tmp_path):
    """Defect 4 (detached). A detached run finishes two iterations, committing after each.

    Real Modal: `Volume.commit()` commits and then reloads (modal/volume.py), and "Reloading will fail
    if there are open files for the volume": the orchestrator's `RunDir` keeps runs/<name>/lock open
    (its flock) for the whole run, so the first `on_iteration` commit raises RuntimeError ("there are
    open files preventing the operation") and the run fails after one iteration. Fixed: the lock is
    kept outside the Volume (detached.LOCK_DIR); the run lease guards the run across containers.
    """
    import modal

    summary = run_detached(modal_config(tmp_path, name="committed"))
    assert summary["status"] == "finished" and summary["iterations_completed"] == 2
    metrics = b"".join(modal.Volume.from_name("vrl").read_file("runs/committed/metrics.jsonl")).splitlines()
    assert len(metrics) == 2


def test_a_detached_grpo_run_commits_its_weights_for_the_workers(emu, tmp_path):
    """Defect 4 (detached GRPO). The orchestrator trains in its container and publishes by `commit()`.

    Real Modal: the run stopped at its first commit (the run-dir lock held open, as above), and
    `publish` itself committed nothing in the container (`app=None`). Now the weights are written to
    the mounted Volume and committed at once (nothing of the Volume held open), each worker call
    reloads before loading them, and the two newest versions stay on the Volume.
    """
    import modal

    cfg = modal_config(tmp_path, name="grpo-detached", optimizer="grpo", grpo={"num_generations": 2})
    summary = run_detached(cfg)
    assert summary["status"] == "finished" and summary["iterations_completed"] == 2
    published = [e.path for e in modal.Volume.from_name("vrl").listdir("runs/grpo-detached/weights")]
    assert published == ["runs/grpo-detached/weights/v000001.safetensors",
                         "runs/grpo-detached/weights/v000002.safetensors"]


def test_a_never_used_volume_is_created_by_its_first_use_only_when_asked(emu):
    """modal/volume.py `from_name` hydrates lazily: with create_if_missing=True the first use (here an upload from
    the user's machine, before any app has mounted the Volume) creates it; without, the same use is refused."""
    import modal
    from modal.exception import NotFoundError

    with pytest.raises(NotFoundError, match="Volume 'never-used' not found"):
        modal.Volume.from_name("never-used").listdir("/")
    volume = modal.Volume.from_name("never-used", create_if_missing=True)
    with volume.batch_upload() as batch:
        batch.put_file(io.BytesIO(b"weights"), "models/a/model.safetensors")
    assert b"".join(modal.Volume.from_name("never-used").read_file("models/a/model.safetensors")) == b"weights"
    assert [e.path for e in volume.listdir("models", recursive=True)] == ["models/a", "models/a/model.safetensors"]
