"""What an emulated container's filesystem holds, and the bubblewrap command that gives it one.

A Modal container sees its image, not the developer's machine (modal.com/docs/guide/images: "Containers
are started up from a stored snapshot of their filesystem state called an image"). Here:

- the operating system is this machine's /usr, /etc, /bin, /lib (read-only); /tmp, /root and /opt are fresh.
  Of the Debian packages an image may `apt_install`, those in `APT` exist only in images that install
  them (their programs are masked in the others: `which bwrap` finds nothing in a debian_slim image);
  any other package must already be installed here (it is then present in every image: a deviation);
- Python is this machine's base interpreter (not the venv), with a site-packages of the image's own:
  * requirements named in `pip_install`/`uv_pip_install` (or a `pip install` run command) are taken from
    the developer venv, each with its dependencies resolved through the venv's metadata (markers and
    extras evaluated; none with `--no-deps`). Only those: a package the image does not ask for is not
    there. Deviations: the venv's version stands for the one the image would resolve (a pin the venv
    does not meet is noted in `Layout.contents`, not refused), and a requirement the venv lacks is
    missing (noted too) instead of installed;
  * requirements that are local paths (a wheel or a project the image holds, e.g. added with
    `add_local_file(..., copy=True)`) are really installed (`pip install --no-deps --target`): metadata,
    entry points, package data, console scripts (on PATH, as /usr/local/bin would have them); their own
    dependencies come from the venv as above unless the install had `--no-deps`;
  * never from the venv: distributions installed in editable mode (their metadata, `.pth` hooks, finders:
    vrl-core, vrl-lean, vrl-python-tests here) and the real `modal` client. The fake `modal` and the
    `cloudpickle` it pickles with stand in for the client Modal mounts into every container;
- `add_local_python_source(...)` files are at /root/<package>/ (only what Modal ships: *.py by default,
  modal/_image.py), and /root is on PYTHONPATH for functions (not for sandboxes); `add_local_file` and
  `add_local_dir` put files at their remote path;
- a build step after an `add_local_*` layer without copy=True is refused (InvalidError, Modal's message:
  modal/_image.py `_assert_no_mount_layers`);
- the developer's checkout, home and venv are not visible; each Volume mount is the container's own view.

Local files are read where the image is defined (the client, or a container that defines images of
its own, as Modal's client uploads them from there). Materialised images are kept for the test session
(one directory per content digest), so each wheel is installed once per session, not once per test.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from functools import cached_property
from importlib import metadata
from pathlib import Path, PurePosixPath

FAKE = Path(__file__).parent / "fake"  # holds the fake `modal` package
EMU = "/opt/emu"  # where the emulator's own parts appear inside a container
REAL_MODAL = ("modal", "modal-proto", "modal-version", "modal-docs")
CLIENT = ("cloudpickle",)  # what the fake client needs in every container (Modal's client brings its own)
SYSTEM = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "proc", "dev", "tmp")  # not image paths here
BWRAP = "/usr/bin/bwrap"
APT = {"bubblewrap": (BWRAP,)}  # packages images may add: their programs, masked where not added
INIT = """#!/bin/sh
# The first program of every emulated container and sandbox: it starts the command given.
# bwrap's --proc covers /proc/sys, /proc/sysrq-trigger, /proc/irq and /proc/bus with read-only binds where they
# are writable (bubblewrap.c `cover_proc_dirs`); Linux then refuses a user namespace nested in here a procfs of its
# own (fs/namespace.c `mount_too_revealing`: no fully visible procfs), so a verifier's own bwrap sandbox could not
# start. A Modal container's /proc (gVisor's) has no such covers: they go.
umount /proc/sys /proc/sysrq-trigger /proc/irq /proc/bus 2>/dev/null
exec "$@"
"""
MOUNT_LAYERS = ("sources", "file", "dir")
NO_MOUNT_LAYERS_BEFORE = (
    "An image tried to run a build step after using `image.add_local_*` to include local files.\n\n"
    "Run `image.add_local_*` commands last in your image build to avoid rebuilding images with every local "
    "file change. Modal will then add these files to containers on startup instead, saving build time.\n"
    "If you need to run other build steps after adding local files, set `copy=True` to copy the files "
    "directly into the image, at the expense of some added build time.")
_session: dict[str, Path] = {}
_session_lock = threading.Lock()
_venv_index: dict[str, object] = {}  # Layout.venv_entries of this process: the listing it was read from, and it


def _canonical(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def validate(layers: tuple) -> None:
    """What Modal checks when it builds an image: no build step on top of a mounted local layer."""
    from modal.exception import InvalidError

    mounted = False
    for layer in layers:
        if layer[0] in MOUNT_LAYERS:
            mounted = mounted or not layer[-1]  # the layer's `copy`
        elif mounted and layer[0] in ("pip", "run", "env", "apt"):
            raise InvalidError(NO_MOUNT_LAYERS_BEFORE)


@dataclass
class ImageFS:
    """A materialised image: its files (a tree of absolute paths), environment, Python, installed packages."""

    tree: Path
    env: dict[str, str]
    python: str | None
    site: Path | None  # packages the image installed itself (pip of local paths), or None
    bin: Path | None  # their console scripts
    requirements: tuple[tuple[str, bool], ...]  # (requirement, with its dependencies) taken from the venv
    apt: tuple[str, ...]


class Layout:
    """The parts shared by every container of one emulator: site-packages views, python, bind list."""

    def __init__(self, state: Path):
        self.state = state
        self.venv_site = Path(sysconfig.get_paths()["purelib"])
        self.base_prefix = Path(sys.base_prefix).resolve()
        self.base_site = Path(sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["purelib"])
        self.python = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
        self.gvisor = state / "gvisor"  # bound at {EMU}/gvisor: the bwrap shim (gvisor.py) and `init`
        self._lock = threading.Lock()

    def write_gvisor(self) -> None:
        """The parts every container and sandbox runs under: the `bwrap` of gVisor's rules (gvisor.py, run
        by the image's python) and `init`, which starts the container's command (see `INIT`)."""
        self.gvisor.mkdir(parents=True, exist_ok=True)
        shim = self.gvisor / "bwrap"
        shim.write_text(f"#!{EMU}/bin/python -I\n" + (Path(__file__).parent / "gvisor.py").read_text())
        init = self.gvisor / "init"
        init.write_text(INIT)
        for path in (shim, init):
            path.chmod(0o755)  # a verifier may run bwrap under a uid of its own

    @cached_property
    def venv_entries(self) -> dict[str, VenvDist]:
        """The venv's distributions an image may take (canonical name -> its version, requirements and
        top-level site-packages entries): not editable installs, not the real client. Read once per
        process for as long as the venv's listing stays the same (4-5 s per read, which each emulator
        used to pay)."""
        listing = tuple(sorted(os.listdir(self.venv_site)))
        key = (str(self.venv_site), listing)
        with _session_lock:
            if _venv_index.get("key") != key:
                _venv_index.update(key=key, found=_read_venv(self.venv_site))
            return _venv_index["found"]

    def contents(self, image: ImageFS) -> dict[str, list[str]]:
        """What the image's site-packages takes from the venv: `included` distributions, requirements the
        venv lacks (`missing`) or meets at another version than the image asks (`mismatched`)."""
        from packaging.requirements import InvalidRequirement

        own = {_canonical(d.metadata["Name"]) for d in metadata.distributions(path=[str(image.site)])} if image.site else set()
        index = self.venv_entries
        included: dict[str, None] = {}
        missing, mismatched = [], []
        todo = [(text, deps, ()) for text, deps in image.requirements] + [(c, False, ()) for c in CLIENT]
        while todo:
            text, deps, extras = todo.pop()
            try:
                req = _requirement(text)
            except InvalidRequirement:
                missing.append(text)
                continue
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (extras or ("",))):
                continue
            name = _canonical(req.name)
            if name in own:
                continue
            if name not in index:
                missing.append(text)
                continue
            dist = index[name]
            if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
                mismatched.append(f"{text} (the venv has {dist.version})")
            if name in included and not req.extras:
                continue
            included[name] = None
            if deps:
                todo += [(r, True, tuple(req.extras)) for r in dist.requires or ()]
        return {"included": sorted(included), "missing": sorted(set(missing)), "mismatched": sorted(set(mismatched))}

    def site_view(self, image: ImageFS) -> Path:
        """The image's site-packages: links into the venv's (what the image asks for) and into what the
        image installed itself."""
        view = self.state / "site-packages" / image.tree.parent.name
        with self._lock:
            if view.exists():
                return view
            tmp = view.with_name(view.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            taken = set()
            for name in self.contents(image)["included"]:
                for entry in self.venv_entries[name].entries:
                    if entry not in taken:
                        taken.add(entry)
                        (tmp / entry).symlink_to(f"{EMU}/venv-site/{entry}")
            for entry in sorted(image.site.iterdir()) if image.site else ():
                if entry.name in taken:
                    (tmp / entry.name).unlink()
                (tmp / entry.name).symlink_to(f"{EMU}/image-site/{entry.name}")
            (tmp / "modal").symlink_to(f"{EMU}/fake/modal")
            tmp.rename(view)
        return view

    def bin_view(self, image: ImageFS) -> Path:
        """The image's programs beyond the OS: python (the base interpreter) and its console scripts."""
        view = self.state / "bin" / image.tree.parent.name
        with self._lock:
            if not view.exists():
                tmp = view.with_name(view.name + ".tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                for name in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
                    (tmp / name).symlink_to(self.python)
                for script in sorted(image.bin.iterdir()) if image.bin else ():
                    shutil.copy2(script, tmp / script.name)
                tmp.rename(view)
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
        # Folders that mount points need are made searchable by every uid (bwrap makes them 0700), as an image's
        # /usr/local and Modal's own mounts are: a verifier may run bwrap, and python, under a uid of its own.
        own_python = not str(self.base_prefix).startswith("/usr/")
        made = [PurePosixPath(EMU)]
        if own_python:
            made += [p for p in reversed(PurePosixPath(self.base_prefix).parents) if len(p.parts) > 2]
        argv += [arg for folder in made for arg in ("--perms", "0755", "--dir", str(folder))]
        if own_python:
            argv += ["--ro-bind", str(self.base_prefix), str(self.base_prefix)]
        argv += ["--ro-bind", str(self.gvisor), f"{EMU}/gvisor"]
        for package, programs in APT.items():
            if package not in image.apt:
                for program in programs:
                    if Path(program).exists():
                        argv += ["--ro-bind", "/dev/null", program]  # not executable: `which` skips it
        if "bubblewrap" in image.apt and Path(BWRAP).exists():
            # The image's bwrap is gVisor's (gvisor.py), which runs this machine's for what gVisor allows.
            argv += ["--ro-bind", BWRAP, f"{EMU}/real-bwrap", "--ro-bind", str(self.gvisor / "bwrap"), BWRAP]
        argv += ["--ro-bind", str(self.site_view(image)), str(self.base_site),
                 "--ro-bind", str(self.venv_site), f"{EMU}/venv-site",
                 "--ro-bind", str(FAKE), f"{EMU}/fake",
                 "--ro-bind", str(self.bin_view(image)), f"{EMU}/bin"]
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
        return argv + [f"{EMU}/gvisor/init"]


class VenvDist:
    """A distribution of the developer venv that images may take: its site-packages entries, and its
    version and requirements, each read from its metadata once per process (every emulator resolves
    its images' requirements through them: 0.3-0.5 CPU-s per image when each read them again)."""

    def __init__(self, dist: metadata.Distribution, entries: tuple[str, ...]):
        self.dist, self.entries = dist, entries

    @cached_property
    def version(self) -> str:
        return self.dist.version

    @cached_property
    def requires(self) -> tuple[str, ...]:
        return tuple(self.dist.requires or ())


@functools.lru_cache(maxsize=None)
def _requirement(text: str):
    """A parsed requirement (packaging's `Requirement`, which nothing here mutates), once per text."""
    from packaging.requirements import Requirement

    return Requirement(text)


def _read_venv(site: Path) -> dict[str, VenvDist]:
    """`Layout.venv_entries`, read from the disk."""
    found: dict[str, VenvDist] = {}
    for dist in metadata.distributions(path=[str(site)]):
        name = _canonical(dist.metadata["Name"] or "")
        raw = dist.read_text("direct_url.json")
        if not name or name in found or name in REAL_MODAL or (raw and json.loads(raw).get("dir_info", {}).get("editable")):
            continue
        found[name] = VenvDist(dist, _top_entries(dist, site))
    return found


def _top_entries(dist: metadata.Distribution, site: Path) -> tuple[str, ...]:
    """The site-packages entries a distribution owns (its RECORD's first path parts), metadata included."""
    names = {Path(str(dist._path)).name} if hasattr(dist, "_path") else set()
    for file in dist.files or ():
        parts = PurePosixPath(str(file)).parts
        if parts and parts[0] not in ("..", "__pycache__") and (site / parts[0]).exists():
            names.add(parts[0])
    if not dist.files:
        names.update(n for n in (dist.read_text("top_level.txt") or "").split() if (site / n).exists())
    return tuple(sorted(names))


def _session_cache() -> Path:
    """The images of this test session (removed when the process exits)."""
    with _session_lock:
        if "dir" not in _session:
            _session["dir"] = Path(tempfile.mkdtemp(prefix="modal-emu-images-"))
            atexit.register(shutil.rmtree, _session["dir"], True)
        return _session["dir"]


def materialize(layers: tuple, cache: Path | None = None) -> ImageFS:
    """An image's files, environment, Python and packages; built once per content for the test session
    (`cache` is accepted for the callers' sake; the session cache is used)."""
    digest = hashlib.sha256(pickle.dumps(layers)).hexdigest()[:16]  # local files' contents included
    base = _session_cache()
    root = base / digest
    if not root.exists():
        tmp = base / f"{digest}.tmp{os.getpid()}-{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "tree").mkdir(parents=True)
        manifest = {"requirements": [], "apt": []}
        for layer in layers:
            _apply(layer, tmp, manifest)
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        try:
            tmp.rename(root)
        except OSError:  # another thread made it
            shutil.rmtree(tmp, ignore_errors=True)
    env: dict[str, str] = {}
    for layer in layers:
        if layer[0] == "env":
            env.update(dict(layer[1]))
    python = layers[0][2] if layers and layers[0][0] == "base" else None
    manifest = json.loads((root / "manifest.json").read_text())
    site, bin_ = root / "site", root / "bin"
    return ImageFS(root / "tree", env, python, site if site.is_dir() else None, bin_ if bin_.is_dir() else None,
                   tuple((r, d) for r, d in manifest["requirements"]), tuple(manifest["apt"]))


def _place(tree: Path, remote: str) -> Path:
    path = PurePosixPath(remote)
    if not path.is_absolute() or (path.parts[1:2] and path.parts[1] in SYSTEM):
        raise NotImplementedError(f"the emulator places image files under /root, /opt or a new top-level "
                                  f"directory, not at {remote}")
    return tree / str(path).lstrip("/")


def _apply(layer: tuple, image: Path, manifest: dict) -> None:
    tree = image / "tree"
    kind = layer[0]
    if kind == "sources":
        for rel, data in layer[2]:
            target = tree / "root" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    elif kind == "file":
        _, _local, remote, data, _copy = layer
        target = _place(tree, remote)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    elif kind == "dir":
        _, _local, remote, files, _copy = layer
        for rel, data in files:
            target = _place(tree, remote) / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    elif kind == "apt":
        for package in layer[1]:
            if package not in APT and not _installed_here(package):
                raise NotImplementedError(f"apt_install({package!r}): the emulator adds only {', '.join(APT)}, "
                                          "or a package already installed on this machine")
        manifest["apt"] += list(layer[1])
    elif kind == "pip":
        _pip(list(layer[2]), "--no-deps" not in shlex.split(layer[5] or ""), image, manifest)
    elif kind == "run":
        for command in layer[1]:
            words = shlex.split(command)
            pip = _pip_words(words)
            if pip is None:
                raise NotImplementedError(f"run_commands({command!r}) is not emulated (only pip installs are)")
            _pip(_named(pip), "--no-deps" not in pip, image, manifest)


def _pip(requirements: list[str], deps: bool, image: Path, manifest: dict) -> None:
    """One install: local paths installed into the image's own site-packages, names from the venv."""
    local = [r for r in requirements if _is_local(r)]
    manifest["requirements"] += [[r, deps] for r in requirements if not _is_local(r)]
    installed = _install(local, image)
    if deps:  # the wheels' own requirements, as a resolver would add them
        for dist in installed:
            manifest["requirements"] += [[r, True] for r in dist.requires or ()]


def _installed_here(package: str) -> bool:
    if shutil.which("dpkg-query") is None:
        return False
    result = subprocess.run(["dpkg-query", "-W", "-f", "${Status}", package], capture_output=True, text=True)
    return result.returncode == 0 and "install ok installed" in result.stdout


def _pip_words(words: list[str]) -> list[str] | None:
    """The arguments of a `pip install`, `uv pip install` or `python -m pip install` command, else None."""
    for i in range(len(words) - 1):
        if PurePosixPath(words[i]).name in ("pip", "pip3") and words[i + 1] == "install":
            return words[i + 2:]
    return None


_VALUED = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-r", "--requirement", "-c",
           "--constraint", "--python", "--target", "--prefix", "--index-strategy", "-t"}


def _named(words: list[str]) -> list[str]:
    """The requirements among a pip command's arguments (not its options, nor their values)."""
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = word in _VALUED
        else:
            out.append(word)
    return out


def _is_local(requirement: str) -> bool:
    return requirement.startswith(("/", "./", "file:")) or requirement.endswith(".whl")


def _install(requirements: list[str], image: Path) -> list[metadata.Distribution]:
    """pip-install local wheels or projects the image holds into the image's own site-packages; their
    console scripts go to the image's bin, run by the image's python."""
    if not requirements:
        return []
    tree, site = image / "tree", image / "site"
    before = {d.metadata["Name"] for d in metadata.distributions(path=[str(site)])} if site.is_dir() else set()
    paths = [str(_place(tree, r.removeprefix("file://"))) if r.startswith(("/", "file:")) else r for r in requirements]
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                             "--no-compile", "--disable-pip-version-check", "--quiet", "--target",
                             str(site), *paths], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"image build: pip install {' '.join(requirements)} failed:\n{result.stderr[-2000:]}")
    scripts = site / "bin"
    if scripts.is_dir():
        (image / "bin").mkdir(exist_ok=True)
        for script in scripts.iterdir():
            text = script.read_bytes()
            if text.startswith(b"#!"):  # pip wrote this venv's interpreter; the image runs its own
                text = f"#!{EMU}/bin/python".encode() + text[text.index(b"\n"):]
            (image / "bin" / script.name).write_bytes(text)
            (image / "bin" / script.name).chmod(0o755)
        shutil.rmtree(scripts)
    return [d for d in metadata.distributions(path=[str(site)]) if d.metadata["Name"] not in before]
