"""How the Modal images get vrl and the run's plugins as installed distributions (vrl/runtime/modal/images.py).

No Modal service: the wheels are built for real with pip from small projects made here, and the
recipes are read as data. What a container built from them holds is checked on the emulator
(tests/test_modal_emulated_containers.py).
"""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from vrl.config import build
from vrl.runtime.modal import images

pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning:vrl")


def _project(root: Path, version: str = "1.0") -> Path:
    (root / "probe_pkg" / "data").mkdir(parents=True)
    (root / "probe_pkg" / "__init__.py").write_text("VALUE = 1\n")
    (root / "probe_pkg" / "data" / "rows.jsonl").write_text('{"a": 1}\n')
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "probe-pkg"\nversion = "{version}"\n'
        '[project.entry-points.vrl]\nprobe = "probe_pkg"\n'
        '[tool.setuptools.packages.find]\ninclude = ["probe_pkg*"]\n'
        '[tool.setuptools.package-data]\nprobe_pkg = ["data/*.jsonl"]\n')
    return root


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


@pytest.mark.slow
def test_a_source_tree_becomes_a_wheel_with_metadata_and_package_data_once_per_content(tmp_path, monkeypatch):
    """The wheel holds what `pip wheel` of the tree holds (entry points, package data), not what a stale
    build/ directory still has; the same files give the cached wheel, an edit a new one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    project = _project(tmp_path / "proj")
    stale = project / "build" / "lib" / "probe_pkg"
    stale.mkdir(parents=True)
    (stale / "removed_long_ago.py").write_text("SECRET = 1\n")  # an in-tree setuptools build would pack it
    wheel = images.build_wheel(project)
    names = _names(wheel)
    assert {"probe_pkg/__init__.py", "probe_pkg/data/rows.jsonl", "probe_pkg-1.0.dist-info/entry_points.txt"} <= names
    assert "probe_pkg/removed_long_ago.py" not in names
    assert wheel.is_relative_to(tmp_path / "cache" / "vrl" / "wheels")
    assert images.build_wheel(project) == wheel  # nothing changed: the cached wheel
    (project / "probe_pkg" / "__init__.py").write_text("VALUE = 2\n")
    edited = images.build_wheel(project)
    assert edited != wheel and edited.exists()
    with zipfile.ZipFile(edited) as zf:
        assert zf.read("probe_pkg/__init__.py") == b"VALUE = 2\n"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_in_a_git_checkout_the_wheel_is_built_from_what_git_would_commit(tmp_path, monkeypatch):
    """Ignored files (a run directory of checkpoints, say) are neither hashed nor copied."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    project = _project(tmp_path / "proj")
    (project / ".gitignore").write_text("runs/\n")
    (project / "runs").mkdir()
    (project / "runs" / "weights.bin").write_bytes(b"\0" * 1024)
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    files = {str(p.relative_to(project)) for p in images.project_files(project)}
    assert files == {"pyproject.toml", "probe_pkg/__init__.py", "probe_pkg/data/rows.jsonl"}
    wheel = images.build_wheel(project)
    (project / "runs" / "weights.bin").write_bytes(b"\1" * 1024)
    assert images.build_wheel(project) == wheel


def test_a_broken_project_fails_with_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    project = _project(tmp_path / "proj")
    (project / "pyproject.toml").write_text("[project\n")
    with pytest.raises(images.WheelBuildError, match=f"cannot build a wheel of {project}"):
        images.build_wheel(project)


def test_the_images_hold_only_the_plugins_the_run_uses(monkeypatch):
    """vrl-core always; a plugin when the run's environment (or VRL_PLUGINS) names it; no other."""
    monkeypatch.delenv("VRL_PLUGINS", raising=False)
    by_plugin = {plugin: [p.name for p in images.requested_plugins(build({"plugin": plugin}))]
                 for plugin in ("countdown", "python-tests", "lean")}
    assert by_plugin == {"countdown": [], "python-tests": ["python-tests"], "lean": ["lean"]}
    monkeypatch.setenv("VRL_PLUGINS", "lean,python-tests")
    assert [p.name for p in images.requested_plugins(build({"plugin": "countdown"}))] == ["lean", "python-tests"]
    recipe = images.gpu_recipe(images.requested_plugins(build({"plugin": "countdown"})))
    assert recipe.distributions == ("vrl-core", "vrl-lean", "vrl-python-tests")
    assert all(d.wheel and d.requirement == f"{images.WHEELS_DIR}/{Path(d.wheel).name}" for d in recipe.dists)


def test_a_distribution_from_the_index_is_installed_by_its_pinned_version():
    """Not from a source tree, no wheel file left: the image installs `name==version` from PyPI."""
    dist = images._dist("pluggy")
    assert (dist.wheel, dist.requirement) == (None, f"pluggy=={metadata.version('pluggy')}")


def test_a_python_tests_sandbox_gets_bubblewrap_a_plugin_image_only_what_its_spec_asks():
    """A registry image is left as its maker built it, but for the Debian packages its sandbox spec names
    (the Lean re-check's bubblewrap on kimina's image, issue 39/40): the spec's `apt` reaches the recipe."""
    from vrl.plugins import registry
    from vrl.runtime.modal.sandbox import spec_for

    plugins = {p.name: p for p in images.installed_plugins()}
    default = images.verifier_recipe(plugins["python-tests"])
    assert default.base is None and default.apt == ("bubblewrap",)
    assert default.distributions == ("vrl-core", "vrl-python-tests")
    kimina = images.verifier_recipe(plugins["lean"], base="projectnumina/kimina-lean-server:2.0.0")
    assert kimina.apt == ()
    spec = spec_for(registry().environment("lean"), "lean", {})
    lean = images.verifier_recipe(plugins["lean"], base=spec.image, apt=spec.apt)
    assert lean.base == "projectnumina/kimina-lean-server:2.0.0" and lean.apt == ("bubblewrap",)
    off = spec_for(registry().environment("lean", recheck="off"), "lean", {"recheck": "off"})
    assert images.verifier_recipe(plugins["lean"], base=off.image, apt=off.apt).apt == ()


def test_every_torch_is_the_pinned_one_and_no_image_asks_for_hf_transfer():
    """Issue 40 item 7: the CPU images pinned no torch (each build could take another), and hf_transfer
    was installed for a switch huggingface_hub 2.x ignores."""
    from vrl.runtime.modal.images import TORCH, gpu_recipe, orchestrator_recipe, verifier_recipe

    for recipe in (gpu_recipe(), orchestrator_recipe(), orchestrator_recipe(gpu=True), verifier_recipe(None)):
        assert TORCH in recipe.pip, recipe.role
        assert "hf_transfer" not in recipe.pip and "HF_HUB_ENABLE_HF_TRANSFER" not in recipe.env


def test_a_client_older_than_python_3_11_is_refused_in_one_line():
    """Issue 40 item 7: the images take the client's Python, and Modal's newest image builder has no 3.10."""
    from vrl.errors import UsageError
    from vrl.runtime.modal.images import ImageRecipe

    with pytest.raises(UsageError, match=r"Python \(3.10\).*3.11 or newer"):
        ImageRecipe("gpu", python="3.10").build()
    assert ImageRecipe("gpu", python="3.11").build() is not None
