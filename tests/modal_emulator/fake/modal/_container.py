"""The program of one emulated function container: `python -m modal._container` in the image's filesystem.

Boots as modal/_runtime/user_code_imports.py does: deserialize the function (or class) the client
serialized, build the class instance with its parameters and run its `@enter` methods once, then take
inputs until the service says stop. SIGINT (the service's preemption signal, as Modal sends one:
modal.com/docs/guide/preemption) ends the container; on a graceful end the container's Volume changes
are committed (step "8. Volume commit" of user_code_imports.py). A hard kill commits nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from modal import _emu
from modal._emu import call, dumps, loads
from modal.exception import DeserializationError, SerializationError

_stopping = threading.Event()
_busy = threading.Event()  # set while user code runs: only then does an interrupt raise in it


def _load(boot: dict):
    """The function or class, as modal/_serialization.py `deserialize` reports a failure."""
    if boot["image_python"] and boot["client_python"] != boot["image_python"]:
        # cloudpickle's function format differs between minor versions: Modal's own message for it.
        raise DeserializationError(
            "Deserialization failed due to a version mismatch between local and remote environments. Try changing "
            f"the Python version in your Modal image to match your local Python version. (pickled by Python "
            f"{boot['client_python']}, the image has Python {boot['image_python']})")
    try:
        if boot["serialized"]:
            return loads(boot["blob"])
        import importlib

        target = importlib.import_module(boot["module"])
        for part in boot["qualname"].split("."):
            target = getattr(target, part)
        return target
    except ModuleNotFoundError as exc:
        raise DeserializationError(f"Deserialization failed because the '{exc.name}' module is not available in "
                                   "the remote environment.") from exc
    except AttributeError as exc:
        raise DeserializationError(f"Deserialization failed with an AttributeError, {exc}. This is probably because "
                                   "you have different versions of a library in your local and remote "
                                   "environments.") from exc


def _control(cid: str) -> None:
    """Wait for the service's signals on a second connection (preemption, cancellation)."""
    try:
        while True:
            what = call("container_control", cid)
            if what == "interrupt":
                _stopping.set()
                if _busy.is_set():
                    os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - the service is gone: so is this container
        os._exit(1)


def _result(ok: bool, value) -> tuple[bool, bytes]:
    try:
        return ok, dumps(value)
    except Exception as exc:  # noqa: BLE001
        what = "result" if ok else "exception"
        return False, dumps(SerializationError(f"Failed to serialize {what} {value!r} of type {type(value)}: {exc}"))


def main() -> int:
    cid = os.environ[_emu.CONTAINER]
    if "/root" not in sys.path:  # add_local_python_source: "/root ... is on the PYTHONPATH of any executed Modal Functions"
        sys.path.insert(0, "/root")
    boot = call("container_boot", cid)
    threading.Thread(target=_control, args=(cid,), daemon=True).start()
    code = 0
    try:
        try:
            _busy.set()
            target = _load(boot)
            if boot["kind"] == "cls":
                from modal import _instantiate

                target = _instantiate(target, loads(boot["params"]))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a start-up crash is reported to the caller
            _busy.clear()
            call("container_failed", cid, _result(False, exc)[1])
            return 1
        _busy.clear()
        call("container_ready", cid)
        while not _stopping.is_set():
            item = call("container_next", cid)
            if item is None:  # scaled down, app stopped
                break
            iid, method_name, blob = item
            try:
                _busy.set()
                args, kwargs = loads(blob)
                fn = getattr(target, method_name) if method_name else target
                ok, value = True, fn(*args, **kwargs)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                ok, value = False, exc
            finally:
                _busy.clear()
            call("container_output", cid, iid, *_result(ok, value))
    except KeyboardInterrupt:
        code = 130
    finally:
        _busy.clear()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one interrupt; the exit commit runs to its end
        _emu.reset()
        for _mount, (name, _create) in boot["volumes"].items():
            call("volume_commit", cid, name, False)  # the exit commit (background commits are on)
    return code


if __name__ == "__main__":
    sys.exit(main())
