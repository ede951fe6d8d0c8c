"""Entry points that talk to the Modal service: `vrl modal prepare` and detached training.

Both need a Modal account (`pip install 'vrl-core[modal]'`, then `modal setup`); without credentials they
fail at once with that advice.
"""

from __future__ import annotations

import logging
from typing import Any

from vrl.config import dump

log = logging.getLogger(__name__)

NO_ACCOUNT = (
    "no Modal credentials: {error}\n"
    "Set up once with `pip install modal` and `modal setup` (or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET)."
)


def require_credentials() -> None:
    """Fail early, with the fix, when no Modal token is configured (before any work starts)."""
    from modal.config import config

    if not (config.get("token_id") and config.get("token_secret")):
        raise RuntimeError(NO_ACCOUNT.format(error="no token configured"))


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
        raise RuntimeError(NO_ACCOUNT.format(error=exc)) from None


def launch_detached(config: Any, resume: bool = False) -> str:
    """Start the training loop itself on Modal and return the call id; the run lives on the Volume."""
    from vrl.runtime.modal.app import build_app

    if config.runtime.kind != "modal":
        raise ValueError("--detach runs the loop on Modal: add --runtime modal (or --set runtime.kind=modal)")
    if not config.logging.name:
        raise ValueError("a detached run needs --name, so you can find (and resume) it on the Volume")
    app = build_app(config)
    try:
        with app.app.run(detach=True):
            call = app.orchestrate.spawn(dump(config), resume, worker=app.worker())
    except _modal_errors() as exc:
        raise RuntimeError(NO_ACCOUNT.format(error=exc)) from None
    return call.object_id
