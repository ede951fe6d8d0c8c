"""A stand-in for the `modal` package (the 1.6.4 API vrl uses), backed by the emulated service.

Names, signatures and error types follow modal 1.6.4's installed source (modal/app.py, _functions.py,
cls.py, volume.py, _image.py, sandbox/_sandbox.py, io_streams.py, exception.py); what each call does
is the service's job (tests/modal_emulator/service.py, whose docstring lists the rules and where
Modal states them). The same package is importable in the client and in every emulated container.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from modal import exception
from modal._emu import Dual, call, container_id, dumps, loads
from modal.exception import Error, ExecutionError, InvalidError

__version__ = "1.6.4"
__all__ = ["App", "Cls", "Dict", "Error", "Function", "FunctionCall", "Image", "Sandbox", "Secret", "Volume",
           "current_function_call_id", "enable_output", "enter", "exception", "is_local", "method", "parameter"]

#: How many `enable_output()` blocks are open in this process (emulator only: tests read it).
output_enabled = 0


@contextlib.contextmanager
def enable_output(show_progress: bool = True):
    """modal/output.py `enable_output`: Modal prints builds, logs and progress while the block runs (here the
    container logs stay in the emulator's state directory; the block is only counted)."""
    global output_enabled
    output_enabled += 1
    try:
        yield
    finally:
        output_enabled -= 1

# The keyword names of modal 1.6.4's decorators (inspect.signature of the installed package); a name
# outside these is a TypeError there too. tests/test_modal_emulator.py checks them against the source.
FUNCTION_OPTIONS = frozenset((
    "image schedule env secrets gpu serialized network_file_systems volumes cpu memory ephemeral_disk min_containers "
    "max_containers buffer_containers scaledown_window proxy retries timeout startup_timeout name is_generator cloud "
    "region routing_region nonpreemptible enable_memory_snapshot block_network restrict_modal_access "
    "single_use_containers i6pn include_source experimental_options _experimental_restrict_output max_inputs").split())
CLS_OPTIONS = FUNCTION_OPTIONS - {"schedule", "name", "is_generator"}
COMMIT_OUTSIDE = "commit() can only be called on a mounted volume inside a container"


def is_local() -> bool:
    """False only inside a container running a Modal Function (modal/_runtime/execution_context.py)."""
    return container_id() is None


def current_function_call_id() -> str | None:
    """The call of the input this container runs (modal/_runtime/execution_context.py); None outside one.
    A restarted or retried input keeps its call's id."""
    cid = container_id()
    return None if cid is None else call("container_current", cid)


def _client_python() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def _check_names(where: str, given: dict, allowed: frozenset) -> None:
    for name in given:
        if name not in allowed:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")


# -- decorators and parameters ----------------------------------------------------------------------


class _Parameter:
    def __init__(self, default: Any):
        self.default = default


class _Missing:
    def __reduce__(self):
        return "_MISSING"  # one sentinel in every process


_MISSING = _Missing()


def parameter(*, default: Any = _MISSING, init: bool = True) -> Any:
    return _Parameter(default)


def enter(*, snap: bool = False):
    def mark(fn):
        fn._modal_enter = True
        return fn
    return mark


def method(*, is_generator: bool | None = None):
    def mark(fn):
        fn._modal_method = True
        return fn
    return mark


# -- secrets, images ------------------------------------------------------------------------------------


class Secret:
    def __init__(self, name: str | None = None, env: dict[str, str] | None = None):
        self._name, self._env = name, env

    @staticmethod
    def from_name(name: str, *, environment_name: str | None = None, required_keys: list[str] = [],  # noqa: B006
                  client: Any = None) -> Secret:
        return Secret(name=name)

    @staticmethod
    def from_dict(env_dict: dict[str, str | None] = {}) -> Secret:  # noqa: B006 - Modal's signature
        return Secret(env={k: v for k, v in env_dict.items() if v is not None})

    def _spec(self) -> tuple[str | None, dict | None]:
        return self._name, self._env

    def __repr__(self) -> str:
        return f"modal.Secret.from_name({self._name!r})" if self._name else "modal.Secret.from_dict(...)"


def _python_sources(module: str, ignore: Any) -> dict[str, bytes]:
    """The files `add_local_python_source(module)` ships, read where it is called (modal/mount.py,
    `_MountedPythonModule`): a package's *.py files (or those `ignore` keeps), no dot-prefixed entries,
    no __pycache__; a module's one file. Paths are relative to /root."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise ModuleNotFoundError(f"add_local_python_source: module {module!r} is not importable here")
    out: dict[str, bytes] = {}
    prefix = PurePosixPath(*module.split("."))
    if spec.submodule_search_locations:
        for base in map(Path, spec.submodule_search_locations):
            for path in sorted(base.rglob("*")):
                rel = path.relative_to(base)
                if not path.is_file() or any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
                    continue
                keep = path.suffix == ".py" if ignore is None else not _ignored(ignore, rel)
                if keep:
                    out[str(prefix / rel.as_posix())] = path.read_bytes()
    elif spec.origin:
        out[str(prefix.parent / Path(spec.origin).name)] = Path(spec.origin).read_bytes()
    return out


def _ignored(ignore: Any, rel: Path) -> bool:
    if callable(ignore):
        return bool(ignore(rel))
    return any(rel.match(pattern) for pattern in ignore)


def _packages(groups: tuple) -> tuple[str, ...]:
    flat = tuple(p for group in groups for p in ([group] if isinstance(group, str) else group))
    if any(p.startswith("-") for p in flat):  # modal/_image.py `_validate_packages`
        raise InvalidError("Package list cannot contain other arguments; try the `extra_options` parameter instead.")
    return flat


class Image:
    """A chain of build steps; the service materialises it into a container filesystem."""

    def __init__(self, layers: tuple = ()):
        self._layers = tuple(layers)

    def _extend(self, *layer) -> Image:
        return Image((*self._layers, layer))

    @staticmethod
    def debian_slim(python_version: str | None = None, force_build: bool = False) -> Image:
        # "a basic Python installation of the same minor version v3.x as your local Python" by default
        # (modal.com/docs/guide/images).
        if isinstance(python_version, float):
            raise TypeError("The `python_version` argument should be a string, not a float.")
        return Image((("base", "debian_slim", python_version or _client_python()),))

    @staticmethod
    def from_registry(tag: str, *, secret: Secret | None = None, setup_dockerfile_commands: list[str] = [],  # noqa: B006
                      force_build: bool = False, add_python: str | None = None, **kwargs: Any) -> Image:
        return Image((("base", tag, add_python),))  # the registry image's own Python unless add_python

    def uv_pip_install(self, *packages: str | list[str], requirements: list[str] | None = None,
                       find_links: str | None = None, index_url: str | None = None,
                       extra_index_url: str | None = None, pre: bool = False, extra_options: str = "",
                       force_build: bool = False, uv_version: str | None = None, env: dict | None = None,
                       secrets: Any = None, gpu: str | None = None) -> Image:
        return self._extend("pip", "uv", _packages(packages), index_url, extra_index_url, extra_options)

    def pip_install(self, *packages: str | list[str], find_links: str | None = None, index_url: str | None = None,
                    extra_index_url: str | None = None, pre: bool = False, extra_options: str = "",
                    force_build: bool = False, env: dict | None = None, secrets: Any = None,
                    gpu: str | None = None) -> Image:
        return self._extend("pip", "pip", _packages(packages), index_url, extra_index_url, extra_options)

    def apt_install(self, *packages: str | list[str], force_build: bool = False, env: dict | None = None,
                    secrets: Any = None, gpu: str | None = None) -> Image:
        pkgs = _packages(packages)
        return self._extend("apt", pkgs) if pkgs else self

    def env(self, vars: dict[str, str]) -> Image:
        bad = [key for key, value in vars.items() if not isinstance(value, str)]
        if bad:
            raise InvalidError(f"Image ENV variables must be strings. Invalid keys: {bad}")
        return self._extend("env", tuple(sorted(vars.items())))

    def run_commands(self, *commands: str | list[str], env: dict | None = None, secrets: Any = None,
                     volumes: dict | None = None, gpu: str | None = None, force_build: bool = False) -> Image:
        flat = tuple(c for group in commands for c in ([group] if isinstance(group, str) else group))
        return self._extend("run", flat)

    def add_local_python_source(self, *modules: str, copy: bool = False, ignore: Any = None) -> Image:
        files: dict[str, bytes] = {}
        for module in modules:
            files.update(_python_sources(module, ignore))
        return self._extend("sources", modules, tuple(sorted(files.items())), copy)

    def add_local_file(self, local_path: str | Path, remote_path: str, *, copy: bool = False) -> Image:
        if not PurePosixPath(remote_path).is_absolute():
            raise InvalidError("image.add_local_file() currently only supports absolute remote_path values")
        if remote_path.endswith("/"):
            remote_path += Path(local_path).name
        # Read here, in the defining process (a client or a container), as Modal's client uploads it.
        path = Path(local_path).resolve()
        return self._extend("file", str(path), remote_path, path.read_bytes(), copy)

    def add_local_dir(self, local_path: str | Path, remote_path: str, *, copy: bool = False,
                      ignore: Any = []) -> Image:  # noqa: B006 - Modal's signature
        if not PurePosixPath(remote_path).is_absolute():
            raise InvalidError("image.add_local_dir() currently only supports absolute remote_path values")
        base = Path(local_path).resolve()
        files = tuple((str(p.relative_to(base)), p.read_bytes()) for p in sorted(base.rglob("*"))
                      if p.is_file() and not (ignore and _ignored(ignore, p.relative_to(base))))
        return self._extend("dir", str(base), remote_path, files, copy)

    @property
    def python(self) -> str | None:
        """The image's Python (emulator only: what the service compares with the client's)."""
        return self._layers[0][2] if self._layers else None

    def pip_commands(self) -> list[str]:
        """Emulator only: the install commands Modal's builder runs for this image (modal/_image.py
        `uv_pip_install`/`pip_install` build_dockerfile: index options, then extra_options, then packages)."""
        out = []
        for layer in self._layers:
            if layer[0] == "pip":
                _, tool, packages, index_url, extra_index_url, extra_options = layer
                args = [f"--index-url {index_url}"] if index_url else []
                args += [f"--extra-index-url {extra_index_url}"] if extra_index_url else []
                args += [extra_options] if extra_options else []
                out.append(" ".join([f"{'uv pip' if tool == 'uv' else 'python -m pip'} install", *args, *sorted(packages)]))
        return out

    def __repr__(self) -> str:
        return f"Image({self._layers[0][1] if self._layers else '?'}, {len(self._layers)} layers)"


# -- volumes ------------------------------------------------------------------------------------------


@dataclass
class FileEntry:
    path: str
    type: str  # "file" or "directory"
    mtime: float
    size: int


class Volume:
    """A named Volume. `from_name` is lazy; the first use hydrates it, and with `create_if_missing=True` that
    creates a missing Volume, from a container or from the user's machine alike (modal/volume.py `from_name`:
    "Hydration is lazy"; its loader sends VolumeGetOrCreate with OBJECT_CREATION_TYPE_CREATE_IF_MISSING), so `batch_upload`, `read_file`, `listdir` and
    `remove_file` of a never-used Volume work there too; without it they raise NotFoundError."""

    def __init__(self, name: str, create: bool):
        self._name, self._create = name, create

    @staticmethod
    def from_name(name: str, *, environment_name: str | None = None, create_if_missing: bool = False,
                  version: int | None = None, create_options: Any = None, client: Any = None) -> Volume:
        return Volume(name, create_if_missing)

    @property
    def name(self) -> str:
        return self._name

    def _commit(self) -> None:
        """modal/volume.py `commit`: persist this container's changes, then reload (a failed reload
        raises RuntimeError). "Must be called inside a container that mounts the Volume"."""
        cid = container_id()
        if cid is None:
            raise RuntimeError(COMMIT_OUTSIDE)
        mount = call("volume_commit", cid, self._name, True)
        _refuse_open_files(mount)
        call("volume_refresh", cid, self._name)

    def _reload(self) -> None:
        """modal/volume.py `reload`: the latest committed state; "Reloading will fail if there are open
        files for the volume" (RuntimeError); this container's own changes are committed first
        ("Any uncommitted changes ... may implicitly be committed when reloading")."""
        cid = container_id()
        if cid is None:
            raise RuntimeError("reload() can only be called on a mounted volume inside a container")
        mount = call("volume_mount_of", cid, self._name)
        _refuse_open_files(mount)
        call("volume_commit", cid, self._name, False)
        call("volume_refresh", cid, self._name)

    commit = Dual(_commit)
    reload = Dual(_reload)

    def read_file(self, path: str):
        """The committed bytes of `path` (FileNotFoundError if absent), as an iterator of chunks."""
        data = call("volume_read", self._name, str(path), self._create)
        for i in range(0, max(len(data), 1), 1 << 20):
            yield data[i:i + (1 << 20)]

    def listdir(self, path: str, recursive: bool = False) -> list[FileEntry]:
        return [FileEntry(*row) for row in call("volume_listdir", self._name, str(path), recursive, self._create)]

    def batch_upload(self, force: bool = False) -> _BatchUpload:
        return _BatchUpload(self._name, force, self._create)

    def remove_file(self, path: str, recursive: bool = False) -> None:
        """Remove a file (or, `recursive`, a directory) from the committed Volume, from anywhere."""
        call("volume_remove", self._name, str(path), recursive, self._create)

    def _mount_spec(self) -> tuple[str, bool]:
        return self._name, self._create

    def __reduce__(self):
        return Volume, (self._name, self._create)

    def __repr__(self) -> str:
        return f"modal.Volume.from_name({self._name!r})"


def _refuse_open_files(mount: str) -> None:
    """What the service does on reload: refuse while any process of the container holds a file of the
    Volume open, by a descriptor or a memory mapping (safetensors maps what it loads) (modal/volume.py:
    "there are open files preventing the operation"; its `_open_files_error_annotation` scans /proc the
    same way to name one)."""
    prefix = mount.rstrip("/") + "/"
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        held: list[str] = []
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
            with open(f"/proc/{pid}/maps") as maps:
                held += [line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6]
        except OSError:
            continue
        for target in held:
            if target.startswith(prefix):
                raise RuntimeError(f"Volume reload failed: there are open files preventing the operation: "
                                   f"path {target} is open in process {pid}")


class _BatchUpload:
    """`Volume.batch_upload()`: files go straight to the committed Volume when the block ends
    (allowed from anywhere; an existing file is an error unless force=True)."""

    def __init__(self, name: str, force: bool, create: bool = False):
        self._name, self._force, self._create, self._files = name, force, create, []

    def __enter__(self) -> _BatchUpload:
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            call("volume_put", self._name, self._files, self._force, self._create)

    def put_file(self, local_file: Any, remote_path: Any, mode: int | None = None) -> None:
        data = local_file.read() if isinstance(local_file, io.IOBase) else Path(local_file).read_bytes()
        self._files.append((str(remote_path), data))

    def put_directory(self, local_path: Any, remote_path: Any, recursive: bool = True) -> None:
        base = Path(local_path)
        for path in sorted(base.rglob("*") if recursive else base.glob("*")):
            if path.is_file():
                self._files.append((str(PurePosixPath(remote_path) / path.relative_to(base).as_posix()),
                                    path.read_bytes()))


# -- dicts --------------------------------------------------------------------------------------------


class Dict:
    """A named `modal.Dict` (modal/dict.py): keys and values cross as pickles; hydrated on first use."""

    def __init__(self, name: str, create: bool):
        self._name, self._create, self._opened = name, create, False

    @staticmethod
    def from_name(name: str, *, environment_name: str | None = None, create_if_missing: bool = False,
                  client: Any = None) -> Dict:
        return Dict(name, create_if_missing)

    def _open(self) -> str:
        if not self._opened:
            call("dict_open", self._name, self._create)
            self._opened = True
        return self._name

    def _get(self, key: Any, default: Any | None = None) -> Any:
        found, value = call("dict_get", self._open(), dumps(key))
        return loads(value) if found else default

    def _contains(self, key: Any) -> bool:
        return call("dict_get", self._open(), dumps(key))[0]

    def _put(self, key: Any, value: Any, *, skip_if_exists: bool = False) -> bool:
        return call("dict_put", self._open(), dumps(key), dumps(value), skip_if_exists)

    def _pop(self, key: Any, default: Any = _MISSING) -> Any:
        found, value = call("dict_pop", self._open(), dumps(key))
        if found:
            return loads(value)
        if default is _MISSING:
            raise KeyError(f"{key} not in dict {self._name}")
        return default

    get = Dual(_get)
    contains = Dual(_contains)
    put = Dual(_put)
    pop = Dual(_pop)

    def __getitem__(self, key: Any) -> Any:
        found, value = call("dict_get", self._open(), dumps(key))
        if not found:
            raise KeyError(f"{key} not in dict {self._name}")
        return loads(value)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._put(key, value)

    def __contains__(self, key: Any) -> bool:
        return self._contains(key)

    def __reduce__(self):
        return Dict, (self._name, self._create)

    def __repr__(self) -> str:
        return f"modal.Dict.from_name({self._name!r})"


# -- apps, functions, classes -------------------------------------------------------------------------


def _require_token() -> None:
    from modal.config import config

    if container_id() is not None:
        return
    if not (config.get("token_id") and config.get("token_secret")):
        raise exception.AuthError("Token missing. Could not authenticate client. If you have token credentials, "
                                  "see modal.com/docs/reference/modal.config for setup help.")
    call("auth", config.get("token_id"), config.get("token_secret"))  # the server's ClientHello (modal/client.py)


class App:
    def __init__(self, name: str | None = None, *, tags: dict | None = None, image: Image | None = None,
                 secrets: list = [], volumes: dict = {}, include_source: bool | None = None):  # noqa: B006
        self.name, self._image = name, image
        self._app_id = call("app_create", name)
        self._running = False
        self._known = False  # run or looked up: its id is public (modal/app.py `app_id`)
        self._pending: list[tuple[Any, dict]] = []  # (Function or Cls, options) to send at run()

    @property
    def app_id(self) -> str | None:
        """The app's id once it runs or was looked up (modal/app.py); None before."""
        return self._app_id if self._known else None

    @staticmethod
    def lookup(name: str, *, client: Any = None, environment_name: str | None = None,
               create_if_missing: bool = False) -> App:
        """modal/app.py `lookup`: by an app id (`ap-...`) any app, ephemeral or stopped, is found."""
        if not name.startswith("ap-"):
            raise InvalidError("the emulator looks up apps by id (ap-...) only")
        if create_if_missing:
            raise InvalidError("`create_if_missing=True` is not supported when looking up an App by ID.")
        app = App.__new__(App)
        app.name, app._image, app._running, app._pending = None, None, False, []
        app._app_id, app._known = call("app_lookup", name), True
        return app

    def _stop(self) -> None:
        """modal/app.py `stop`: "terminates all of its running containers and sandboxes and prevents new
        inputs from being processed"."""
        call("app_stop", self._app_id)

    stop = Dual(_stop)

    def function(self, _warn_parentheses_missing: Any = None, **options: Any):
        _check_names("App.function", options, FUNCTION_OPTIONS)

        options = {**options, "image": options.get("image") or self._image or Image.debian_slim()}

        def wrap(f):
            fn = Function(self, f.__qualname__ if options.get("name") is None else options["name"], raw_f=f)
            fn._volumes = bool(options.get("volumes"))
            self._pending.append((fn, options))
            return fn
        return wrap

    def cls(self, _warn_parentheses_missing: Any = None, **options: Any):
        _check_names("App.cls", options, CLS_OPTIONS)
        options = {**options, "image": options.get("image") or self._image or Image.debian_slim()}

        def wrap(user_cls):
            params = {k: v.default for k, v in vars(user_cls).items() if isinstance(v, _Parameter)}
            methods = [k for k, v in vars(user_cls).items() if getattr(v, "_modal_method", False)]
            c = Cls(self, user_cls.__name__, params, methods, user_cls=user_cls)
            c._volumes = bool(options.get("volumes"))
            self._pending.append((c, options))
            return c
        return wrap

    @contextlib.contextmanager
    def run(self, name: str | None = None, *, client: Any = None, detach: bool = False, interactive: bool = False,
            environment_name: str | None = None):
        """Start the app: its functions are serialized and registered now (Modal does it here, so a
        closure sees names bound after the decorator ran) and become callable."""
        _require_token()
        for obj, options in self._pending:
            obj._register(options)
        call("app_run", self._app_id)
        self._running = self._known = True
        try:
            yield self
        finally:
            self._running = False
            call("app_exit", self._app_id, detach)


def _spec(kind: str, name: str, options: dict, raw: Any, serialized: bool, client_python: str) -> dict:
    window = options.get("scaledown_window")
    if window is not None and not 2 <= window <= 3600:
        raise InvalidError("`scaledown_window` must be between 2 and 3600 (inclusive)")
    image = options["image"]  # the app's, or debian_slim with the defining client's Python
    volumes = {str(mount): v._mount_spec() for mount, v in (options.get("volumes") or {}).items()}
    return {
        "kind": kind, "name": name, "serialized": serialized, "client_python": client_python,
        "blob": dumps(raw) if serialized else None, "module": raw.__module__, "qualname": raw.__qualname__,
        "image": image._layers, "volumes": volumes, "env": dict(options.get("env") or {}),
        "secrets": [s._spec() for s in options.get("secrets") or ()],
        "retries": _retries(options.get("retries")), "max_containers": options.get("max_containers"),
        "scaledown_window": options.get("scaledown_window") or 60, "timeout": options.get("timeout") or 300,
        "min_containers": options.get("min_containers") or 0,
        "nonpreemptible": bool(options.get("nonpreemptible")), "gpu": options.get("gpu"),
    }


def _retries(value: Any) -> int:
    if value is None:
        return 0
    return int(getattr(value, "max_retries", value))


class Function:
    """A Function (or one method of a class, with the class's parameters) of a running app."""

    def __init__(self, app: App | None, name: str, raw_f: Any = None, fid: str | None = None,
                 method: str | None = None, obj: Obj | None = None):
        self._app, self._name, self._raw_f, self._fid = app, name, raw_f, fid
        self._method, self._obj = method, obj
        self._client_python = _client_python()  # the Python that defines (and Modal serializes) it

    def _register(self, options: dict) -> None:
        serialized = bool(options.get("serialized"))
        spec = _spec("function", self._name, options, self._raw_f, serialized, self._client_python)
        self._fid = call("function_create", self._app._app_id, spec)

    @property
    def object_id(self) -> str:
        return self._target()[0]

    def _target(self) -> tuple:
        if self._obj is not None:
            cls = self._obj._cls
            if cls._fid is None or (cls._app is not None and not cls._app._running):
                raise ExecutionError(_not_hydrated("Cls"))
            return cls._fid, self._method, dumps(self._obj._params)
        if self._fid is None or (self._app is not None and not self._app._running):
            raise ExecutionError(_not_hydrated("Function"))
        return self._fid, None, None

    def _spawn(self, *args: Any, **kwargs: Any) -> FunctionCall:
        target = self._target()
        return FunctionCall(call("call_start", *target, [dumps((args, kwargs))]))

    def _remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._spawn(*args, **kwargs)._get()

    spawn = Dual(_spawn)
    remote = Dual(_remote)

    def map(self, *input_iterators: Any, kwargs: dict = {}, order_outputs: bool = True,  # noqa: B006
            return_exceptions: bool = False, wrap_returned_exceptions: bool | None = None):
        """Results one per input: in input order, or as they finish (`order_outputs=False`); a failed
        input raises (or is yielded, `return_exceptions=True`). modal/parallel_map.py `_map_sync`."""
        try:
            import asyncio

            asyncio.get_running_loop()
            raise InvalidError("You can't iter(Function.map()) from an async function. "
                               "Use async for ... in Function.map.aio() instead.")
        except RuntimeError:
            pass
        target = self._target()
        blobs = [dumps((args, kwargs)) for args in zip(*input_iterators)]
        return self._map_results(call("call_start", *target, blobs), len(blobs), order_outputs, return_exceptions)

    @staticmethod
    def _map_results(fcid: str, n: int, ordered: bool, return_exceptions: bool):
        """A map's inputs keep running when its consumer stops early: modal/parallel_map.py cancels only
        its own client tasks, never the function call's inputs (they run to their end, billed)."""
        for _ in range(n):
            ok, blob = call("call_next", fcid, ordered)
            value = loads(blob)
            if ok or return_exceptions:
                yield value
            else:
                raise value

    def local(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body in this process (modal/_functions.py `local`): the caller's environment, no
        Volume (with Modal's warning), `@enter` run once per object."""
        if self._obj is not None:
            instance = self._obj._local_instance()
            if self._obj._cls._volumes and is_local():
                warnings.warn(f"The {self._name} function is executing locally and will not have access to the "
                              "mounted Volume or NetworkFileSystem data", stacklevel=2)
            return getattr(instance, self._method)(*args, **kwargs)
        if self._raw_f is None:
            raise ExecutionError("The definition for this Function is missing, so it is not possible to invoke it "
                                 "locally. If this function was retrieved via `Function.from_name`, you need to use "
                                 "one of the remote invocation methods instead.")
        if getattr(self, "_volumes", False) and is_local():
            warnings.warn(f"The {self._name} function is executing locally and will not have access to the "
                          "mounted Volume or NetworkFileSystem data", stacklevel=2)
        return self._raw_f(*args, **kwargs)

    def __reduce__(self):
        if self._obj is not None:
            return getattr, (self._obj, self._method)
        fid, _, _ = self._target()  # "Can't serialize object ... which hasn't been hydrated"
        return _function_handle, (fid, self._name)

    def __repr__(self) -> str:
        return f"Function({self._name})"


def _function_handle(fid: str, name: str) -> Function:
    return Function(None, name, fid=fid)


def _not_hydrated(kind: str) -> str:
    return f"{kind} has not been hydrated with the metadata it needs to run on Modal, because the App it is " \
           "defined on is not running."


class Cls:
    def __init__(self, app: App | None, name: str, params: dict, methods: list[str], user_cls: Any = None,
                 fid: str | None = None):
        self._app, self._name, self._params, self._methods = app, name, params, methods
        self._user_cls, self._fid = user_cls, fid
        self._volumes = False
        self._client_python = _client_python()

    def _register(self, options: dict) -> None:
        serialized = bool(options.get("serialized"))
        spec = _spec("cls", self._name, options, self._user_cls, serialized, self._client_python)
        spec.update(methods=self._methods, params=self._params)
        self._fid = call("function_create", self._app._app_id, spec)

    def __call__(self, **kwargs: Any) -> Obj:
        for key in kwargs:
            if key not in self._params:
                raise TypeError(f"{self._name}() got an unexpected keyword argument {key!r}")
        missing = [k for k, v in self._params.items() if v is _MISSING and k not in kwargs]
        if missing:
            raise TypeError(f"{self._name}() missing parameters: {', '.join(missing)}")
        return Obj(self, {**self._params, **kwargs})

    def __reduce__(self):
        if self._fid is None or (self._app is not None and not self._app._running):
            raise InvalidError(f"Can't serialize object {self._name} which hasn't been hydrated.")
        return Cls, (None, self._name, self._params, self._methods, None, self._fid)


class Obj:
    def __init__(self, cls: Cls, params: dict):
        self._cls, self._params = cls, params
        self._instance = None

    def __getattr__(self, name: str) -> Function:
        if name.startswith("_") or name not in self._cls._methods:
            raise AttributeError(name)
        return Function(self._cls._app, f"{self._cls._name}.{name}", method=name, obj=self)

    def _local_instance(self) -> Any:
        if self._cls._user_cls is None:
            raise ExecutionError("The definition for this Function is missing, so it is not possible to invoke it "
                                 "locally.")
        if self._instance is None:
            self._instance = _instantiate(self._cls._user_cls, self._params)
        return self._instance

    def __reduce__(self):
        return Obj, (self._cls, self._params)


def _instantiate(user_cls: Any, params: dict) -> Any:
    """A user class instance as Modal makes one: parameters set, `@enter` methods run once."""
    instance = user_cls.__new__(user_cls)
    for key, value in params.items():
        setattr(instance, key, value)
    for name, attr in vars(user_cls).items():
        if getattr(attr, "_modal_enter", False):
            getattr(instance, name)()
    return instance


class FunctionCall:
    def __init__(self, object_id: str):
        self.object_id = object_id

    @staticmethod
    def from_id(function_call_id: str, client: Any = None) -> FunctionCall:
        return FunctionCall(function_call_id)

    def _get(self, timeout: float | None = None, *, index: int = 0) -> Any:
        ok, blob = call("call_get", self.object_id, timeout)
        value = loads(blob)
        if ok:
            return value
        raise value

    def _cancel(self, terminate_containers: bool = False) -> None:
        call("call_cancel", self.object_id, terminate_containers)

    get = Dual(_get)
    cancel = Dual(_cancel)

    def __reduce__(self):
        return FunctionCall, (self.object_id,)


# -- sandboxes ------------------------------------------------------------------------------------------

MAX_BUFFER_SIZE = 2 * 1024 * 1024  # modal/io_streams.py: sandbox stdin through the server


class _StreamWriter:
    """`sb.stdin` (modal/io_streams.py `_StreamWriterThroughServer`): `write` queues into a buffer of at most
    2 MiB (BufferError past it: "Buffer size exceed limit. Call drain to flush the buffer."), `drain` sends."""

    def __init__(self, sid: str):
        self._sid, self._buffer, self._closed = sid, bytearray(), False

    def write(self, data: bytes | bytearray | memoryview | str) -> None:
        if self._closed:
            raise ValueError("Stdin is closed. Cannot write to it.")
        if not isinstance(data, (bytes, bytearray, memoryview, str)):
            raise TypeError(f"data argument must be a bytes-like object, not {type(data).__name__}")
        data = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        if len(self._buffer) + len(data) > MAX_BUFFER_SIZE:
            raise BufferError("Buffer size exceed limit. Call drain to flush the buffer.")
        self._buffer.extend(data)

    def write_eof(self) -> None:
        self._closed = True

    def _drain(self) -> None:
        data, self._buffer = bytes(self._buffer), bytearray()
        call("sandbox_stdin", self._sid, data, self._closed)

    drain = Dual(_drain)


class _StreamReader:
    """`sb.stdout` / `sb.stderr` of a Sandbox (modal/io_streams.py `_StreamReaderThroughServer`, by_line=True
    as sandbox/_impl_v1.py makes them): the server's chunks of arbitrary size, joined into lines."""

    def __init__(self, sid: str, fd: int):
        self._sid, self._fd, self._stream = sid, fd, None

    async def _lines(self):
        import asyncio
        import codecs

        decoder, pending = codecs.getincrementaldecoder("utf-8")(), b""
        while True:
            chunk = await asyncio.to_thread(call, "sandbox_read", self._sid, self._fd)
            if chunk is None:
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                text = decoder.decode(line + b"\n")
                if text:
                    yield text
        tail = decoder.decode(pending, final=True)
        if tail:
            yield tail

    def __aiter__(self):
        if self._stream is None:
            self._stream = self._lines()
        return self._stream

    async def __anext__(self) -> str:
        return await self.__aiter__().__anext__()

    def _read(self) -> str:
        out = []
        while (chunk := call("sandbox_read", self._sid, self._fd)) is not None:
            out.append(chunk)
        return b"".join(out).decode()

    read = Dual(_read)


class Sandbox:
    def __init__(self, sid: str):
        self.object_id = sid
        self._stdin, self._stdout, self._stderr = _StreamWriter(sid), _StreamReader(sid, 1), _StreamReader(sid, 2)
        self.returncode: int | None = None

    def _create(*args: str, app: App | None = None, name: str | None = None, tags: dict | None = None,
                image: Image | None = None, env: dict | None = None, secrets: Any = None,
                network_file_systems: dict = {}, timeout: int | None = 300, idle_timeout: int | None = None,  # noqa: B006
                workdir: str | None = None, gpu: str | None = None, cloud: str | None = None, region: Any = None,
                cpu: Any = None, memory: Any = None, runtime: Any = None, block_network: bool = False,
                volumes: dict = {}, **options: Any) -> Sandbox:  # noqa: B006
        _check_names("Sandbox.create", options, SANDBOX_OPTIONS)
        if app is None and container_id() is None:
            raise InvalidError("Sandboxes require an App when created outside of a Modal container")
        if app is not None and not app._running:
            raise ExecutionError(_not_hydrated("App"))
        spec = {"args": list(args), "image": (image or Image.debian_slim())._layers, "env": dict(env or {}),
                "secrets": [s._spec() for s in secrets or ()], "timeout": timeout, "workdir": workdir,
                "block_network": block_network, "volumes": {str(m): v._mount_spec() for m, v in volumes.items()},
                "idle_timeout": idle_timeout}
        return Sandbox(call("sandbox_create", spec))

    create = Dual(_create, static=True)

    @property
    def stdin(self) -> _StreamWriter:
        return self._stdin

    @property
    def stdout(self) -> _StreamReader:
        return self._stdout

    @property
    def stderr(self) -> _StreamReader:
        return self._stderr

    def _poll(self) -> int | None:
        self.returncode = call("sandbox_poll", self.object_id, 0)
        return self.returncode

    def _wait(self, raise_on_termination: bool = True) -> None:
        self.returncode = call("sandbox_poll", self.object_id, None)

    def _terminate(self, *, wait: bool = False) -> int | None:
        call("sandbox_terminate", self.object_id)
        return self._poll() if wait else None

    poll = Dual(_poll)
    wait = Dual(_wait)
    terminate = Dual(_terminate)


SANDBOX_OPTIONS = frozenset((
    "outbound_cidr_allowlist outbound_domain_allowlist _experimental_outbound_policy inbound_cidr_allowlist pty "
    "encrypted_ports h2_ports unencrypted_ports custom_domain proxy include_oidc_identity_token readiness_probe "
    "verbose experimental_options _experimental_enable_snapshot _experimental_persistent client environment_name "
    "pty_info cidr_allowlist").split())
