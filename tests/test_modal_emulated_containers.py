"""What vrl's Modal containers hold, on the Modal emulator (tests/modal_emulator): issue 25, defects 1, 5, 8.

Each test reproduces one defect of issue 25's list and failed on the code it was written against (the
images before the fix); its docstring says what real Modal would do.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import importlib.util
import json
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.modal_emulated import modal_config

VersionInfo = collections.namedtuple("VersionInfo", "major minor micro releaselevel serial")
ROOT = Path(__file__).resolve().parents[1]


def test_a_plugins_verifier_runs_in_its_modal_sandbox(emu, tmp_path):
    """Defect 1 (fixed). The python-tests verifier judges one attempt inside its Modal sandbox (the attempt in
    its own bubblewrap sandbox there, under gVisor's rules: issue 54).

    Real Modal, before the fix: the sandbox image held /root/vrl and /root/vrl_python_tests as
    `add_local_python_source` ships them (*.py only, no distribution metadata), so `vrl.plugins` found
    no `vrl` entry point: the verify server answered the first ping with "cannot build the
    'python-tests' verifier" (and the bundled data/tasks.jsonl was missing too), and the pool raised
    SandboxUnavailable. Now the image installs wheels of vrl and the plugin.
    """
    from vrl.plugins import registry
    from vrl.runtime.modal.app import build_app
    from vrl.runtime.modal.runtime import ModalRuntime
    from vrl.types import Attempt, Completion, Status

    options = {}  # the default: each attempt in its bubblewrap sandbox, under gVisor's rules
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


PROBE = """
import json, os, shutil, subprocess, sys
vrl = shutil.which("vrl")
listed = subprocess.run([vrl, "plugins", "--json"], capture_output=True, text=True) if vrl else None
print(json.dumps({"cwd": os.getcwd(), "checkout": os.path.exists(sys.argv[1]), "venv": os.path.exists(sys.argv[2]),
                  "bwrap": shutil.which("bwrap"), "plugins": listed.stdout if listed else "",
                  "error": listed.stderr[-2000:] if listed else "there is no `vrl` command on PATH"}))
"""


def _lean_replay():
    """plugins/lean/tests/lean_replay.py: the kimina-lean-server stand-in the lean tests use."""
    if "lean_replay" not in sys.modules:
        spec = importlib.util.spec_from_file_location("lean_replay", ROOT / "plugins/lean/tests/lean_replay.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["lean_replay"] = module
        spec.loader.exec_module(module)
    return sys.modules["lean_replay"]


def _serve(app, image, argv, requests, network=False):
    """Run the verify server in a sandbox of `image`: send `requests` (JSON lines), return its answers."""
    import modal

    sb = modal.Sandbox.create(*argv, app=app, image=image, block_network=not network, timeout=600)
    sb.stdin.write("".join(json.dumps(r) + "\n" for r in requests))
    sb.stdin.write_eof()
    sb.stdin.drain()
    sb.wait()
    out, err = sb.stdout.read(), sb.stderr.read()
    answers = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(answers) == len(requests), f"the verify server answered {len(answers)} of {len(requests)}: {err[-3000:]}"
    return answers


@pytest.mark.parametrize("plugin", ["python-tests", "lean"])
def test_containers_hold_vrl_and_the_runs_plugins_as_installed_distributions(emu, tmp_path, plugin):
    """Defect 1, container-shaped. Each image of a run (GPU worker, orchestrator, verifier sandbox) holds
    vrl and the run's plugin as installed distributions, and only that plugin; run from /root (not the
    checkout), `vrl plugins` lists it with this checkout's version, and the verify server starts in the
    verifier image and judges: python-tests on its bundled tasks (package data), lean against the
    recorded kimina-lean-server answers the lean tests replay (lean_replay.ReplayServer on this machine).

    Failed before the fix: the images shipped vrl and every plugin as *.py files
    (`add_local_python_source`), so there was no `vrl` command, no entry point, no data/tasks.jsonl.

    What the emulated image is (tests/modal_emulator/images.py): vrl-core and the plugin are wheels built
    from this checkout and pip-installed into the image's own fresh site-packages, as the image installs
    them (metadata, entry points, package data, the `vrl` script): faithful. Their third-party
    requirements are the developer venv's copies of exactly the distributions the image's requirement
    lists resolve to (nothing else of the venv): faithful in *which* packages are there, not in their
    versions (the venv's stand for those the image would resolve; torch==2.11.0 is the venv's torch). The
    OS is this machine's, with bubblewrap only in images that `apt_install` it. Not reproduced: a
    registry image's own filesystem and Python (the kimina image here is this machine's OS and Python).
    python-tests judges each attempt in its own bubblewrap sandbox inside the verifier sandbox, under
    gVisor's rules for bubblewrap (tests/modal_emulator/gvisor.py); whether real gVisor agrees needs an
    account (docs/modal.md).
    """
    from vrl.plugins import registry
    from vrl.runtime.modal.app import build_app
    from vrl.runtime.modal.runtime import ModalRuntime

    other = "lean" if plugin == "python-tests" else "python-tests"
    distribution = {"python-tests": "vrl-python-tests", "lean": "vrl-lean"}[plugin]
    options = {"python-tests": {}, "lean": {"server": "http://127.0.0.1:9", "recheck": "off"}}
    cfg = modal_config(tmp_path, plugin=plugin, env_options=options[plugin], runtime={"verify_in": "sandbox"})
    app = build_app(cfg)
    verifier = ModalRuntime(cfg, app=app).sandboxes(cfg).factory().image  # the sandbox image the run would use
    images = {"gpu": app.images["gpu"], "orchestrator": app.images["orchestrator"], "verifier": verifier}
    venv = Path(sys.prefix)
    with app.app.run():
        import modal

        for role, image in images.items():
            sb = modal.Sandbox.create("python", "-c", PROBE, str(ROOT), str(venv), app=app.app, image=image)
            sb.wait()
            out = sb.stdout.read()
            assert out.strip(), f"{role}: the probe printed nothing: {sb.stderr.read()[-2000:]}"
            facts = json.loads(out.splitlines()[-1])
            assert facts["cwd"] == "/root" and not facts["checkout"] and not facts["venv"], (role, facts)
            assert facts["plugins"], f"{role}: `vrl plugins --json` printed nothing: {facts['error']}"
            listed = {p["name"]: p for p in json.loads(facts["plugins"])}
            assert listed["builtin"]["distribution"] == "vrl-core" and listed["builtin"]["version"] == metadata.version("vrl-core")
            mine = listed.get(plugin)
            assert mine and mine["error"] is None, (role, mine, facts["error"])
            assert (mine["distribution"], mine["version"]) == (distribution, metadata.version(distribution))
            assert other not in listed, f"{role}: {other} is installed too, but the run does not use it"
            assert bool(facts["bwrap"]) == (role == "verifier" and plugin == "python-tests"), (role, facts["bwrap"])

        server = ["python", "-m", "vrl.runtime.modal.verify_server", "--plugin", plugin]
        if plugin == "python-tests":
            task = registry().environment(plugin, **options[plugin]).tasks()[0]
            right, wrong = task.data["solution"], f"def {task.data['entry_point']}(*args):\n    return None\n"
            attempts = [{"task": task.model_dump(mode="json"), "completion": {"task_id": task.id, "text": f"```python\n{t}```"}}
                        for t in (right, wrong)]
            answers = _serve(app.app, verifier, server,
                             [{"id": 1, "op": "ping"}, {"id": 2, "op": "verify", "attempts": attempts}])
        else:
            replay = _lean_replay()
            name = "lean_workbook_101"
            proved = replay.fixture_attempt(name)
            sorry = replay.fixture_attempt(name, f"```lean4\n{proved.task.data['statement']} := by sorry\n```")
            attempts = [a.model_dump(mode="json") for a in (proved, sorry)]
            with replay.ReplayServer(replay.fixture_responder()) as kimina:
                answers = _serve(app.app, verifier, [*server, "-o", f"server={kimina.url}", "-o", "recheck=off",
                                                     "-o", "canary_rate=0"],
                                 [{"id": 1, "op": "ping"}, {"id": 2, "op": "verify", "attempts": attempts}], network=True)
    assert answers[0] == {"id": 1, "ok": True}
    verdicts = answers[1]["verdicts"]
    assert [v["passed"] for v in verdicts] == [True, False], verdicts
    assert verdicts[1]["status"] == ("failed" if plugin == "python-tests" else "rejected"), verdicts[1]


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
        out = app.sample.remote(workers.variant_to_wire(Variant(index=0)), 0, 1,
                                         config=workers.engine_config(cfg), tasks=workers.tasks_to_wire(tasks), seed=0)
    completions = out["completions"]
    assert len(completions) == 1 and completions[0]["task_id"] == tasks[0].id


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
