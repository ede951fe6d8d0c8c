"""One container image per role, built from the vrl and plugins installed here.

Each image is first a plain `ImageRecipe` (base, Python, pip requirements, local source packages,
environment), so what goes where can be read and tested without Modal; `ImageRecipe.build()` turns
it into a `modal.Image`:

- `gpu`: debian_slim + the client's Python + vllm 0.26.0, torch 2.11.0, transformers, datasets + vrl and the plugins.
- `orchestrator`: debian_slim + the client's Python, light (requests, tqdm, numpy, CPU torch; GPU torch with
  `orchestrator_gpu`) + vrl and plugins.
- `verifier:<plugin>`: the plugin's image (e.g. kimina-lean-server) or debian_slim, + vrl and that plugin.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from typing import Any

from vrl.meta import DISTRIBUTION

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
"""The images' Python is the client's: functions are sent cloudpickled (`serialized=True`), and a pickle
made by one Python minor version does not load in another."""
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH = "torch==2.11.0"
"""The torch vLLM 0.26.0 pins (the pair tested on the GPU machine, docs/vllm.md)."""
GPU_PACKAGES = ("vllm==0.26.0", TORCH, "transformers", "datasets", "safetensors", "hf_transfer")
ORCHESTRATOR_PACKAGES = ("requests", "tqdm", "numpy")
INDEX_STRATEGY = "--index-strategy unsafe-best-match"
"""uv's default `first-index` takes every package an extra index has from that index alone (the CPU torch
index mirrors old jinja2, requests, numpy...): with an extra index, pick the best version across both."""


@dataclass(frozen=True)
class ImageRecipe:
    """What goes into one role's image; `build()` makes the `modal.Image`."""

    role: str
    base: str | None = None  # a registry tag; None: Modal's debian_slim
    python: str = PYTHON
    pip: tuple[str, ...] = ()
    extra_index_url: str | None = None  # CPU-only torch wheels for images without a GPU
    sources: tuple[str, ...] = ()  # local Python packages shipped as source (vrl, vrl_lean, ...)
    env: dict[str, str] = field(default_factory=dict)

    def build(self) -> Any:
        """The `modal.Image` for this recipe (lazy: Modal builds it on first use, then caches it)."""
        import modal

        if self.base:
            # Registry images (kimina-lean-server) bring their own Python; add only our packages.
            image = modal.Image.from_registry(self.base)
        else:
            image = modal.Image.debian_slim(python_version=self.python)
        if self.pip:
            options = INDEX_STRATEGY if self.extra_index_url else ""
            image = image.uv_pip_install(*self.pip, extra_index_url=self.extra_index_url, extra_options=options)
        if self.env:
            image = image.env(dict(self.env))
        if self.sources:
            image = image.add_local_python_source(*self.sources)
        return image


@dataclass(frozen=True)
class InstalledPlugin:
    """A vrl plugin installed here: entry-point name, its top-level package, its requirements."""

    name: str
    package: str
    requires: tuple[str, ...]


def _runtime_requires(dist: metadata.Distribution, skip: set[str]) -> list[str]:
    """A distribution's requirements without extras-only ones and without `skip` (e.g. vrl itself)."""
    out = []
    for req in dist.requires or []:
        if "extra ==" in req.replace('"', "'").replace("extra==", "extra =="):
            continue
        name = req.split(";")[0].strip()
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        if name.lower().replace("_", "-") in skip:
            continue
        out.append(req)
    return out


@lru_cache(maxsize=1)
def vrl_requires() -> tuple[str, ...]:
    """vrl's own runtime requirements, read from the installed distribution."""
    return tuple(_runtime_requires(metadata.distribution(DISTRIBUTION), set()))


@lru_cache(maxsize=1)
def installed_plugins() -> tuple[InstalledPlugin, ...]:
    """Every plugin registered under the `vrl` entry-point group, with its requirements."""
    found = []
    for ep in metadata.entry_points(group="vrl"):
        package = ep.value.split(":")[0].split(".")[0]
        requires = tuple(_runtime_requires(ep.dist, {DISTRIBUTION})) if ep.dist is not None else ()
        found.append(InstalledPlugin(ep.name, package, requires))
    return tuple(sorted(found, key=lambda p: p.name))


def _plugin_parts(plugins: tuple[InstalledPlugin, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    packages = tuple(dict.fromkeys(p.package for p in plugins if p.package != "vrl"))
    requires = tuple(dict.fromkeys(r for p in plugins for r in p.requires))
    return packages, requires


def gpu_recipe(plugins: tuple[InstalledPlugin, ...] | None = None) -> ImageRecipe:
    """Generation workers: vllm/torch/transformers/datasets + vrl and the plugins (prompts, tasks)."""
    packages, requires = _plugin_parts(installed_plugins() if plugins is None else plugins)
    pip = tuple(dict.fromkeys((*GPU_PACKAGES, *vrl_requires(), *requires)))
    return ImageRecipe("gpu", pip=pip, sources=("vrl", *packages), env={"HF_HUB_ENABLE_HF_TRANSFER": "1"})


def orchestrator_recipe(plugins: tuple[InstalledPlugin, ...] | None = None, gpu: bool = False) -> ImageRecipe:
    """The detached loop: light, CPU torch (ES keeps no weights here; the history is the state), or the
    GPU build of the workers' torch when the orchestrator has a GPU (GRPO's learner, runtime.modal.orchestrator_gpu)."""
    packages, requires = _plugin_parts(installed_plugins() if plugins is None else plugins)
    pip = tuple(dict.fromkeys((*ORCHESTRATOR_PACKAGES, *((TORCH,) if gpu else ()), *vrl_requires(), *requires)))
    return ImageRecipe("orchestrator", pip=pip, extra_index_url=None if gpu else TORCH_CPU_INDEX, sources=("vrl", *packages))


def verifier_recipe(plugin: InstalledPlugin | None, base: str | None = None) -> ImageRecipe:
    """A verifier sandbox: the plugin's own image (if it names one) + vrl and that plugin, CPU only."""
    packages, requires = _plugin_parts((plugin,) if plugin else ())
    pip = tuple(dict.fromkeys((*vrl_requires(), *requires)))
    role = f"verifier:{plugin.name if plugin else 'vrl'}"
    return ImageRecipe(role, base=base, pip=pip, extra_index_url=TORCH_CPU_INDEX, sources=("vrl", *packages))


def plugin_for_environment(environment: str) -> InstalledPlugin | None:
    """The installed plugin that registers `environment` (None for vrl's built-ins such as countdown)."""
    from vrl.plugins import registry

    reg = registry()
    for info in reg.plugins.values():
        if environment in info.registered.get("environments", ()):
            for plugin in installed_plugins():
                if plugin.name == info.name:
                    return plugin
    return None
