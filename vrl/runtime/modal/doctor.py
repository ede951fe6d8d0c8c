"""`vrl modal doctor`: a first-contact check of a Modal account before a long run, costing cents.

It starts the run's own app (`app.py`, the images a run would build) and, in order:

0. starts the app: a token Modal refuses, a missing Secret, or an image that does not build is the
   checklist's one failed line (and the last: nothing else can run);
1. spawns the detached orchestrator with the arguments a detached run passes (the worker's and its own
   Function handles), in probe mode: the handles cross Modal's serializer, the orchestrator image imports
   vrl and torch, and a file uploaded to the Volume is read there and answered with a commit;
2. looks for the run's model in the Volume's Hugging Face cache (GPU workers load it offline);
3. from inside the orchestrator, calls the GPU worker in probe mode: the GPU image imports vrl, torch and
   vllm and reports whether CUDA sees the GPU;
4. starts one verifier sandbox of the run's plugin (with `verify_in: sandbox`) and times it until ready
   (for Lean: the Mathlib import of the warm-up), priced at the memory it gets; one that cannot start
   shows its verifier's own error (e.g. bubblewrap that cannot make its sandbox under gVisor);

then prints a checklist with each step's time and its cost at list prices (`cost.py`). Not checked: the
workspace's GPU limit (Modal's client has no call that reports it), which caps how many of
`max_containers` GPU workers run at once.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vrl.runtime.modal.cost import CPU_CORE_PER_S, H100_PER_S, MEMORY_GIB_PER_S, SANDBOX_CPU_FACTOR
from vrl.runtime.modal.workers import DOCTOR_DIR, worker_dtype


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
    try:
        app = build_app(config)
    except Exception as exc:  # noqa: BLE001 - the finding: a plugin that cannot be packaged, say
        add(Check("app defined (images, functions)", False, time.perf_counter() - t0, 0.0, _line(exc)))
        return checks
    started = contextlib.ExitStack()
    try:
        started.enter_context(modal_output(rt.output))
        started.enter_context(app.app.run())
    except Exception as exc:  # noqa: BLE001 - no token, no Secret, an image that does not build: the finding
        started.close()
        add(_start_failure(exc, rt, time.perf_counter() - t0))
        return checks
    with started:
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
        add(_model_check(config, volume))
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


def _line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _start_failure(exc: Exception, rt: Any, seconds: float) -> Check:
    """The checklist line of an app that did not start: the token, a Secret, or the images and functions."""
    import modal.exception

    if isinstance(exc, modal.exception.AuthError):
        return Check("Modal accepts this token", False, seconds, 0.0,
                     f"{_line(exc)} (check MODAL_TOKEN_ID and MODAL_TOKEN_SECRET, or run `modal token new`)")
    if isinstance(exc, modal.exception.NotFoundError) and "secret" in str(exc).lower():
        return Check(f"Secrets exist ({', '.join(rt.secrets)})", False, seconds, 0.0,
                     f"{_line(exc)} (create it: `modal secret create NAME KEY=VALUE`, or leave it out of "
                     "runtime.modal.secrets)")
    return Check("app starts (images build, functions register)", False, seconds, 0.0, _line(exc))


def _model_check(config: Any, volume: Any) -> Check:
    """Whether the run's model is in the Volume's Hugging Face cache: GPU workers load it offline from there
    (`vrl modal prepare` puts it there once)."""
    from vrl.generate.hf import TINY
    from vrl.runtime.modal.workers import HF_DIR

    model, t0 = config.model, time.perf_counter()
    name = f"model {model} on the Volume (workers load it offline)"
    if model == TINY:
        return Check(name, True, 0.0, 0.0, "built in every worker: nothing to load")
    from vrl.runtime.modal import models

    if models.is_local(model):  # a GGUF file or a model folder here: uploaded by its content (models.py)
        try:
            folder = config.runtime.modal.model_folder or models.volume_folder(model, worker_dtype(config))
        except Exception as exc:  # noqa: BLE001 - a missing or unreadable file: the finding
            return Check(name, False, time.perf_counter() - t0, 0.0, _line(exc))
        found = models.on_volume(volume, folder) is not None
        detail = (f"uploaded as {folder}" if found else f"not in {config.runtime.modal.volume}:{folder} yet: a run "
                  f"uploads it when it starts, or `vrl modal prepare --model {model}` now")
        return Check(name, found, time.perf_counter() - t0, 0.0, detail)
    folder = f"{HF_DIR}/models--{model.replace('/', '--')}/snapshots"
    try:
        found = [e.path for e in volume.listdir(folder, recursive=True) if e.path.endswith(".safetensors")]
    except Exception:  # noqa: BLE001 - the folder is not there (Modal raises NotFoundError or a gRPC error)
        found = []
    detail = (f"{len(found)} safetensors file(s) under {folder}" if found else
              f"not in {config.runtime.modal.volume}:{folder}; put it there with `vrl modal prepare --model {model}`")
    return Check(name, bool(found), time.perf_counter() - t0, 0.0, detail)


def _sandbox_check(config: Any, app: Any) -> Check:
    """One verifier sandbox of the run's plugin, timed from creation until it answers (Lean: Mathlib imported),
    priced at the memory it gets (a Lean sandbox: what its REPLs need); a sandbox whose verifier cannot start
    shows that verifier's own error."""
    import asyncio

    from vrl.plugins import registry
    from vrl.runtime.modal.runtime import ModalRuntime
    from vrl.runtime.modal.sandbox import SandboxUnavailable, sandbox_memory_mb, spec_for

    rt = config.runtime.modal
    one = config.model_copy(update={"runtime": config.runtime.model_copy(update={
        "modal": rt.model_copy(update={"sandboxes": 1, "sandbox_mode": "pool"})})})
    pool = ModalRuntime(one, app=app).sandboxes(one)
    spec = spec_for(registry().environment(config.plugin, **config.env_options), config.plugin, config.env_options)
    memory_mb = sandbox_memory_mb(spec, rt.sandbox_memory_mb)
    t0 = time.perf_counter()

    async def start_and_close() -> None:
        try:
            await pool.start()
        finally:
            await pool.aclose()

    try:
        asyncio.run(start_and_close())
        ok, detail = True, f"ready ({memory_mb / 1024:g} GiB)"
    except SandboxUnavailable as exc:  # what the verify server said, when it said anything
        ok, detail = False, (exc.reason.splitlines()[0] if exc.reason else _line(exc))
    except Exception as exc:  # noqa: BLE001 - the finding
        ok, detail = False, _line(exc)
    seconds = time.perf_counter() - t0
    cents = _cents(seconds, cores=rt.sandbox_cpu * SANDBOX_CPU_FACTOR, memory_gib=memory_mb / 1024)
    return Check(f"verifier sandbox ({config.plugin}) ready", ok, seconds, cents, detail)


def _cents(seconds: float, cores: float = 0.0, memory_gib: float = 0.0, gpu: bool = False) -> float:
    dollars = seconds * (cores * CPU_CORE_PER_S + memory_gib * MEMORY_GIB_PER_S + (H100_PER_S if gpu else 0.0))
    return 100 * dollars


def format_check(check: Check) -> str:
    mark = "ok  " if check.ok else "FAIL"
    return f"{mark} {check.name}: {check.seconds:.1f} s, {check.cents:.2f} ¢ — {check.detail}"
