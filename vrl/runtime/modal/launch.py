"""Entry points that talk to the Modal service: `vrl modal prepare` and detached training.

Both need a Modal account (`pip install 'vrl-core[modal]'`, then `modal setup`); without credentials they
fail at once with that advice.
"""

from __future__ import annotations

import logging
from typing import Any

from vrl.config import dump
from vrl.runtime.modal.credentials import NO_ACCOUNT, ModalUnavailable, require_credentials

log = logging.getLogger(__name__)

def _modal_errors():
    import modal.exception

    return modal.exception.AuthError


def prepare(config: Any, model: str, revision: str | None = None) -> dict[str, Any]:
    """Put `model` (weights + tokenizer) on the run's Volume once, from inside Modal."""
    from vrl.runtime.modal.app import build_app

    app = build_app(config)
    try:
        with app.app.run():
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


def resume_detached(name: str, volume: str = "vrl", iterations: int | None = None) -> tuple[str, Any]:
    """Continue the detached run `name` on Modal: its recorded config, only `iterations` changed."""
    require_credentials()
    cfg = recorded_config(name, volume, iterations)
    return launch_detached(cfg, resume=True), cfg


def launch_detached(config: Any, resume: bool = False) -> str:
    """Start the training loop itself on Modal and return the call id; the run lives on the Volume."""
    from vrl.runtime.modal.app import build_app

    if config.runtime.kind != "modal":
        raise ValueError("--detach (runtime.modal.detach) runs the loop on Modal: add --runtime modal "
                         "(or --set runtime.kind=modal)")
    if not config.logging.name:
        raise ValueError("a detached run needs --name, so you can find (and resume) it on the Volume")
    app = build_app(config)
    try:
        with app.app.run(detach=True):
            call = app.orchestrate.spawn(dump(config), resume, worker=app.worker())
    except _modal_errors() as exc:
        raise ModalUnavailable(NO_ACCOUNT.format(error=exc)) from None
    return call.object_id
