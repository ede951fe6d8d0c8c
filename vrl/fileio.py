"""Atomic writes: a file or folder appears whole under its name, or not at all.

Everything the SDK writes that a crash must not leave half-written (run state, ES history and
snapshots, GRPO checkpoints, weights handed to workers) goes through `atomic_path`: write a sibling
named `<name>.tmp`, then rename it over the target in one step. Standard library only, so any
module can use it without import cycles or start-up cost.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

TMP_SUFFIX = ".tmp"
"""What `atomic_path` appends to the target's name while it is being written."""


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write (a file or a folder); on success it replaces `path`.

    A stale temporary left by a crash is removed first; if the block raises, the temporary is removed
    and `path` is untouched. A folder replaces an existing folder of that name (removed just before
    the rename, since a rename cannot replace a non-empty folder).
    """
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    _remove(tmp)
    try:
        yield tmp
        if tmp.is_dir() and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write a text file atomically (see `atomic_path`), so a crash never leaves half a file."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)

