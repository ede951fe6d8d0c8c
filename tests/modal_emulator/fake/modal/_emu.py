"""The fake client's wire to the emulated Modal service (tests/modal_emulator/service.py).

Every call is one request on a per-thread connection to the service's socket; the client process and
every container process use the same code. Values cross as pickles, as Modal's own wire does; a value
that holds a Modal handle also goes through modal's real serializer (`_real.py`).
"""

from __future__ import annotations

import asyncio
import os
import threading
import warnings
from multiprocessing.connection import Client

import cloudpickle

ADDRESS = "VRL_MODAL_EMULATOR"  # the service's socket path
AUTHKEY = "VRL_MODAL_EMULATOR_KEY"
CONTAINER = "VRL_MODAL_EMULATOR_CONTAINER"  # set in function containers only

# modal/_serialization.py: PICKLE_PROTOCOL = 4, cloudpickle's Pickler for arguments, results and
# serialized functions.
PICKLE_PROTOCOL = 4

_local = threading.local()
_open: list = []  # every connection of this process, closed by close_all()


def container_id() -> str | None:
    """The container this process is (None: the client, or a sandbox's process)."""
    return os.environ.get(CONTAINER)


def call(op: str, *args):
    """One request to the service; its exception is raised here."""
    conn = getattr(_local, "conn", None)
    if conn is None:
        address = os.environ.get(ADDRESS)
        if not address:
            raise RuntimeError("the fake `modal` package needs the Modal emulator (tests/modal_emulator)")
        conn = _local.conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ[AUTHKEY]))
        _open.append(conn)
    try:
        conn.send((op, args))
        status, value = conn.recv()
    except BaseException:
        reset()  # the stream is out of step (an interrupt mid-request): the next call reconnects
        raise
    if status == "err":
        raise value
    return value


def reset() -> None:
    conn = getattr(_local, "conn", None)
    _local.conn = None
    if conn is not None:
        try:
            conn.close()
        except OSError:
            pass


def close_all() -> None:
    """Close every connection this process opened (the emulator is going away)."""
    while _open:
        try:
            _open.pop().close()
        except OSError:
            pass
    _local.conn = None


class _HoldsHandle(Exception):
    pass


class _Scan(cloudpickle.Pickler):
    """cloudpickle as Modal's wire uses it; stops at the first Modal handle (those go through `_real`)."""

    def __init__(self, buf):
        super().__init__(buf, protocol=PICKLE_PROTOCOL)

    def persistent_id(self, obj):
        import modal

        if isinstance(obj, (modal.Function, modal.Cls, modal.Obj, modal.Volume, modal.Dict, modal.FunctionCall,
                            modal.Sandbox)):
            raise _HoldsHandle
        return None


class _Refused:
    """A value modal's real `deserialize` refuses: loading it raises that DeserializationError (in the
    container that receives it, as on Modal)."""

    def __init__(self, message: str):
        self.message = message

    def __reduce__(self):
        return _refuse, (self.message,)


def _refuse(message: str):
    from modal.exception import DeserializationError

    raise DeserializationError(message)


def dumps(obj) -> bytes:
    """The bytes of an argument, result or serialized function. A value that holds a Modal handle is
    also put through modal's own serializer (`_real.check`): what it refuses fails as on Modal."""
    import io

    buf = io.BytesIO()
    try:
        _Scan(buf).dump(obj)
        return buf.getvalue()
    except _HoldsHandle:
        pass
    from modal import _real

    refused = _real.check(obj)  # raises what `serialize` raises, here, in the sender
    if refused is not None:
        return cloudpickle.dumps(_Refused(refused), protocol=PICKLE_PROTOCOL)
    return cloudpickle.dumps(obj, protocol=PICKLE_PROTOCOL)


def loads(data: bytes):
    return cloudpickle.loads(data)


def warn_if_blocking_in_loop(what: str) -> None:
    """Modal's blocking interfaces warn inside a running event loop (modal/_utils/async_utils.py,
    `_blocking_in_async_warning`, enabled by config `async_warnings`, default on)."""
    from modal.config import config
    from modal.exception import AsyncUsageWarning

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    if config.get("async_warnings"):
        warnings.warn(f"A blocking Modal interface is being used in an async context ({what}).\n\nThis may cause "
                      "performance issues or bugs. Consider rewriting to use Modal's async interfaces:\n"
                      "https://modal.com/docs/guide/async", AsyncUsageWarning, stacklevel=3)


class Dual:
    """A method with Modal's two faces: `obj.f(...)` blocks (and warns in an event loop), `await obj.f.aio(...)`
    does not. Works for instance methods and, with `static=True`, for static ones (`Sandbox.create`)."""

    def __init__(self, fn, static: bool = False):
        self.fn, self.static = fn, static
        self.__doc__ = fn.__doc__

    def __get__(self, obj, owner=None):
        return _Bound(self.fn, None if self.static else obj)


class _Bound:
    def __init__(self, fn, obj):
        self.fn, self.obj = fn, obj

    def _args(self, args):
        return args if self.obj is None else (self.obj, *args)

    def __call__(self, *args, **kwargs):
        warn_if_blocking_in_loop(self.fn.__qualname__)
        return self.fn(*self._args(args), **kwargs)

    async def aio(self, *args, **kwargs):
        return await asyncio.to_thread(self.fn, *self._args(args), **kwargs)
