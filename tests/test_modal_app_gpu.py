"""The GPU worker's GPU fallback list and `min_containers`, declared with the real `modal` package.

Kept apart from tests/test_modal_generation.py, whose emulator swaps a fake `modal` in for the whole
module: this checks what the installed modal 1.6 accepts (building an app needs no account).
"""

from __future__ import annotations

import pytest

from vrl.config import ConfigError, build
from vrl.runtime.modal.app import build_app

pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning:vrl")  # vrl's own deprecations fail

BASE = {"plugin": "letters", "generator": {"dtype": "float32", "device": "cpu"}}


def test_the_gpu_worker_takes_a_gpu_fallback_list_and_min_containers():
    """Issue 25 item 4: `runtime.modal.gpu` may be a list (modal 1.6's `gpu=` takes one and tries the
    types in order) and `min_containers` keeps workers warm while the run's app runs; both reach the
    worker's declaration, built with the real modal package."""
    import modal

    assert "modal_emulator" not in str(modal.__file__)  # the installed package, not the emulator's fake
    cfg = build(BASE, {"runtime": {"kind": "modal", "modal": {"gpu": ["H100", "A100-80GB"], "min_containers": 2}}})
    app = build_app(cfg)
    assert app.sample._spec_.gpus == ["H100", "A100-80GB"]
    assert app.options["gpu"]["gpu"] == ["H100", "A100-80GB"] and app.options["gpu"]["min_containers"] == 2
    assert "min_containers" not in build_app(build(BASE, {"runtime": {"kind": "modal"}})).options["gpu"]
    with pytest.raises(ConfigError, match="at least 1 item"):
        build(BASE, {"runtime": {"kind": "modal", "modal": {"gpu": []}}})
