"""The core installs as `vrl-core` (PyPI's `vrl` and `vrl-sdk` are other projects); import and command stay `vrl`."""

import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from vrl.meta import DISTRIBUTION

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = [ROOT / "pyproject.toml", *sorted((ROOT / "plugins").glob("*/pyproject.toml")),
              ROOT / "examples" / "custom_plugin" / "pyproject.toml"]


def test_pyproject_names_and_dependencies():
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert core["name"] == DISTRIBUTION == "vrl-core"
    assert core["scripts"] == {"vrl": "vrl.cli:main"}
    for path in PYPROJECTS[1:]:
        deps = tomllib.loads(path.read_text())["project"]["dependencies"]
        names = [re.split(r"[\s<>=!~\[;]", d, maxsplit=1)[0] for d in deps]
        assert DISTRIBUTION in names and "vrl" not in names, (path, deps)


def test_no_install_line_names_the_wrong_project():
    """`pip install vrl` or `vrl[extra]` would install an unrelated PyPI project."""
    wrong = re.compile(r"""pip install[^\n&;#|]*?(?<![\w-])['"]?vrl(?![\w-])|(?<![\w-])['"]?vrl\[""")
    hits = []
    for path in [*ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md"), *ROOT.glob("vrl/**/*.py"), *ROOT.glob("plugins/*/*/*.py"),
                 *ROOT.glob("examples/**/*.md"), *ROOT.glob("tests/*.py"), *ROOT.glob("scripts/*"), *PYPROJECTS]:
        if path.name == Path(__file__).name or not path.is_file():
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if wrong.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_version_plugins_and_versions_json_name_vrl_core(tmp_path):
    installed = md.version(DISTRIBUTION)
    out = subprocess.run([sys.executable, "-m", "vrl.cli", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"vrl {installed} (distribution vrl-core)"
    listing = subprocess.run([sys.executable, "-m", "vrl.cli", "plugins", "--json"], capture_output=True, text=True, check=True)
    builtin = next(p for p in json.loads(listing.stdout) if p["name"] == "builtin")
    assert (builtin["distribution"], builtin["version"]) == ("vrl-core", installed)

    from vrl.rundir import versions

    recorded = versions()
    assert recorded["vrl-core"] == installed and "vrl" not in recorded
