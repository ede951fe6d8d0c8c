"""What the emulated-Modal tests of vrl share (tests/test_modal_emulated_*.py): the run they start from.

The emulator itself (tests/modal_emulator) knows nothing of vrl; this module builds vrl's configs and
starts vrl's real entry points against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vrl.config import build

#: A tiny ES run on the countdown built-in: one container of the tiny model, seconds per iteration.
BASE = {
    "plugin": "countdown",
    "iterations": 2,
    "tasks_per_iteration": 2,
    "es": {"population_size": 2, "sigma": 0.05},
    "generator": {"dtype": "float32", "device": "cpu"},
    "sampling": {"max_new_tokens": 8, "batch_size": 2},
}
#: The Modal settings every emulated run starts from (verification in the orchestrator unless a test
#: is about sandboxes). One GPU container: each one that generates imports torch and transformers (4-6
#: CPU-seconds of the test run), and the members of an iteration run one after another in it; a test
#: about several containers at once asks for more.
MODAL = {"verify_in": "local", "max_containers": 1, "sandbox_start_timeout_s": 120.0}


def modal_config(tmp_path: Path, name: str = "run", runtime: dict[str, Any] | None = None, **layers: Any):
    """A `TrainConfig` for `--runtime modal` with the Modal settings `runtime` (`runtime.modal.*`) on top of `MODAL`."""
    settings = {**MODAL, **(runtime or {})}
    logging = {"logging": {"runs_dir": str(tmp_path / "runs"), "name": name}}
    return build(BASE, logging, layers, {"runtime": {"kind": "modal", "modal": settings}})


def run_detached(config: Any, timeout: float = 300.0) -> Any:
    """`vrl train --detach`: start the orchestrator on (emulated) Modal and wait for its result."""
    from vrl.runtime.modal.launch import launch_detached

    return follow(launch_detached(config), timeout)


def follow(call_id: str, timeout: float = 300.0) -> Any:
    """A detached run's result, through its continuations (each a new call: the orchestrator continues
    itself before its function timeout and returns {"status": "continued", "call": <the next call>})."""
    import modal

    result = modal.FunctionCall.from_id(call_id).get(timeout=timeout)
    while isinstance(result, dict) and result.get("status") == "continued":
        result = modal.FunctionCall.from_id(result["call"]).get(timeout=timeout)
    return result
