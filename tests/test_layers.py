"""Imports flow down the layers of docs/concepts.md ("Layers"); an import that points up is documented
where it is made (a comment on its line or just above it), or this test names it."""

from __future__ import annotations

import ast
from pathlib import Path

VRL = Path(__file__).resolve().parent.parent / "vrl"

# docs/concepts.md: types -> interfaces -> weights -> optim | generate -> runtime -> trainer -> cli.
# The modules below the interfaces that everything may use sit at 0 with the types.
LAYER = {
    "types": 0, "errors": 0, "fileio": 0, "meta": 0, "distributed": 0, "reaper": 0,
    "policy": 1, "environment": 1, "verifier": 1, "reward": 1, "hookspecs": 1, "episodes": 1, "tools": 1,
    "weights": 2,
    "optim": 3, "generate": 3,
    "runtime": 4,
    "rollouts": 5, "trainer": 5, "launch": 5, "console": 5, "preflight": 5,
    "cli": 6,
}


def _layer(module: str) -> tuple[str, int] | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYER:
        return None
    return parts[1], LAYER[parts[1]]


def upward_imports(root: Path = VRL) -> list[tuple[str, int, str, bool]]:
    """(file, line, imported module, documented) of every import that points up a layer, or across from
    vrl.optim to vrl.generate and back (siblings that never import each other)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        me = _layer(module)
        if me is None:
            continue
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("vrl"):
                targets = [f"vrl.{a.name}" for a in node.names] if node.module == "vrl" else [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("vrl.")]
            else:
                continue
            for target in targets:
                it = _layer(target)
                if it is None or not (it[1] > me[1] or (me[1] == it[1] == 3 and it[0] != me[0])):
                    continue
                above = lines[max(0, node.lineno - 4):node.lineno - 1]
                documented = "#" in lines[node.lineno - 1] or any(s.strip().startswith("#") for s in above)
                found.append((str(path.relative_to(root.parent)), node.lineno, target, documented))
    return found


def test_every_upward_import_is_documented_at_its_line():
    undocumented = [f"{f}:{line} imports {target}" for f, line, target, documented in upward_imports() if not documented]
    assert not undocumented, "imports that point up a layer without a comment saying why:\n" + "\n".join(undocumented)


def test_the_check_sees_an_undocumented_upward_import(tmp_path):
    """The check itself: an optimizer that imports the trainer, with and without its reason."""
    (tmp_path / "vrl" / "optim").mkdir(parents=True)
    (tmp_path / "vrl" / "optim" / "rule.py").write_text(
        "def f():\n    from vrl.trainer import Trainer\n\n\ndef g():\n"
        "    # lazy: the trainer builds this rule, so the import waits for the call\n    from vrl import trainer\n"
        "    import vrl.generate.hf\n")
    found = {(line, target, documented) for _, line, target, documented in upward_imports(tmp_path / "vrl")}
    assert found == {(2, "vrl.trainer", False), (7, "vrl.trainer", True), (8, "vrl.generate.hf", True)}
