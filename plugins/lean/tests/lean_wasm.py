"""A real Lean 4 for the tests: where lean-wasm is, building it when it is not built yet, and running it.

`scripts/lean-wasm` owns the answers (which tool, which cache folder, whether it is built); this module asks it.
The build lives outside the checkout (`~/.cache/vrl/lean-wasm/KEY`), so a fresh clone on the same machine
finds it; `scripts/test` starts it in the background while it installs, and the first `lean()` call waits
for it (or builds it, about 20 s, when the tests run without `scripts/test`).

- `missing()`: why the real-Lean tests cannot run here (no tool, no npm to build it), or None. Those are the
  only skips; a module marks itself `skipif(missing() is not None, reason=str(missing()))`.
- `lean(path)`: Lean's messages for a file, by line. A build that was tried and failed fails the test, with
  the build's log: it is never a skip. `lean_many(paths)`: the same for several files, two at a time.

Each run costs its start-up (4-7 CPU-seconds; the checker, which imports Lean, 18-25 in all;
docs/testing.md): check many facts in one file rather than one fact per run.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "lean-wasm"


@functools.cache
def where() -> dict[str, str]:
    """TOOL, BUILD, STATE (built | unbuilt | failed | no-tool | no-npm), REASON and LOG, as
    `scripts/lean-wasm where` reports them (instant: it builds nothing)."""
    out = subprocess.run([str(SCRIPT), "where"], capture_output=True, text=True, timeout=60, check=True)
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def missing() -> str | None:
    """Why a real Lean cannot run here, or None: it is built, or can be built (`lean()` builds it)."""
    info = where()
    return info["REASON"] if info["STATE"] in ("no-tool", "no-npm") else None


_built: list[Path | str] = []   # the one build attempt of this process: its folder, or why it failed


def build() -> Path:
    """The built lean-wasm's folder (`dist/`, `package/lib`). Builds it, or waits for the build that
    `scripts/test` started, once per process; a failed build fails every test that needs it."""
    if not _built:
        out = subprocess.run([str(SCRIPT), "build"], capture_output=True, text=True, timeout=900, check=False)
        if out.returncode == 2:
            pytest.skip(out.stderr.strip())
        lines = out.stdout.strip().splitlines()
        _built.append(Path(lines[-1]) if out.returncode == 0 and lines else
                      out.stderr[-3000:] or f"scripts/lean-wasm build: exit {out.returncode}")
    if isinstance(_built[0], str):
        pytest.fail(_built[0], pytrace=False)
    return _built[0]


def lean(path: Path, timeout: float = 600) -> dict[int, list[dict]]:
    """Lean's messages for a file, by line (`lean --json FILE`). Exit code aside: a file that defines programs
    can fail code generation in this build (its README), so read the messages. Run in the build's folder:
    the runner mounts its working directory, and Lean looks for its own files beside `dist/` (the runtime
    leaves a profile file there, outside the checkout)."""
    folder = build()
    env = {**os.environ, "LEAN_WASM_DIR": str(folder / "dist"), "LEAN_PATH": str(folder / "package" / "lib")}
    out = subprocess.run([where()["TOOL"], "--json", str(path)], capture_output=True, text=True, env=env,
                         timeout=timeout, check=False, cwd=folder)
    by_line: dict[int, list[dict]] = {}
    for line in out.stdout.splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        by_line.setdefault(m["pos"]["line"], []).append(m)
    assert by_line or out.returncode == 0, out.stderr[-2000:]
    return by_line


def lean_many(paths: list[Path], at_once: int = 2) -> list[dict[int, list[dict]]]:
    """`lean(path)` for each file, `at_once` at a time (each Lean takes about 0.9 GB; the lean-wasm README
    runs two side by side): the files' wall time overlaps, their CPU does not shrink."""
    build()   # once, in this thread: a skip or failure is raised here, not inside the pool
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        return list(pool.map(lean, paths))
