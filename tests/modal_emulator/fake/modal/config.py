"""`modal.config.config`: the settings vrl reads (tokens), from the environment as modal does.

modal/config.py reads MODAL_<KEY> environment variables before ~/.modal.toml; the emulator reads only
the environment (tests set the token variables or leave them out).
"""

import logging
import os

logger = logging.getLogger("modal-client")

_DEFAULTS = {"async_warnings": True}


class _Config:
    def get(self, key: str, *, profile: str | None = None, use_env: bool = True):
        value = os.environ.get(f"MODAL_{key.upper()}") if use_env else None
        if value is None:
            return _DEFAULTS.get(key)
        if key == "async_warnings":
            return value.lower() not in ("0", "false", "no")
        return value


config = _Config()
