"""`vrl modal doctor`: a first-contact check of a Modal account before a long run, costing cents.

It starts the run's own app (`app.py`, the images a run would build) and, in order:

1. spawns the detached orchestrator with the arguments a detached run passes (the worker's and its own
   Function handles), in probe mode: the handles cross Modal's serializer, the orchestrator image imports
   vrl and torch, and a file uploaded to the Volume is read there and answered with a commit;
2. from inside the orchestrator, calls the GPU worker in probe mode: the GPU image imports vrl, torch and
   vllm and reports whether CUDA sees the GPU;
3. starts one verifier sandbox of the run's plugin (with `verify_in: sandbox`) and times it until ready
   (for Lean: the Mathlib import of the warm-up);

then prints a checklist with each step's time and its cost at list prices (`cost.py`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vrl.runtime.modal.cost import CPU_CORE_PER_S, H100_PER_S, MEMORY_GIB_PER_S, SANDBOX_CPU_FACTOR
from vrl.runtime.modal.workers import DOCTOR_DIR


@dataclass
class Check:
    """One line of the checklist."""

    name: str
    ok: bool
    seconds: float
    cents: float
    detail: str


def _versions(report: dict[str, Any], names: tuple[str, ...]) -> tuple[bool, str]:
    bad = [n for n in names if str(report.get(n, "")).startswith("not ")]
    text = ", ".join(f"{n} {report.get(n)}" for n in names)
    return not bad, text


def run(config: Any, say: Callable[[str], None] = print) -> list[Check]:
    """Run the checks against the account configured here; each result as it comes (`say`)."""
    import io

    import modal

    from vrl.config import dump
    from vrl.runtime.modal.app import build_app
    from vrl.runtime.modal.credentials import require_credentials
    from vrl.runtime.modal.output import modal_output

    require_credentials()
    rt = config.runtime.modal
    checks: list[Check] = []

    def add(check: Check) -> None:
        checks.append(check)
        say(format_check(check))

    token = secrets.token_hex(8)
    volume = modal.Volume.from_name(rt.volume, create_if_missing=True)
    t0 = time.perf_counter()
    app = build_app(config)
    with modal_output(rt.output), app.app.run():
        add(Check("app starts (images defined, functions registered)", True, time.perf_counter() - t0, 0.0,
                  f"app {app.app.app_id}"))
        with volume.batch_upload(force=True) as batch:
            batch.put_file(io.BytesIO(token.encode()), f"{DOCTOR_DIR}/{token}.txt")
        t1 = time.perf_counter()
        try:
            report = app.orchestrate.spawn(dump(config), False, worker=app.sample, orchestrator=app.orchestrate,
                                           app_id=app.app.app_id, stopper=app.stop_app, probe=token).get(timeout=3600)
        except Exception as exc:  # noqa: BLE001 - the first failure is the finding
            seconds = time.perf_counter() - t1
            add(Check("detached orchestrator starts with a run's arguments", False, seconds,
                      _cents(seconds, cores=2.0), f"{type(exc).__name__}: {exc}".splitlines()[0]))
            return checks
        seconds = time.perf_counter() - t1
        ok, text = _versions(report["orchestrator"], ("vrl", "torch"))
        add(Check("orchestrator image imports vrl, torch; the handles crossed", ok, seconds - report["worker_s"],
                  _cents(seconds, cores=2.0), text))
        back = b"".join(volume.read_file(f"{DOCTOR_DIR}/{token}.back")).decode()
        add(Check("Volume round trip (upload, read and commit in a container, read)", back == token[::-1],
                  report["volume_s"], 0.0, f"{rt.volume}:{DOCTOR_DIR}/{token}.back"))
        worker = report["worker"]
        ok, text = _versions(worker, ("vrl", "torch", "vllm"))
        gpu_cents = _cents(report["worker_s"], cores=rt.cpu, memory_gib=rt.memory_mb / 1024, gpu=True)
        add(Check("GPU image imports vrl, torch, vllm", ok, report["worker_s"], gpu_cents, text))
        add(Check(f"CUDA sees the GPU ({rt.gpu})", bool(worker.get("cuda")), 0.0, 0.0,
                  worker.get("device") or "CUDA not available in the GPU container"))
        if rt.verify_in == "sandbox":
            add(_sandbox_check(config, app))
        for name in (f"{token}.txt", f"{token}.back"):
            volume.remove_file(f"{DOCTOR_DIR}/{name}")
    return checks


def _sandbox_check(config: Any, app: Any) -> Check:
    """One verifier sandbox of the run's plugin, timed from creation until it answers (Lean: Mathlib imported)."""
    import asyncio

    from vrl.runtime.modal.runtime import ModalRuntime

    rt = config.runtime.modal
    one = config.model_copy(update={"runtime": config.runtime.model_copy(update={
        "modal": rt.model_copy(update={"sandboxes": 1, "sandbox_mode": "pool"})})})
    pool = ModalRuntime(one, app=app).sandboxes(one)
    t0 = time.perf_counter()

    async def start_and_close() -> None:
        try:
            await pool.start()
        finally:
            await pool.aclose()

    try:
        asyncio.run(start_and_close())
        ok, detail = True, "ready"
    except Exception as exc:  # noqa: BLE001 - the finding
        ok, detail = False, f"{type(exc).__name__}: {exc}".splitlines()[0]
    seconds = time.perf_counter() - t0
    cents = _cents(seconds, cores=rt.sandbox_cpu * SANDBOX_CPU_FACTOR, memory_gib=rt.sandbox_memory_mb / 1024)
    return Check(f"verifier sandbox ({config.plugin}) ready", ok, seconds, cents, detail)


def _cents(seconds: float, cores: float = 0.0, memory_gib: float = 0.0, gpu: bool = False) -> float:
    dollars = seconds * (cores * CPU_CORE_PER_S + memory_gib * MEMORY_GIB_PER_S + (H100_PER_S if gpu else 0.0))
    return 100 * dollars


def format_check(check: Check) -> str:
    mark = "ok  " if check.ok else "FAIL"
    return f"{mark} {check.name}: {check.seconds:.1f} s, {check.cents:.2f} ¢ — {check.detail}"
