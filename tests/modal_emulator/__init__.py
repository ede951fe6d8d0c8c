"""A Modal emulator for the tests: vrl's real Modal code runs against Modal's documented semantics.

`emulated_modal(state_dir)` swaps a fake `modal` package (fake/modal, the 1.6.4 names vrl uses) in for
the real one in this process and starts the emulated service (service.py: containers as processes in
their image's filesystem, calls, Volumes, Sandboxes; its docstring lists every rule and where Modal
states it). Every container and sandbox imports the same fake package. No account, no network.

Containers are bubblewrap sandboxes (`bwrap`, as the python-tests plugin uses): without a working
`bwrap` the emulator, and every test that needs it, is skipped. Inside its containers and sandboxes,
`bwrap` follows gVisor's rules (gvisor.py), as it does on Modal. A function container whose kind (image,
function, environment, mounts) started before is forked from a zygote that imported what such a
container imports (zygote.py); `VRL_MODAL_EMULATOR_FRESH=1` starts every one in a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from tests.modal_emulator.images import FAKE
from tests.modal_emulator.service import Service

__all__ = ["Service", "emulator_problem", "emulated_modal", "emulated_service"]


@functools.cache
def emulator_problem() -> str | None:
    """Why the emulator cannot run here (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("cloudpickle") is None:  # pickles functions as Modal does (dev extra, via mlflow)
        return "cloudpickle is not installed"
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    probe = subprocess.run(["bwrap", "--ro-bind", "/", "/", "--unshare-pid", "--proc", "/proc", "--dev", "/dev",
                            "--tmpfs", "/opt", "true"], capture_output=True, text=True)
    if probe.returncode:
        return f"bwrap cannot make a container here: {probe.stderr.strip()}"
    return None


@contextlib.contextmanager
def emulated_modal(state_dir: Path, seed: int = 0, limit_s: float = 900.0) -> Iterator[Service]:
    """The fake `modal` importable here, backed by a fresh emulated service (closed on exit, or after
    `limit_s` seconds: then every pending call raises instead of hanging the test run)."""
    saved = {name: mod for name, mod in sys.modules.items() if name == "modal" or name.startswith("modal.")}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(FAKE))
    service = Service(Path(state_dir), seed)
    env_before = {key: os.environ.get(key) for key in service.env}
    limit = threading.Timer(limit_s, service.close)  # a test that hangs fails instead: every call raises
    limit.daemon = True
    try:
        service.start()
        limit.start()
        os.environ.update(service.env)
        yield service
    finally:
        limit.cancel()
        service.close()
        if "modal._emu" in sys.modules:
            sys.modules["modal._emu"].close_all()
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for name in [n for n in sys.modules if n == "modal" or n.startswith("modal.")]:
            del sys.modules[name]
        sys.path.remove(str(FAKE))
        sys.modules.update(saved)


def emulated_service(tmp_path: Path, monkeypatch, seed: int = 0) -> Iterator[Service]:
    """Body of a test fixture: a token set (as after `modal setup`), the emulator running, skip if it cannot."""
    import pytest

    problem = emulator_problem()
    if problem:
        pytest.skip(f"the Modal emulator cannot run here: {problem}")
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-emulated")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-emulated")
    with emulated_modal(tmp_path / "modal", seed) as service:
        yield service
