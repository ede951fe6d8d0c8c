"""Modal credentials: checked before any work starts, with the fix when they are missing."""

from __future__ import annotations

from vrl.errors import UsageError

NO_ACCOUNT = (
    "no Modal credentials: {error}.\n"
    "Set up once with `pip install modal` and `modal setup` (or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET)."
)


class ModalUnavailable(UsageError, RuntimeError):
    """No usable Modal account; the message says how to set one up (the CLI prints it as one line)."""


def require_credentials() -> None:
    """Fail early, with the fix, when no Modal token is configured (before any work starts)."""
    try:
        from modal.config import config
    except ImportError:
        raise ModalUnavailable("the Modal runtime needs the modal package: pip install 'vrl-core[modal]'") from None
    if not (config.get("token_id") and config.get("token_secret")):
        raise ModalUnavailable(NO_ACCOUNT.format(error="no token configured"))
