"""Modal's own serializer on the emulator's wire: what modal 1.6.4 refuses to carry, the emulator refuses.

Every argument and result that holds a Modal handle (a Function, Cls, Obj, Volume, Dict, FunctionCall,
Sandbox) is serialized with the installed client's `modal._serialization.serialize` and deserialized
with its `deserialize`, each fake handle standing in as the hydrated handle of the real client it
emulates (same object-id prefix, the handle metadata the server gives it). So:

- an unhydrated handle (its app not running) fails to serialize (InvalidError, Modal's check);
- a class handle (`modal.Cls`, or an `Obj` built from one) serializes without its metadata (1.6.4's
  `_Cls` has no `_get_metadata`) and fails to deserialize: DeserializationError, raised where Modal
  raises it, in the container that receives the input;
- a Function, Volume, Dict, FunctionCall or Sandbox handle round-trips.

The check deserializes in the sender, right after serializing (the receiver may lack the real client),
so Modal's message names the "local environment"; the receiver raises it, as on Modal.

Deviations: the real client is imported from the developer's venv (a container's image does not have
it; Modal mounts its own client into every container). A Volume or Dict handle counts as hydrated
(Modal hydrates one on first use). Values without a handle are not put through the real serializer
(it is cloudpickle at protocol 4, as the fake wire): nothing Modal-specific applies to them.
Without the real `modal` package (not installed) the check is skipped.
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_real: Any = None  # the real client's modules: (serialization, api_pb2, impl classes), or False when absent
VENV_SITE_IN_CONTAINER = "/opt/emu/venv-site"  # images.py binds the developer venv's site-packages there


def _fake_dir() -> Path:
    return Path(__file__).resolve().parent.parent


def real() -> Any:
    """The real client's serializer and handle types, imported once beside the fake package (None: not
    installed). The fake `modal` keeps its name; the real one's submodules that the fake package lacks
    stay importable under theirs, for the serializer's own lazy imports."""
    global _real
    with _lock:
        if _real is None:
            _real = _import_real() or False
    return _real or None


def _import_real() -> Any:
    import _imp

    in_container = bool(os.environ.get("VRL_MODAL_EMULATOR_CONTAINER"))
    site = VENV_SITE_IN_CONTAINER if in_container else sysconfig.get_paths()["purelib"]
    if not (Path(site) / "modal" / "_serialization.py").is_file():
        return None
    fake_dir = _fake_dir()
    _imp.acquire_lock()  # no other thread imports while `modal` names the real package
    saved_path = list(sys.path)
    fake = {n: sys.modules.pop(n) for n in list(sys.modules) if n == "modal" or n.startswith("modal.")}
    try:
        sys.path[:] = [site] + [p for p in saved_path if p and Path(p).resolve() != fake_dir]
        importlib.invalidate_caches()
        serialization = importlib.import_module("modal._serialization")
        from modal_proto import api_pb2

        from modal._functions import _Function, _FunctionCall
        from modal.cls import _Cls
        from modal.dict import _Dict
        from modal.sandbox._sandbox import _Sandbox
        from modal.volume import _Volume

        types = {"Function": _Function, "FunctionCall": _FunctionCall, "Cls": _Cls, "Dict": _Dict,
                 "Sandbox": _Sandbox, "Volume": _Volume}
        return serialization, api_pb2, types
    finally:
        real_mods = {n: sys.modules.pop(n) for n in list(sys.modules) if n == "modal" or n.startswith("modal.")}
        sys.path[:] = saved_path
        sys.modules.update(fake)
        for name, module in real_mods.items():
            sys.modules.setdefault(name, module)
        _imp.release_lock()


def _hydrated(impl: type, object_id: str, metadata: Any) -> Any:
    return impl._new_hydrated(object_id, None, metadata)


def _unhydrated(impl: type, object_id: str, metadata: Any) -> Any:
    obj = impl._new_hydrated(object_id, None, metadata)
    obj._unhydrate()
    return obj


def to_real(obj: Any) -> Any:
    """The real client's handle that a fake one stands for; None for anything else (it pickles by value:
    a fake `Obj` then reaches its `Cls` here, as a real `Obj` does)."""
    import modal  # the fake package

    r = real()
    if r is None:
        return None
    _, pb, types = r
    if isinstance(obj, modal.Function) and obj._obj is None:
        meta = pb.FunctionHandleMetadata(function_name=obj._name, function_type=pb.Function.FUNCTION_TYPE_FUNCTION)
        try:
            fid = obj._target()[0]
        except modal.exception.ExecutionError:  # its app is not running: not hydrated
            return _unhydrated(types["Function"], "fu-unhydrated", meta)
        return _hydrated(types["Function"], _prefixed("fu", fid), meta)
    if isinstance(obj, modal.Cls):
        handle = types["Cls"].__new__(types["Cls"])
        handle._init(f"Cls({obj._name})")
        if obj._fid is not None and (obj._app is None or obj._app._running):
            handle._object_id, handle._is_hydrated = _prefixed("cs", obj._fid), True
        return handle
    if isinstance(obj, modal.Volume):
        return _hydrated(types["Volume"], _prefixed("vo", obj._name), pb.VolumeMetadata(name=obj._name))
    if isinstance(obj, modal.Dict):
        return _hydrated(types["Dict"], _prefixed("di", obj._name), pb.DictMetadata(name=obj._name))
    if isinstance(obj, modal.FunctionCall):
        return _hydrated(types["FunctionCall"], _prefixed("fc", obj.object_id), None)
    if isinstance(obj, modal.Sandbox):
        return _hydrated(types["Sandbox"], _prefixed("sb", obj.object_id), None)
    return None


def _prefixed(prefix: str, ident: str) -> str:
    """A real object id for an emulated one: the real type's prefix (the service names every function `fu-`)."""
    return f"{prefix}-{ident.split('-', 1)[-1].replace('-', '')}"


def check(obj: Any) -> str | None:
    """Put `obj` (a value holding fake handles) through modal's real serialize and deserialize.

    Raises what `serialize` raises (the sender sees it, as on Modal); returns the message of the
    DeserializationError the receiver would raise, or None when the value round-trips.
    """
    import io

    r = real()
    if r is None:
        return None
    serialization = r[0]

    class Pickler(serialization.Pickler):
        def persistent_id(self, value):
            handle = to_real(value)
            return super().persistent_id(value if handle is None else handle)

    buf = io.BytesIO()
    try:
        Pickler(buf).dump(obj)
    except serialization.InvalidError as exc:  # as the fake client's own error type
        from modal.exception import InvalidError

        raise InvalidError(str(exc)) from None
    try:
        serialization.deserialize(buf.getvalue(), None)
    except serialization.DeserializationError as exc:
        cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ is not None else ""
        return f"{exc}{cause}"
    return None
