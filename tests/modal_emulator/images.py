"""What an emulated container's filesystem holds, and the bubblewrap command that gives it one.

A Modal container sees its image, not the developer's machine (modal.com/docs/guide/images: "Containers
are started up from a stored snapshot of their filesystem state called an image"). Here:

- the operating system is this machine's /usr, /etc, /bin, /lib (read-only); /tmp, /root and /opt are fresh;
- Python is this machine's base interpreter (not the venv); its site-packages is replaced by the image's:
  the developer venv's third-party packages *without* what a pip install of the image would not bring:
  distributions installed in editable mode (their metadata, `.pth` hooks, finders: vrl-core, vrl-lean,
  vrl-python-tests here) and the real `modal` client (the fake stands in for the client Modal mounts
  into every container). Requirements by name in `pip_install`/`uv_pip_install` are not installed one by
  one (the venv's set stands for them: a deviation, a package the recipe forgets is still present);
  requirements that are local paths (a wheel or a project the image holds, e.g. added with
  `add_local_file(..., copy=True)`) are really installed (`pip install --no-deps`), metadata and entry
  points included, and shadow the venv's;
- `add_local_python_source(...)` files are at /root/<package>/ (only what Modal ships: *.py by default,
  modal/_image.py), and /root is on PYTHONPATH for functions (not for sandboxes); `add_local_file` and
  `add_local_dir` put files at their remote path;
- a build step after an `add_local_*` layer without copy=True is refused (InvalidError, Modal's message:
  modal/_image.py `_assert_no_mount_layers`);
- the developer's checkout, home and venv are not visible; each Volume mount is the container's own view.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from functools import cached_property
from importlib import metadata
from pathlib import Path, PurePosixPath

FAKE = Path(__file__).parent / "fake"  # holds the fake `modal` package
EMU = "/opt/emu"  # where the emulator's own parts appear inside a container
REAL_MODAL = ("modal", "modal_proto", "modal_version", "modal_docs")
SYSTEM = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "proc", "dev", "tmp")  # not image paths here
MOUNT_LAYERS = ("sources", "file", "dir")
NO_MOUNT_LAYERS_BEFORE = (
    "An image tried to run a build step after using `image.add_local_*` to include local files.\n\n"
    "Run `image.add_local_*` commands last in your image build to avoid rebuilding images with every local "
    "file change. Modal will then add these files to containers on startup instead, saving build time.\n"
    "If you need to run other build steps after adding local files, set `copy=True` to copy the files "
    "directly into the image, at the expense of some added build time.")


def _editable_distributions() -> dict[str, str]:
    """name -> source path of every distribution installed in editable mode (PEP 610 direct_url.json)."""
    found = {}
    for dist in metadata.distributions():
        raw = dist.read_text("direct_url.json")
        if raw and json.loads(raw).get("dir_info", {}).get("editable"):
            found[dist.metadata["Name"]] = json.loads(raw)["url"].removeprefix("file://")
    return found


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _top_name(entry: Path) -> str:
    if entry.suffix in (".dist-info", ".egg-info"):
        return _norm(entry.name.split("-")[0])
    return entry.name


def validate(layers: tuple) -> None:
    """What Modal checks when it builds an image: no build step on top of a mounted local layer."""
    from modal.exception import InvalidError

    mounted = False
    for layer in layers:
        if layer[0] in MOUNT_LAYERS:
            mounted = mounted or not layer[-1]  # the layer's `copy`
        elif mounted and layer[0] in ("pip", "run", "env"):
            raise InvalidError(NO_MOUNT_LAYERS_BEFORE)


@dataclass
class ImageFS:
    """A materialised image: its files (a tree of absolute paths), environment, Python, installed packages."""

    tree: Path
    env: dict[str, str]
    python: str | None
    site: Path | None  # packages the image installed itself (pip of local paths), or None


class Layout:
    """The parts shared by every container of one emulator: site-packages views, python, bind list."""

    def __init__(self, state: Path):
        self.state = state
        self.venv_site = Path(sysconfig.get_paths()["purelib"])
        self.base_prefix = Path(sys.base_prefix).resolve()
        self.base_site = Path(sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["purelib"])
        self.python = Path(getattr(sys, "_base_executable", sys.executable)).resolve()

    @cached_property
    def venv_entries(self) -> list[str]:
        """The venv's site-packages entries an image gets: not editable installs, not the real client."""
        editable = _editable_distributions()
        names = {_norm(n) for n in editable} | set(REAL_MODAL)
        sources = tuple(editable.values())
        keep = []
        for entry in sorted(self.venv_site.iterdir()):
            if _top_name(entry) in names or entry.name.startswith("__editable__"):
                continue
            if entry.suffix == ".pth" and any(src in entry.read_text(errors="replace") for src in sources):
                continue
            keep.append(entry.name)
        bindir = self.state / "bin"
        bindir.mkdir(parents=True, exist_ok=True)
        for name in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
            if not (bindir / name).is_symlink():
                (bindir / name).symlink_to(self.python)
        return keep

    def site_view(self, image: ImageFS) -> Path:
        """The image's site-packages: links into the venv's and into what the image installed itself."""
        view = self.state / "site-packages" / (image.tree.name if image.site else "venv")
        if view.exists():
            return view
        tmp = view.with_name(view.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True)
        own = {_top_name(e) for e in image.site.iterdir()} if image.site else set()
        for name in self.venv_entries:
            if _top_name(self.venv_site / name) not in own:
                (tmp / name).symlink_to(f"{EMU}/venv-site/{name}")
        for entry in sorted(image.site.iterdir()) if image.site else ():
            (tmp / entry.name).symlink_to(f"{EMU}/image-site/{entry.name}")
        (tmp / "modal").symlink_to(f"{EMU}/fake/modal")
        try:
            tmp.rename(view)
        except OSError:  # built meanwhile by another thread
            shutil.rmtree(tmp, ignore_errors=True)
        return view

    def bwrap(self, image: ImageFS, binds: dict[str, Path], workdir: str, env: dict[str, str],
              network: bool = True) -> list[str]:
        """argv prefix running a command in a container of `image`."""
        argv = ["bwrap", "--die-with-parent", "--unshare-pid", "--new-session", "--proc", "/proc", "--dev", "/dev",
                "--tmpfs", "/tmp", "--tmpfs", "/root", "--tmpfs", "/opt"]
        for top in ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64"):
            path = Path("/") / top
            if path.is_symlink():
                argv += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                argv += ["--ro-bind", str(path), str(path)]
        if not str(self.base_prefix).startswith("/usr/"):
            argv += ["--ro-bind", str(self.base_prefix), str(self.base_prefix)]
        argv += ["--ro-bind", str(self.site_view(image)), str(self.base_site),
                 "--ro-bind", str(self.venv_site), f"{EMU}/venv-site",
                 "--ro-bind", str(FAKE), f"{EMU}/fake",
                 "--ro-bind", str(self.state / "bin"), f"{EMU}/bin"]
        if image.site:
            argv += ["--ro-bind", str(image.site), f"{EMU}/image-site"]
        for top in sorted(image.tree.iterdir()):
            children = sorted(top.iterdir()) if top.name in ("root", "opt") else [top]
            for entry in children:
                argv += ["--ro-bind", str(entry), "/" + str(entry.relative_to(image.tree))]
        for target, source in binds.items():
            argv += ["--bind", str(source), target]
        if not network:
            argv += ["--unshare-net"]
        argv += ["--chdir", workdir, "--clearenv"]
        for key, value in env.items():
            argv += ["--setenv", key, value]
        return argv


def materialize(layers: tuple, cache: Path) -> ImageFS:
    """An image's files, environment and Python; built once per content (cached by digest)."""
    digest = hashlib.sha256(pickle.dumps(layers)).hexdigest()[:16]
    root = cache / digest
    env: dict[str, str] = {}
    for layer in layers:
        if layer[0] == "env":
            env.update(dict(layer[1]))
    python = layers[0][2] if layers and layers[0][0] == "base" else None
    if not root.exists():
        tmp = cache / f"{digest}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "tree").mkdir(parents=True)
        for layer in layers:
            _apply(layer, tmp)
        try:
            tmp.rename(root)
        except OSError:  # another thread made it
            shutil.rmtree(tmp, ignore_errors=True)
    site = root / "site"
    return ImageFS(root / "tree", env, python, site if site.is_dir() else None)


def _place(tree: Path, remote: str) -> Path:
    path = PurePosixPath(remote)
    if not path.is_absolute() or (path.parts[1:2] and path.parts[1] in SYSTEM):
        raise NotImplementedError(f"the emulator places image files under /root, /opt or a new top-level "
                                  f"directory, not at {remote}")
    return tree / str(path).lstrip("/")


def _apply(layer: tuple, image: Path) -> None:
    tree = image / "tree"
    kind = layer[0]
    if kind == "sources":
        for rel, data in layer[2]:
            target = tree / "root" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    elif kind == "file":
        _, local, remote, _copy = layer
        target = _place(tree, remote)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(local, target)
    elif kind == "dir":
        _, local, remote, files, _copy = layer
        for rel in files:
            target = _place(tree, remote) / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(local) / rel, target)
    elif kind == "pip":
        _install([p for p in layer[2] if _is_local(p)], image)
    elif kind == "run":
        for command in layer[1]:
            words = shlex.split(command)
            pip = _pip_words(words)
            if pip is None:
                raise NotImplementedError(f"run_commands({command!r}) is not emulated (only pip installs are)")
            _install([w for w in pip if _is_local(w)], image)


def _pip_words(words: list[str]) -> list[str] | None:
    """The arguments of a `pip install`, `uv pip install` or `python -m pip install` command, else None."""
    for i in range(len(words) - 1):
        if PurePosixPath(words[i]).name in ("pip", "pip3") and words[i + 1] == "install":
            return words[i + 2:]
    return None


def _is_local(requirement: str) -> bool:
    return requirement.startswith(("/", "./", "file:")) or requirement.endswith(".whl")


def _install(requirements: list[str], image: Path) -> None:
    """pip-install local wheels or projects the image holds into the image's own site-packages."""
    if not requirements:
        return
    tree = image / "tree"
    paths = [str(_place(tree, r.removeprefix("file://"))) if r.startswith(("/", "file:")) else r for r in requirements]
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                             "--no-compile", "--disable-pip-version-check", "--quiet", "--target",
                             str(image / "site"), *paths], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"image build: pip install {' '.join(requirements)} failed:\n{result.stderr[-2000:]}")
