"""Modal's own output on this machine: image builds, container logs, call progress."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def modal_output(show: bool) -> Iterator[None]:
    """Modal's own output (image builds, container logs, call progress) while this block runs, unless
    `show` is off (`runtime.modal.output=false`, `--quiet`): a 10-minute build is not silent."""
    if not show:
        yield
        return
    import modal

    with modal.enable_output():
        yield
