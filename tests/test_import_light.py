"""`import vrl` and the commands that do no training load no torch (issue 28): each public name is
imported on first use. Checked in a fresh interpreter, since this test process has torch already."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import vrl

HEAVY = ("torch", "transformers", "vllm", "triton", "safetensors", "peft", "matplotlib")

# Runs in a fresh interpreter: the vrl command group in-process, then what it imported.
_PROBE = """
import json, sys
import vrl
args = json.loads(sys.argv[1])
code = None
if args is not None:
    from vrl.cli import main
    try:
        main(args, prog_name="vrl", standalone_mode=False)
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
print(json.dumps({"code": code, "heavy": sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[2])))}))
"""


def _probe(args: list[str] | None) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(args), json.dumps(HEAVY)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_vrl_loads_no_torch():
    assert _probe(None) == {"code": None, "heavy": []}


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["plugins"]], ids=" ".join)
def test_commands_that_train_nothing_load_no_torch(args):
    assert _probe(args) == {"code": 0, "heavy": []}


def test_every_public_name_resolves_to_its_definition():
    for name in vrl.__all__:
        value = getattr(vrl, name)
        assert getattr(sys.modules[vrl._EXPORTS[name]], name) is value
    assert set(vrl.__all__) <= set(dir(vrl))
    from vrl import Task, Trainer  # noqa: F401 - the `from vrl import X` form works too

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        vrl.Nope  # noqa: B018


def test_type_checkers_see_the_same_names():
    """The `if TYPE_CHECKING:` imports in vrl/__init__.py list exactly the lazily exported names."""
    tree = ast.parse(Path(vrl.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {alias.name: node.module for node in block.body for alias in node.names}
    assert seen == vrl._EXPORTS
