"""GRPO's published weights on the run's Volume, by Modal's Volume rules.

Modal allows `Volume.commit()` only inside a container that mounts the Volume, and a commit reloads,
which fails while a file of the Volume is open. So where the orchestrator runs decides how weights
reach the workers:

- in a container (the detached orchestrator): write the mounted Volume, then `commit()`;
- on the user's machine (`--runtime modal` without `--detach`): write a local staging file and send
  it with `Volume.batch_upload()`, which writes the Volume's committed state from anywhere.

Either way the workers get the path under their own mount (`/vrl/runs/<run>/weights/vN.safetensors`)
and reload the Volume before reading it. The two newest versions are kept (a shard may still be
reading the previous one).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from vrl.runtime.modal import workers

KEEP = 2  # versions kept on the Volume


class VolumeWeights:
    """Publishes weights for run `run` to `volume`: `root` is where this process sees the Volume mounted
    (None: not mounted here, so upload)."""

    def __init__(self, run: str, *, volume: Any, root: str | Path | None = None):
        self.run, self.volume = run, volume
        self.root = Path(root) if root is not None else None
        self._staging: Path | None = None
        self._published: list[str] = []  # Volume paths (relative) of the versions written so far

    def _rel(self, version: int) -> str:
        return f"{workers.RUNS_DIR}/{self.run}/weights/v{version:06d}.safetensors"

    def publish(self, model: Any, version: int) -> str:
        """Write `model` as `version`; return the path the workers read it from."""
        rel = self._rel(version)
        if self.root is not None:  # the Volume is mounted here
            path = workers.save_weights(model, self.root / rel)
            for old in self._published[:-(KEEP - 1)]:
                (self.root / old).unlink(missing_ok=True)
            self.volume.commit()  # only inside a container; nothing of the Volume is held open here
            seen = str(path)
        else:  # this machine: upload, which needs no container and no commit
            if self._staging is None:
                self._staging = Path(tempfile.mkdtemp(prefix="vrl-weights-"))
            local = workers.save_weights(model, self._staging / Path(rel).name)
            with self.volume.batch_upload(force=True) as batch:
                batch.put_file(local, rel)
            local.unlink()
            for old in self._published[:-(KEEP - 1)]:
                self.volume.remove_file(old)
            seen = f"{workers.VOLUME_ROOT}/{rel}"
        self._published = [*self._published[-(KEEP - 1):], rel]
        return seen

    def close(self) -> None:
        """Remove the local staging directory (the Volume keeps the newest versions)."""
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
