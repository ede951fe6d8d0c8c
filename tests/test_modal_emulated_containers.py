"""What vrl's Modal containers hold, on the Modal emulator (tests/modal_emulator): issue 25, defects 1, 5, 8.

Each test reproduces one defect of issue 25's list and fails on the code it was written against
(strict xfail: the fix turns it into a pass); its docstring says what real Modal would do.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import sys

import pytest

from tests.modal_emulated import modal_config

VersionInfo = collections.namedtuple("VersionInfo", "major minor micro releaselevel serial")


@pytest.mark.xfail(strict=True, reason="issue 25 defect 1: in a Modal container no plugin exists (images ship "
                   "vrl's *.py files, not installed distributions with entry points and package data), so the "
                   "python-tests verifier sandbox answers \"cannot build the verifier\"")
def test_a_plugins_verifier_runs_in_its_modal_sandbox(emu, tmp_path):
    """Defect 1. The python-tests verifier judges one attempt inside its Modal sandbox.

    Real Modal: the sandbox image holds /root/vrl and /root/vrl_python_tests as `add_local_python_source`
    ships them (*.py only, no distribution metadata), so `vrl.plugins` finds no `vrl` entry point: the
    verify server answers the first ping with "cannot build the 'python-tests' verifier" (and the bundled
    data/tasks.jsonl is missing too), and the pool raises SandboxUnavailable.
    """
    from vrl.plugins import registry
    from vrl.runtime.modal.app import build_app
    from vrl.runtime.modal.runtime import ModalRuntime
    from vrl.types import Attempt, Completion, Status

    options = {"sandbox": "unsafe-local"}  # the attempt's own sandbox is not what this test is about
    cfg = modal_config(tmp_path, plugin="python-tests", env_options=options,
                       runtime={"verify_in": "sandbox", "sandboxes": 1})
    runtime = ModalRuntime(cfg, app=build_app(cfg))
    pool = runtime.sandboxes(cfg)
    task = registry().environment("python-tests", **options).tasks()[0]
    attempt = Attempt(task=task, completion=Completion(task_id=task.id, text="```python\ndef f():\n    pass\n```"))

    async def judge():
        try:
            return await pool.verify([attempt])
        finally:
            await pool.aclose()

    with runtime.app.app.run():
        verdicts = asyncio.run(judge())
    assert len(verdicts) == 1 and verdicts[0].status is not Status.CRASHED


def test_the_gpu_worker_deserializes_for_a_client_on_another_python(emu, tmp_path):
    """Defect 5. A client on Python 3.12 (emulated) samples once on the GPU worker.

    Real Modal: `build_app` declares every function `serialized=True`, so Modal sends the class as the
    client's cloudpickle made it; the GPU image is `debian_slim(python_version="3.11")`, and a 3.12
    pickle does not load in 3.11: the container fails with DeserializationError ("version mismatch
    between local and remote environments"). The image's Python must follow the client's: read when
    the app is built (or left to Modal's default, the local Python).
    """
    from vrl.plugins import registry
    from vrl.policy import Variant
    from vrl.runtime.modal import images, workers
    from vrl.runtime.modal.app import build_app

    cfg = modal_config(tmp_path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "version_info", VersionInfo(3, 12, 0, "final", 0))
        importlib.reload(images)  # a module-level choice of Python sees the client's version too
        try:
            app = build_app(cfg)
        finally:
            patch.undo()
            importlib.reload(images)
    tasks = registry().environment("countdown").tasks()[:1]
    with app.app.run():
        out = app.worker().sample.remote(workers.variant_to_wire(Variant(index=0)), 0, 1,
                                         config=workers.engine_config(cfg), tasks=workers.tasks_to_wire(tasks), seed=0)
    assert len(out) == 1 and out[0]["task_id"] == tasks[0].id


def test_images_install_pinned_packages_from_the_right_index(emu, tmp_path):
    """Defect 8. What Modal's image builder would run for each role's image.

    Real Modal runs `uv pip install --extra-index-url https://download.pytorch.org/whl/cpu <packages>`
    (modal/_image.py `uv_pip_install`) with uv's default index strategy `first-index`: "Only use results
    from the first index that returns a match for a given package name" (uv's IndexStrategy), and an
    extra index comes before PyPI, so jinja2, requests, numpy, ... come from the PyTorch index alone, at
    whatever old versions it mirrors. The GPU image asks for `vllm>=0.10` and bare `torch`: every build
    takes the newest, untested pair. And a detached GRPO run with `orchestrator_gpu` pays for a GPU
    whose image holds CPU-only torch.
    """
    from vrl.runtime.modal.app import build_app
    from vrl.runtime.modal.images import verifier_recipe

    cfg = modal_config(tmp_path, runtime={"orchestrator_gpu": "L40S"})
    app = build_app(cfg)
    images = {**app.images, "verifier": verifier_recipe(None).build()}
    problems = []
    for role, image in images.items():
        for command in image.pip_commands():
            if "--extra-index-url" in command and "--index-strategy unsafe-best-match" not in command:
                problems.append(f"{role}: `{command[:120]}...` takes every package its extra index has from that "
                                "index alone (uv's first-index strategy)")
    gpu_packages = " ".join(app.images["gpu"].pip_commands()).split()
    for name in ("vllm", "torch"):
        pinned = [p for p in gpu_packages if p.split("==")[0].split(">")[0].split("[")[0] == name and "==" in p]
        if not pinned:
            problems.append(f"gpu: {name} is not pinned (==)")
    if "download.pytorch.org/whl/cpu" in " ".join(app.images["orchestrator"].pip_commands()):
        problems.append("orchestrator: runtime.orchestrator_gpu is set, but its image installs CPU-only torch")
    assert not problems, "\n".join(problems)
