"""One container image per role, holding vrl and the run's plugins as installed distributions.

Plugins are found through installed package metadata (entry points, group `vrl`), and they read their
package data through it: a container must hold vrl and each plugin the run uses as *installed
distributions*, not as source files. Each one travels as a wheel: built from the user's checkout when
it is installed from a source tree (editable or not; `pip wheel --no-deps`, cached by the content of
the files), the wheel it was installed from when that still exists (inside a container: the image's
own copy), or `name==version` from the package index otherwise. Only the plugins the run uses go in
(those that registered its environment, optimizer, generator backend or runtime, and those
`VRL_PLUGINS` names), not every plugin installed here.

Each image is first a plain `ImageRecipe` (base, Python, apt and pip requirements, environment, the
distributions), so what goes where can be read and tested without Modal; `ImageRecipe.build()` turns it
into a `modal.Image`. Third-party requirements come first (a layer that changes only when they do);
the wheels are copied in (`add_local_file(copy=True)`) and installed last with `--no-deps`:

- `gpu`: debian_slim + the client's Python + vllm 0.26.0, torch 2.11.0, transformers, datasets + vrl and the plugins.
- `orchestrator`: debian_slim + the client's Python, light (requests, tqdm, numpy, CPU torch; GPU torch with
  `orchestrator_gpu`) + vrl and plugins.
- `verifier:<plugin>`: the plugin's image (e.g. kimina-lean-server) or debian_slim with bubblewrap (code
  verifiers isolate each attempt with it, python-tests does), + vrl and that plugin.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from vrl.errors import UsageError
from vrl.meta import DISTRIBUTION

log = logging.getLogger(__name__)
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
"""The images' Python is the client's: functions are sent cloudpickled (`serialized=True`), and a pickle
made by one Python minor version does not load in another."""
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH = "torch==2.11.0"
"""The torch vLLM 0.26.0 pins (the pair tested on the GPU machine, docs/vllm.md)."""
GPU_PACKAGES = ("vllm==0.26.0", TORCH, "transformers", "datasets", "safetensors")
"""No hf_transfer: huggingface_hub 2.x ignores HF_HUB_ENABLE_HF_TRANSFER (its hf_xet backend downloads in parallel)."""
OLDEST_PYTHON = (3, 11)
"""Modal's newest image builder (2025.06) has no Python 3.10 images, and the images' Python is the client's."""
ORCHESTRATOR_PACKAGES = ("requests", "tqdm", "numpy")
VERIFIER_APT = ("bubblewrap",)
"""Debian packages of the default verifier image: bubblewrap isolates each attempt of a code verifier
(python-tests) inside the sandbox, as it does on a Linux machine."""
INDEX_STRATEGY = "--index-strategy unsafe-best-match"
"""uv's default `first-index` takes every package an extra index has from that index alone (the CPU torch
index mirrors old jinja2, requests, numpy...): with an extra index, pick the best version across both."""
WHEELS_DIR = "/opt/vrl/wheels"
"""Where an image holds the wheels of vrl and its plugins (kept: a container that builds further images,
the detached orchestrator's sandboxes, installs the same wheels from there)."""
_SKIP_PARTS = {"__pycache__", "build", "dist", "node_modules"}


class WheelBuildError(UsageError):
    """vrl or a plugin could not be packaged from the user's checkout for the Modal images."""


@dataclass(frozen=True)
class Dist:
    """An installed distribution an image must hold: its name, version and where its files come from."""

    name: str
    version: str
    wheel: str | None = None  # a wheel file on this machine; None: `name==version` from the package index

    @property
    def requirement(self) -> str:
        """What the image installs: the wheel's path inside the image, or the pinned name."""
        return f"{WHEELS_DIR}/{Path(self.wheel).name}" if self.wheel else f"{self.name}=={self.version}"


@dataclass(frozen=True)
class ImageRecipe:
    """What goes into one role's image; `build()` makes the `modal.Image`."""

    role: str
    base: str | None = None  # a registry tag; None: Modal's debian_slim
    python: str = PYTHON
    apt: tuple[str, ...] = ()
    pip: tuple[str, ...] = ()  # third-party requirements (vrl's and the plugins' included)
    extra_index_url: str | None = None  # CPU-only torch wheels for images without a GPU
    dists: tuple[Dist, ...] = ()  # vrl and the plugins, installed last without dependencies
    env: dict[str, str] = field(default_factory=dict)

    @property
    def distributions(self) -> tuple[str, ...]:
        """The names of the distributions installed from vrl's side (vrl-core first)."""
        return tuple(d.name for d in self.dists)

    def build(self) -> Any:
        """The `modal.Image` for this recipe (lazy: Modal builds it on first use, then caches it)."""
        import modal

        if not self.base and tuple(int(x) for x in self.python.split(".")[:2]) < OLDEST_PYTHON:
            raise UsageError(f"the Modal images run this machine's Python ({self.python}), and Modal's image builder "
                             f"has none older than {OLDEST_PYTHON[0]}.{OLDEST_PYTHON[1]}: run vrl with Python "
                             f"{OLDEST_PYTHON[0]}.{OLDEST_PYTHON[1]} or newer")
        if self.base:
            # Registry images (kimina-lean-server) bring their own Python; add only our packages.
            image = modal.Image.from_registry(self.base)
        else:
            image = modal.Image.debian_slim(python_version=self.python)
        if self.apt:
            image = image.apt_install(*self.apt)
        if self.pip:
            options = INDEX_STRATEGY if self.extra_index_url else ""
            image = image.uv_pip_install(*self.pip, extra_index_url=self.extra_index_url, extra_options=options)
        if self.env:
            image = image.env(dict(self.env))
        if self.dists:
            for dist in self.dists:
                if dist.wheel:  # copied into a layer (copy=True), so the install below may follow it
                    image = image.add_local_file(dist.wheel, dist.requirement, copy=True)
            image = image.uv_pip_install(*(d.requirement for d in self.dists), extra_options="--no-deps")
        return image


@dataclass(frozen=True)
class InstalledPlugin:
    """A vrl plugin installed here: entry-point name, its distribution, that distribution's requirements."""

    name: str
    distribution: str | None  # None: an entry point without distribution metadata
    requires: tuple[str, ...]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _runtime_requires(dist: metadata.Distribution, skip: set[str]) -> list[str]:
    """A distribution's requirements without extras-only ones and without `skip` (e.g. vrl itself)."""
    out = []
    for req in dist.requires or []:
        if "extra ==" in req.replace('"', "'").replace("extra==", "extra =="):
            continue
        name = req.split(";")[0].strip()
        for sep in "<>=!~[ (":
            name = name.split(sep)[0]
        if _canonical(name) in skip:
            continue
        out.append(req)
    return out


def _distribution(name: str) -> metadata.Distribution:
    """The installed distribution `name`, preferring one that records where it came from (PEP 610)."""
    found = list(metadata.distributions(name=name))
    if not found:
        raise WheelBuildError(f"{name} is not installed here, so it cannot go into the Modal images "
                              f"(pip install it, or leave it out of VRL_PLUGINS)")
    return next((d for d in found if d.read_text("direct_url.json")), found[0])


def vrl_requires() -> tuple[str, ...]:
    """vrl's own runtime requirements, read from the installed distribution."""
    return tuple(_runtime_requires(_distribution(DISTRIBUTION), set()))


def installed_plugins() -> tuple[InstalledPlugin, ...]:
    """Every plugin registered under the `vrl` entry-point group, with its distribution's requirements."""
    found = []
    for ep in metadata.entry_points(group="vrl"):
        dist = ep.dist
        requires = tuple(_runtime_requires(dist, {DISTRIBUTION})) if dist is not None else ()
        found.append(InstalledPlugin(ep.name, dist.metadata["Name"] if dist is not None else None, requires))
    return tuple(sorted(found, key=lambda p: p.name))


def requested_plugins(config: Any) -> tuple[InstalledPlugin, ...]:
    """The plugins a run needs in its containers: those that registered its environment, optimizer,
    generator backend or runtime, and every plugin `VRL_PLUGINS` names (not the others installed here)."""
    from vrl.plugins import PLUGINS_ENV, registry

    uses = {"environments": config.plugin, "optimizers": config.optimizer,
            "generators": config.generator.backend, "runtimes": config.runtime.kind}
    names = {p.strip() for p in os.environ.get(PLUGINS_ENV, "").split(",") if p.strip()}
    for info in registry().plugins.values():
        names.update(info.name for kind, used in uses.items() if _registers(info, kind, used))
    return tuple(p for p in installed_plugins() if p.name in names)


def plugin_for_environment(environment: str) -> InstalledPlugin | None:
    """The installed plugin that registers `environment` (None for vrl's built-ins such as countdown)."""
    from vrl.plugins import registry

    for info in registry().plugins.values():
        if _registers(info, "environments", environment):
            return next((p for p in installed_plugins() if p.name == info.name), None)
    return None


def _registers(info: Any, kind: str, name: str) -> bool:
    """Whether the plugin `info` registered `name` (or `plugin:name`, which names the plugin itself)."""
    owner, _, bare = name.rpartition(":")
    return (not owner or owner == info.name) and bare in info.registered.get(kind, ())


# -- the distributions, as wheels ---------------------------------------------------------------------


def dists_for(plugins: tuple[InstalledPlugin, ...]) -> tuple[Dist, ...]:
    """vrl-core and the distributions of `plugins`, each with the wheel the image installs."""
    names = [DISTRIBUTION, *(p.distribution for p in plugins if p.distribution)]
    return tuple(_dist(name) for name in dict.fromkeys(names))


def _dist(name: str) -> Dist:
    dist = _distribution(name)
    canonical = dist.metadata["Name"]
    project = _source_tree(dist)
    if project is not None:
        return Dist(canonical, dist.version, str(build_wheel(project)))
    return Dist(canonical, dist.version, _installed_wheel(dist))


def _source_tree(dist: metadata.Distribution) -> Path | None:
    """The project directory `dist` was installed from, if it is a source tree on this machine: the
    PEP 610 record of a directory install (editable or not), or a metadata directory that sits in a
    project (a `setup.py develop` / in-place egg-info)."""
    raw = dist.read_text("direct_url.json")
    if raw:
        info = json.loads(raw)
        url = info.get("url", "")
        if "dir_info" in info and url.startswith("file://"):
            path = Path(url.removeprefix("file://"))
            return path if _is_project(path) else None
    here = getattr(dist, "_path", None)  # PathDistribution: its metadata directory
    if here is not None and Path(here).suffix == ".egg-info" and _is_project(Path(here).parent):
        return Path(here).parent
    return None


def _is_project(path: Path) -> bool:
    return (path / "pyproject.toml").is_file() or (path / "setup.py").is_file()


def _installed_wheel(dist: metadata.Distribution) -> str | None:
    """The wheel `dist` was installed from, if it is still on this machine (in a container: the image's
    copy under WHEELS_DIR); None: the image installs `name==version` from the index."""
    raw = dist.read_text("direct_url.json")
    url = json.loads(raw).get("url", "") if raw else ""
    if url.startswith("file://") and url.endswith(".whl") and Path(url.removeprefix("file://")).is_file():
        return url.removeprefix("file://")
    stem = f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{dist.version}-"
    wheels = Path(WHEELS_DIR)
    match = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(stem.lower())) if wheels.is_dir() else []
    return str(match[0]) if match else None


def project_files(project: Path) -> list[Path]:
    """The files of a source tree that a wheel is built from: what git would commit (tracked and
    not-ignored files) in a git checkout, else every file but a top-level runs/ (vrl's default run
    directory); never dot-entries, caches or build outputs."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=project,
                            capture_output=True, text=True) if shutil.which("git") else None
    if listed is not None and listed.returncode == 0:
        candidates = [project / rel for rel in listed.stdout.split("\0") if rel]
    else:
        candidates = [p for p in project.rglob("*") if p.is_file() and p.relative_to(project).parts[0] != "runs"]
    out = []
    for path in candidates:
        rel = path.relative_to(project)
        if any(part.startswith(".") or part in _SKIP_PARTS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.is_file():
            out.append(path)
    return sorted(out)


def wheel_cache() -> Path:
    """Where built wheels are kept, one directory per content digest of their source files."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vrl" / "wheels"


KEEP_WHEELS = 32  # built wheels kept in the cache (the newest); older ones are removed when one is built


def _prune(cache: Path) -> None:
    entries = sorted((p for p in cache.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP_WHEELS:]:
        shutil.rmtree(old, ignore_errors=True)


def build_wheel(project: Path) -> Path:
    """A wheel of the project at `project` as its files are now (built once per content)."""
    files, digest = [], hashlib.sha256()
    for path in project_files(project):
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # removed since it was listed
            continue
        files.append(path)
        digest.update(str(path.relative_to(project)).encode() + b"\0" + data + b"\0")
    return _build_wheel(project, digest.hexdigest()[:24], tuple(files))


def _build_wheel(project: Path, digest: str, files: tuple[Path, ...]) -> Path:
    out = wheel_cache() / digest
    built = sorted(out.glob("*.whl")) if out.is_dir() else []
    if built:
        os.utime(out)  # the newest are kept
        return built[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("building a wheel of %s for the Modal images", project)
    with tempfile.TemporaryDirectory(prefix="vrl-wheel-") as tmp:
        # A clean copy: an in-tree build would also pack what a stale build/ directory still holds.
        source = Path(tmp) / "src"
        for path in files:
            target = source / path.relative_to(project)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        staged = Path(tmp) / "wheel"
        _run_build(source, staged, project)
        wheels = sorted(staged.glob("*.whl"))
        if len(wheels) != 1:
            raise WheelBuildError(f"building a wheel of {project} made {len(wheels)} wheels, expected one")
        partial = out.with_name(f"{digest}.tmp{os.getpid()}")
        partial.mkdir(parents=True, exist_ok=True)
        shutil.copy2(wheels[0], partial / wheels[0].name)
        try:
            partial.rename(out)
        except OSError:  # another process built it meanwhile: keep theirs
            shutil.rmtree(partial, ignore_errors=True)
    _prune(out.parent)
    return sorted(out.glob("*.whl"))[0]


def _run_build(source: Path, out: Path, project: Path) -> None:
    """`pip wheel --no-deps` (offline with this environment's build backend when it has the project's;
    else in an isolated build environment), or `uv build --wheel` where pip is missing."""
    if _has("pip"):
        offline = ["--no-build-isolation"] if _backend_here(source) else []
        argv = [sys.executable, "-m", "pip", "wheel", *offline, "--no-deps", "--quiet", "--disable-pip-version-check",
                "--wheel-dir", str(out), str(source)]
    elif shutil.which("uv"):
        argv = ["uv", "build", "--wheel", "--out-dir", str(out), str(source)]
    else:
        raise WheelBuildError("packaging vrl and its plugins for the Modal images needs pip or uv in this environment")
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode:
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise WheelBuildError(f"cannot build a wheel of {project} for the Modal images: "
                              f"{lines[-1] if lines else f'exit code {result.returncode}'}")


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _backend_here(source: Path) -> bool:
    """Whether this environment has the project's build backend (then building needs no network)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        system = tomllib.loads((source / "pyproject.toml").read_text()).get("build-system", {})
    except (OSError, ValueError):  # setup.py only, or a pyproject that pip will name as broken
        return True
    return _has(system.get("build-backend", "setuptools.build_meta").split(".")[0].split(":")[0])


# -- the recipes ------------------------------------------------------------------------------------------


def _plugin_requires(plugins: tuple[InstalledPlugin, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(r for p in plugins for r in p.requires))


def gpu_recipe(plugins: tuple[InstalledPlugin, ...] = ()) -> ImageRecipe:
    """Generation workers: vllm/torch/transformers/datasets + vrl and the plugins (prompts, tasks)."""
    pip = tuple(dict.fromkeys((*GPU_PACKAGES, *vrl_requires(), *_plugin_requires(plugins))))
    return ImageRecipe("gpu", pip=pip, dists=dists_for(plugins))


def orchestrator_recipe(plugins: tuple[InstalledPlugin, ...] = (), gpu: bool = False, verifies: bool = False
                        ) -> ImageRecipe:
    """The detached loop: light, CPU torch (ES keeps no weights here; the history is the state), or the
    GPU build of the workers' torch when the orchestrator has a GPU (GRPO's learner, runtime.modal.orchestrator_gpu).
    `verifies` (runtime.modal.verify_in=local): it judges attempts itself, so it gets the verifier image's
    Debian packages (bubblewrap, for vrl's jail) too."""
    # CPU or GPU build, the same torch version as the workers' (the CPU index's 2.11.0+cpu meets the pin)
    pip = tuple(dict.fromkeys((*ORCHESTRATOR_PACKAGES, TORCH, *vrl_requires(), *_plugin_requires(plugins))))
    return ImageRecipe("orchestrator", pip=pip, extra_index_url=None if gpu else TORCH_CPU_INDEX,
                       dists=dists_for(plugins), apt=VERIFIER_APT if verifies else ())


def verifier_recipe(plugin: InstalledPlugin | None, base: str | None = None, apt: tuple[str, ...] = ()
                    ) -> ImageRecipe:
    """A verifier sandbox: the plugin's own image (if it names one) + vrl and that plugin, CPU only;
    debian_slim gets bubblewrap; a registry image gets only the Debian packages its spec asks for (`apt`)."""
    plugins = (plugin,) if plugin else ()
    pip = tuple(dict.fromkeys((TORCH, *vrl_requires(), *_plugin_requires(plugins))))  # pinned CPU torch
    role = f"verifier:{plugin.name if plugin else 'vrl'}"
    packages = tuple(dict.fromkeys(apt if base else (*VERIFIER_APT, *apt)))
    return ImageRecipe(role, base=base, apt=packages, pip=pip, extra_index_url=TORCH_CPU_INDEX,
                       dists=dists_for(plugins))
