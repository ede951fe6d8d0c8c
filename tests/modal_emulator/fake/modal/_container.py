"""The program of one emulated function container: `python -m modal._container` in the image's filesystem.

Boots as modal/_runtime/user_code_imports.py does: deserialize the function (or class) the client
serialized, build the class instance with its parameters and run its `@enter` methods once, then take
inputs until the service says stop. SIGINT (the service's preemption signal, as Modal sends one:
modal.com/docs/guide/preemption) ends the container; on a graceful end the container's Volume changes
are committed (step "8. Volume commit" of user_code_imports.py). A hard kill commits nothing. A
cancelled input (`FunctionCall.cancel()`) raises InputCancellation in its user code, from a SIGUSR1
handler as modal/_container_entrypoint.py installs one for sync functions, and the container goes on.
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
_current: list[str] = []  # the input whose user code runs now
_cancel: list[str] = []  # the input a cancellation names
_reported: set[str] = set()  # modules already reported to the service


def _cancelled(signum, frame):
    # modal/_container_entrypoint.py: a sync function's cancelled input gets SIGUSR1, whose handler raises
    # InputCancellation in the user code (wherever it is: a finally block, a C call's return); the
    # container then takes its next input. A signal that comes after that input's code ended does nothing.
    from modal.exception import InputCancellation

    if _busy.is_set() and _current and _cancel == _current:
        _cancel.clear()
        raise InputCancellation("Input was cancelled by user")


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
            elif what.startswith("cancel:"):
                _cancel[:] = [what.removeprefix("cancel:")]
                if _busy.is_set() and _current == _cancel:
                    os.kill(os.getpid(), signal.SIGUSR1)
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
    signal.signal(signal.SIGUSR1, _cancelled)
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
            loaded = [name for name in sys.modules if name not in _reported]  # what a zygote imports ahead
            _reported.update(loaded)
            item = call("container_next", cid, loaded)
            if item is None:  # scaled down, app stopped
                break
            iid, method_name, blob = item
            try:
                try:
                    _current[:] = [iid]
                    _busy.set()
                    args, kwargs = loads(blob)
                    fn = getattr(target, method_name) if method_name else target
                    ok, value = True, fn(*args, **kwargs)
                finally:
                    _busy.clear()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - the caller gets it (a cancelled one: nobody)
                ok, value = False, exc
            finally:
                _busy.clear()  # also when a cancellation landed in the block above before it cleared
                _current.clear()
                _cancel.clear()
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
