"""The example plugin packages in examples/, installed as a user would install them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def install_example(name: str, target: Path) -> dict[str, str]:
    """pip-install examples/NAME into `target` (the test venv stays untouched); the environment that sees it."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
         "--target", str(target), str(EXAMPLES / name)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
