"""What this package is called where: the import name and the command are `vrl`; the distribution
on PyPI is `vrl-core`, because the PyPI projects `vrl` and `vrl-sdk` are unrelated ones."""

from __future__ import annotations

import importlib.metadata as md

DISTRIBUTION = "vrl-core"


def version() -> str:
    """The installed version of vrl-core ('0+unknown' when run from a source tree that is not installed)."""
    try:
        return md.version(DISTRIBUTION)
    except md.PackageNotFoundError:
        return "0+unknown"
