"""Modal credentials: checked before any work starts, with the fix when they are missing."""

from __future__ import annotations

NO_ACCOUNT = (
    "no Modal credentials: {error}\n"
    "Set up once with `pip install modal` and `modal setup` (or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET)."
)


def require_credentials() -> None:
    """Fail early, with the fix, when no Modal token is configured (before any work starts)."""
    from modal.config import config

    if not (config.get("token_id") and config.get("token_secret")):
        raise RuntimeError(NO_ACCOUNT.format(error="no token configured"))
