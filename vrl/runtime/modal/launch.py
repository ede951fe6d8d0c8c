"""Entry points that talk to the Modal service: `vrl modal prepare`, detached training and its
`vrl modal resume | status | logs | stop NAME`.

All need a Modal account (`pip install 'vrl-core[modal]'`, then `modal setup`); without credentials they
fail at once with that advice.
"""

from __future__ import annotations

import logging
from typing import Any

from vrl.config import dump
from vrl.runtime.modal.credentials import NO_ACCOUNT, ModalUnavailable, require_credentials
from vrl.runtime.modal.output import modal_output

log = logging.getLogger(__name__)

def _modal_errors():
    import modal.exception

    return modal.exception.AuthError


def prepare(config: Any, model: str, revision: str | None = None) -> dict[str, Any]:
    """Put `model` (weights + tokenizer) on the run's Volume once: a Hub id from inside Modal; a local model (a
    GGUF file, converted here first, or a model folder) uploaded from this machine, no app started (models.py).
    "downloaded" says whether anything was put there now."""
    from vrl.runtime.modal import models
    from vrl.runtime.modal.app import build_app

    if models.is_local(model):
        modal_section = config.runtime.modal.model_copy(update={"model_folder": None})  # placed from `model` now
        config = config.model_copy(update={"model": model, "runtime": config.runtime.model_copy(
            update={"modal": modal_section})})
        models.place(config)  # a missing or unreadable file: one line, before any Modal call
        require_credentials()
        import modal

        try:
            info = models.upload(config, modal.Volume.from_name(config.runtime.modal.volume, create_if_missing=True))
        except _modal_errors() as exc:
            raise ModalUnavailable(NO_ACCOUNT.format(error=exc)) from None
        return {**info, "revision": None, "downloaded": info["uploaded"]}
    app = build_app(config)
    try:
        with modal_output(config.runtime.modal.output), app.app.run():
            return app.prepare_model.remote(model, revision)
    except _modal_errors() as exc:
        raise ModalUnavailable(NO_ACCOUNT.format(error=exc)) from None


def read_volume_file(volume: str, path: str) -> bytes:
    """A file of a Modal Volume (needs an account)."""
    import modal

    try:
        return b"".join(modal.Volume.from_name(volume).read_file(path))
    except _modal_errors() as exc:
        raise RuntimeError(NO_ACCOUNT.format(error=exc)) from None
    except Exception as exc:  # noqa: BLE001 - modal raises NotFoundError / grpc errors for a missing file
        raise FileNotFoundError(f"cannot read {path} on the Modal Volume {volume!r}: {exc}") from None


def recorded_config(name: str, volume: str, iterations: int | None, read: Any = read_volume_file) -> Any:
    """The config a detached run `name` recorded on the Volume, with `iterations` raised if given.

    `read(volume, path) -> bytes` reads the Volume (tests pass a reader of a local directory).
    """
    import json

    from vrl.config import migrate, train_config

    data = migrate(json.loads(read(volume, f"runs/{name}/config.json")))  # a run recorded before issue 28 too
    cfg = train_config().model_validate(data)
    modal = cfg.runtime.modal
    if modal.volume != volume:
        raise ValueError(f"run {name!r} on Volume {volume!r} recorded runtime.modal.volume={modal.volume!r}")
    if iterations is not None:
        if iterations < 1:
            raise ValueError(f"--iterations must be at least 1, got {iterations}")
        cfg = cfg.model_copy(update={"iterations": iterations})
    runtime = cfg.runtime.model_copy(update={"modal": modal.model_copy(update={"detach": True})})
    return cfg.model_copy(update={"runtime": runtime})


def resume_detached(name: str, volume: str = "vrl", iterations: int | None = None, output: bool = True
                    ) -> tuple[str, Any]:
    """Continue the detached run `name` on Modal: its recorded config, only `iterations` changed (and
    `output`: Modal's build and log output here). Refused (one line) while another call owns the run."""
    from vrl.runtime.modal.lease import RunLease

    require_credentials()
    cfg = recorded_config(name, volume, iterations)
    modal = cfg.runtime.modal.model_copy(update={"output": output})
    cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"modal": modal})})
    RunLease(volume, name).check_free()  # the orchestrator checks again when it starts
    return launch_detached(cfg, resume=True), cfg


def launch_detached(config: Any, resume: bool = False) -> str:
    """Start the training loop itself on Modal and return the call id; the run lives on the Volume."""
    from vrl.runtime.modal.app import build_app

    if config.runtime.kind != "modal":
        raise ValueError("--detach (runtime.modal.detach) runs the loop on Modal: add --runtime modal "
                         "(or --set runtime.kind=modal)")
    if not config.logging.name:
        raise ValueError("a detached run needs --name, so you can find (and resume) it on the Volume")
    from vrl.runtime.modal.runtime import ModalRuntime

    ModalRuntime.check(config)  # what the runtime refuses, here rather than in a container
    if config.runtime.modal.min_containers:
        raise ValueError("runtime.modal.min_containers keeps GPU containers running, billed, for as long as the app "
                         "lives, and a detached app outlives this command: set it to 0 with --detach (workers stay "
                         "warm between iterations for runtime.modal.scaledown_window_s)")
    if not resume:
        _refuse_existing(config.logging.name, config.runtime.modal.volume)
    from vrl.runtime.modal.lease import RunLease

    app = build_app(config)
    try:
        with modal_output(config.runtime.modal.output), app.app.run(detach=True):
            app_id = app.app.app_id
            if config.runtime.modal.model_folder is not None:  # a local model: on the Volume before the run starts
                from vrl.runtime.modal.models import upload

                upload(config, app.volume)
            call = app.orchestrate.spawn(dump(config), resume, worker=app.sample, orchestrator=app.orchestrate,
                                         app_id=app_id, stopper=app.stop_app)
        # Kept in the lease Dict: a start that fails before its first iteration leaves no run directory.
        RunLease(config.runtime.modal.volume, config.logging.name).record_launch(call.object_id, app_id)
    except _modal_errors() as exc:
        raise ModalUnavailable(NO_ACCOUNT.format(error=exc)) from None
    return call.object_id


def _refuse_existing(name: str, volume: str) -> None:
    """A new detached run may not reuse a name on the Volume (the orchestrator checks again)."""
    from vrl.errors import RunDirError
    from vrl.runtime.modal.lease import already_exists

    try:
        read_volume_file(volume, f"runs/{name}/config.json")
    except FileNotFoundError:
        return
    raise RunDirError(already_exists(name, volume))


# -- status, logs, stop ------------------------------------------------------------------------------


def _read_json(volume: str, path: str, read: Any) -> Any:
    import json

    try:
        return json.loads(read(volume, path))
    except FileNotFoundError:
        return None


def _read_jsonl(volume: str, path: str, read: Any) -> list[dict[str, Any]]:
    import json

    try:
        text = read(volume, path).decode()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line
    return rows


def run_status(name: str, volume: str = "vrl", read: Any = read_volume_file, lease: Any = None) -> dict[str, Any]:
    """What the Volume and the lease say about detached run `name` (as last committed)."""
    from vrl.errors import RunDirError
    from vrl.runtime.modal.lease import RunLease

    require_credentials()
    lease = lease or RunLease(volume, name)
    launch = lease.launch()
    config = _read_json(volume, f"runs/{name}/config.json", read)
    if config is None and launch is None:
        raise RunDirError(f"no detached run {name!r} on the Volume {volume!r} (no runs/{name}/config.json)")
    call = lease.latest_call() or (launch or {}).get("call")
    state = _read_json(volume, f"runs/{name}/state.json", read) or {}
    summary = _read_json(volume, f"runs/{name}/summary.json", read) or {}
    metrics = _read_jsonl(volume, f"runs/{name}/metrics.jsonl", read)
    outcome, remote_error = lease.outcome(call) if call is not None else ("never started", None)
    running = outcome == "running"
    status, error = summary.get("status"), summary.get("error")
    if not running and not error:
        # What the orchestrator recorded at its end, else, when the run wrote nothing (no summary), what the
        # call itself raised: an error Modal raised before any vrl code ran.
        error = (launch or {}).get("error") or (remote_error if status is None else None)
        if error and status in (None, "running"):
            status = "failed"
    if status is None and config is None:  # launched, no run directory yet (or removed: it finished nothing)
        status = "running" if running else "failed" if error else None
    elif status == "running" and not running:  # no call owns it and it recorded no ending: stopped or killed
        status = "stopped"
    return {
        "name": name, "volume": volume, "call": call, "app": (launch or {}).get("app"), "running": running,
        "iterations_completed": int(state.get("iteration", 0)), "iterations": (config or {}).get("iterations"),
        "status": status, "error": error, "last": metrics[-1] if metrics else None,
    }


def format_metrics(row: dict[str, Any]) -> str:
    """One finished iteration as one line (what the orchestrator logged)."""
    return (f"iteration {row.get('iteration')}: reward {row.get('reward_mean', 0.0):.3f} · pass "
            f"{100 * row.get('pass_rate', 0.0):.0f}% · {row.get('loop_s', 0.0):.1f} s")


def run_logs(name: str, volume: str = "vrl", read: Any = read_volume_file) -> list[str]:
    """The run's iteration lines and its end, from the Volume (what the orchestrator committed)."""
    status = run_status(name, volume, read)
    lines = [format_metrics(row) for row in _read_jsonl(volume, f"runs/{name}/metrics.jsonl", read)]
    if status["error"]:
        lines.append(f"{status['status']}: {status['error']}")
    return lines


def stop_run(name: str, volume: str = "vrl", lease: Any = None) -> str | None:
    """Cancel the call that owns run `name` (its finished iterations stay on the Volume); return its id,
    or None when no call is running it."""
    require_credentials()  # before `import modal`: a missing package is a one-line error too
    import modal

    from vrl.runtime.modal.lease import RunLease

    lease = lease or RunLease(volume, name)
    call = lease.latest_call()
    launch = lease.launch() or {}
    running = call is not None and lease.alive(call)
    if running:
        modal.FunctionCall.from_id(call).cancel(terminate_containers=True)
    if launch.get("app"):
        # Its GPU workers would idle, billed, through their scale-down window: the whole app goes.
        modal.App.lookup(launch["app"]).stop()
    return call if running else None
