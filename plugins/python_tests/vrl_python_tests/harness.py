"""The fork server that runs inside the sandbox, and the typed value encoding both sides share.

This file is executed by a stand-alone interpreter inside bubblewrap (`python3 -I -S -c <this file>`),
so it imports nothing but the standard library. It never sees expected outputs, and the server
process never sees the attempt's code or inputs either: each attempt's child reads its payload from
a pipe after the fork, so a later attempt forked from the server cannot find an earlier one's data in
memory. The server's only jobs are to fork a child on command, report when it exits, and, on
command, kill everything else in the sandbox and wipe its scratch space.

Channels (pipes set up by the host; the numbers of the last three are in the config):
  stdin    commands from the host, one JSON object per line ({"op": "spawn", "start": k} or {"op": "kill"})
  stdout   replies to the host, one JSON object per line (hello, exited, cleaned)
  results  the child writes JSON lines here (ready, import, one line per test)
  output   the child's stdout and stderr (the host keeps the first few KB)
  payload  after "ready", the host writes the attempt (8-byte length + JSON) for the child

The host, not this process, keeps time, decodes results and compares them with expected values.
"""

from __future__ import annotations

import base64
import collections
import enum
import errno
import json
import math
import os
import resource
import select
import signal
import sys

MAX_NODES = 200_000  # values with more nodes than this are not worth comparing
# Nesting levels of a value. Python's own `==` on nested lists recurses once per level and stops at
# the recursion limit (1000 by default, less the caller's depth); each level costs this channel two
# levels of JSON and one frame of `decode`, so 300 leaves the host room under that limit.
MAX_DEPTH = 300
MAX_INT_DIGITS = 4300  # Python's default int/str conversion limit, enforced here whatever the interpreter's
_MAX_INT_BITS = int(MAX_INT_DIGITS * 3.3219280948873626) + 1
MAX_SAME_HASH = 32  # elements of one set or dict that may share a hash value
_SCALARS = (type(None), bool, int, str)


class EncodeError(ValueError):
    """A value outside the plain data types that cross the channel."""


# The stdlib classes whose comparisons with plain data are the plain type's, converted before encoding
# so that an answer Python's assert accepts is not refused. Bound here, before any attempt runs.
_AS_DICT = (collections.Counter, collections.OrderedDict, collections.defaultdict)
_INT_ENUMS = (enum.IntEnum, enum.IntFlag)
# What `==`, `sorted`, `set`, truthiness and iteration of a tuple or an int use: a namedtuple or an
# int enum passes as the plain value only when its class changes none of them.
_TUPLE_METHODS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__len__",
                  "__iter__", "__getitem__", "__contains__", "__bool__")
_INT_METHODS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__",
                "__index__", "__int__", "__float__", "__abs__", "__sub__", "__rsub__", "__neg__")


def _is_namedtuple(kind):
    """A class made by `collections.namedtuple` or `typing.NamedTuple`, comparing as its tuple."""
    fields = kind.__dict__.get("_fields")
    return (kind.__bases__ == (tuple,) and type(fields) is tuple and all(type(f) is str for f in fields)
            and all(getattr(kind, m, None) is getattr(tuple, m, None) for m in _TUPLE_METHODS))


def _is_int_enum(kind):
    """A subclass of IntEnum or IntFlag whose members compare, hash and count as their int value."""
    return (issubclass(kind, _INT_ENUMS)
            and all(getattr(kind, m, None) is getattr(int, m, None) for m in _INT_METHODS))


def plain(value):
    """`value` as the plain built-in value it compares as, for the stdlib classes that have one:
    Counter, OrderedDict and defaultdict become a dict, a namedtuple a tuple, an IntEnum or IntFlag
    member an int. Anything else is returned as it is (and `encode` refuses it unless plain).

    Python compares a Counter with a dict, a namedtuple with a tuple and an IntEnum member with an int
    exactly as the plain values, so the assert's verdict does not change; a user subclass, whose
    comparisons may be anything, is not converted.
    """
    kind = type(value)
    if kind in _AS_DICT:
        return dict(dict.items(value))  # dict's own items: no __missing__, no overridden iteration
    if issubclass(kind, tuple) and kind is not tuple and _is_namedtuple(kind):
        return tuple(tuple.__iter__(value))
    if issubclass(kind, int) and kind is not bool and kind is not int and _is_int_enum(kind):
        return int.__int__(value)
    return value


def encode(value, _budget=None, _depth=0):
    """Encode a plain Python value as JSON-ready data; every container is tagged so types survive.

    Exact types only, after `plain` (a subclass of int or an object with a custom __eq__ is refused),
    so what the host decodes is data, never an object the attempt controls.
    """
    budget = _budget if _budget is not None else [MAX_NODES]
    budget[0] -= 1
    if budget[0] < 0:
        raise EncodeError(f"value has more than {MAX_NODES} parts")
    if _depth > MAX_DEPTH:
        raise EncodeError(f"value is nested deeper than {MAX_DEPTH} levels")
    value = plain(value)
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    depth = _depth + 1
    if kind is list or kind is tuple:
        items = []
        for v in value:  # a loop, not a comprehension: one frame per level of nesting
            items.append(encode(v, budget, depth))
        return {kind.__name__: items}
    if kind is set or kind is frozenset:
        items = []
        for v in value:
            items.append(encode(v, budget, depth))
        items.sort(key=lambda v: json.dumps(v, sort_keys=True))  # stable text for equal sets
        return {kind.__name__: items}
    if kind is dict:
        pairs = []
        for k, v in value.items():
            pairs.append([encode(k, budget, depth), encode(v, budget, depth)])
        return {"dict": pairs}
    if kind is bytes:
        return {"bytes": base64.b64encode(value).decode("ascii")}
    if kind is complex:
        return {"complex": [encode(value.real, budget, depth), encode(value.imag, budget, depth)]}
    raise EncodeError(f"cannot return a {kind.__name__}: only None, bool, int, float, complex, str, bytes, "
                      "list, tuple, set, frozenset and dict cross the sandbox (Counter, OrderedDict, "
                      "defaultdict, namedtuples and IntEnum/IntFlag members as the dict, tuple or int they "
                      "compare as)")


class DecodeError(ValueError):
    """Data that `encode` cannot have produced, or that is too costly to rebuild."""


def decode(data, _budget=None, _depth=0):
    """Inverse of `encode`; raises DecodeError on anything `encode` cannot have produced.

    The host decodes what an attempt sent, holding the GIL and outside every timeout, so the work is
    bounded: at most MAX_NODES parts, MAX_DEPTH levels, ints of MAX_INT_DIGITS digits, floats in
    complex numbers, and no more than MAX_SAME_HASH elements of one set or dict sharing a hash value
    (forged collisions would make building it quadratic).
    """
    budget = _budget if _budget is not None else [MAX_NODES]
    budget[0] -= 1
    if budget[0] < 0:
        raise DecodeError(f"value has more than {MAX_NODES} parts")
    if _depth > MAX_DEPTH:
        raise DecodeError(f"value is nested deeper than {MAX_DEPTH} levels")
    kind = type(data)
    if kind is int and data.bit_length() > _MAX_INT_BITS:
        raise DecodeError(f"int with more than {MAX_INT_DIGITS} digits")
    if kind in _SCALARS or kind is float:
        return data
    if kind is dict and len(data) == 1:
        (tag, body), = data.items()
        depth = _depth + 1
        if tag in ("list", "tuple", "set", "frozenset") and type(body) is list:
            items = []
            for v in body:  # a loop, not a comprehension: one frame per level of nesting
                items.append(decode(v, budget, depth))
            if tag in ("set", "frozenset"):
                check_hashes(items)
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        if tag == "dict" and type(body) is list:
            pairs = []
            for pair in body:
                if type(pair) is not list or len(pair) != 2:
                    raise DecodeError("dict entries must be [key, value] pairs")
                pairs.append((decode(pair[0], budget, depth), decode(pair[1], budget, depth)))
            check_hashes([k for k, _ in pairs])
            return dict(pairs)
        if tag == "bytes" and type(body) is str:
            try:
                return base64.b64decode(body.encode("ascii"), validate=True)
            except (ValueError, UnicodeEncodeError) as exc:
                raise DecodeError(f"bytes that are not base64 ({exc})") from None
        if tag == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "complex" and type(body) is list and len(body) == 2:
            parts = [decode(v, budget, depth) for v in body]
            # complex(int, int) raises OverflowError above 1e308: only what encode sends is accepted.
            if all(type(p) is float for p in parts):
                return complex(*parts)
            raise DecodeError("complex parts must be floats")
    raise DecodeError(f"not an encoded value: {str(data)[:80]}")


def check_hashes(items):
    """Raise DecodeError when more than MAX_SAME_HASH of `items` share a hash (or one is unhashable).

    Python's sets and dicts slow down to quadratic time when many keys have one hash value, and ints
    (value mod 2**61 - 1), floats and tuples of them are easy to forge that way.
    """
    counts = {}
    for item in items:
        try:
            h = hash(item)
        except TypeError as exc:
            raise DecodeError(f"unhashable element in a set or dict ({exc})") from None
        n = counts.get(h, 0) + 1
        if n > MAX_SAME_HASH:
            raise DecodeError(f"more than {MAX_SAME_HASH} elements of a set or dict share one hash value")
        counts[h] = n


def parse_int(text):
    """`json.loads(..., parse_int=parse_int)`: ints of at most MAX_INT_DIGITS digits, whatever the
    interpreter's own limit (converting a long decimal string is quadratic)."""
    if len(text) > MAX_INT_DIGITS + 1:
        raise DecodeError(f"int with more than {MAX_INT_DIGITS} digits")
    return int(text)


# --------------------------------------------------------------------------------------------------
# The child: runs one attempt's tests and reports each result on the results pipe.
# --------------------------------------------------------------------------------------------------

def _send(fd, obj):
    data = (json.dumps(obj, allow_nan=False) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError("payload pipe closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _describe(exc):
    try:
        text = f"{type(exc).__name__}: {exc}"
    except BaseException:  # noqa: BLE001 - a hostile __str__ must not hide the failure
        text = type(exc).__name__
    return text[:500]


def _child(config, start):
    """Set limits, take the payload, import the attempt, run tests start..n-1, report, exit."""
    os.setsid()
    fds = config["fds"]
    results_fd, payload_fd = fds["results"], fds["payload"]
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds["output"], 1)
    os.dup2(fds["output"], 2)
    # Only the result and payload pipes stay open: the host's command channel is gone from here on.
    keep = sorted((results_fd, payload_fd))
    os.closerange(3, keep[0])
    os.closerange(keep[0] + 1, keep[1])
    os.closerange(keep[1] + 1, 1 << 16)
    os.chdir(config["workdir"])
    signal.set_wakeup_fd(-1)  # the server's SIGCHLD pipe (closed above) is not the attempt's
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an over-large file write fails instead of killing
    limits = config["limits"]
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    send = _send  # bound before the attempt runs; what it patches later can only garble its own reply
    send(results_fd, {"ready": True})
    size = int.from_bytes(_read_exact(payload_fd, 8), "big")
    payload = json.loads(_read_exact(payload_fd, size))
    os.close(payload_fd)
    entry = payload["entry_point"]
    tests = payload["tests"]
    del payload["tests"]
    namespace = {"__name__": "candidate", "__builtins__": __builtins__}
    try:
        code = compile(payload.pop("code"), "<attempt>", "exec")
    except (SyntaxError, ValueError) as exc:
        send(results_fd, {"import": "syntax", "error": _describe(exc)})
        os._exit(0)
    try:
        exec(code, namespace)  # noqa: S102 - running the attempt is the point; this is the sandbox
        fn = namespace.get(entry)
        if not callable(fn):
            raise NameError(f"the code defines no function named {entry!r}")
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are failures too
        send(results_fd, {"import": "error", "error": _describe(exc)})
        os._exit(0)
    send(results_fd, {"import": "ok"})
    for index in range(start, len(tests)):
        test = tests[index]
        try:
            args = decode(test["args"])
            kwargs = decode(test["kwargs"])
            value = fn(*args, **kwargs)
            message = {"i": index, "value": encode(value)}
        except BaseException as exc:  # noqa: BLE001 - whatever the attempt raises is its test's result
            message = {"i": index, "error": _describe(exc)}
        try:
            send(results_fd, message)
        except (ValueError, TypeError, RecursionError) as exc:  # e.g. an int too long for JSON
            send(results_fd, {"i": index, "error": _describe(exc)})
    os._exit(0)


# --------------------------------------------------------------------------------------------------
# The server: fork on command, report exits, clean up on command.
# --------------------------------------------------------------------------------------------------

def _non_dumpable():
    """Forbid ptrace and /proc/<pid>/{mem,fd,environ} access to this process by the attempt."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (ImportError, OSError, AttributeError):  # no ctypes or no prctl: not Linux, nothing to harden
        pass


def _wipe(path):
    """Remove everything below `path`; False if something could not be removed."""
    ok = True
    try:
        entries = os.listdir(path)
    except OSError:
        return False
    for name in entries:
        full = os.path.join(path, name)
        try:
            if os.path.isdir(full) and not os.path.islink(full):
                os.chmod(full, 0o700)
                ok = _wipe(full) and ok
                os.rmdir(full)
            else:
                os.unlink(full)
        except OSError:
            ok = False
    return ok


def _reply(obj):
    _send(1, obj)


def _sigchld_pipe():
    """The read end of a non-blocking pipe that every SIGCHLD writes a byte to (`signal.set_wakeup_fd`): how the
    server learns that its attempt exited where the kernel has no pidfd_open (gVisor before 2024's releases
    with it: `os.pidfd_open` raises ENOSYS there, which used to end the server after every attempt)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # a Python handler: the wakeup byte is written
    return r


def _drain(fd):
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def serve(config):
    """Answer host commands until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as pid 1, signals without a handler are dropped
    _non_dumpable()
    for name in config.get("preload", []):
        try:
            __import__(name)
        except ImportError:  # an older interpreter without it: attempts import it themselves
            pass
    is_init = os.getpid() == 1
    _reply({"op": "hello", "python": sys.version.split()[0], "init": is_init})
    buffer = b""
    child = pidfd = None
    use_pidfd = config.get("pidfd", True)  # False: the SIGCHLD pipe, as where pidfd_open is missing (tests)
    sigchld = None  # the read end of _sigchld_pipe, once needed
    waiting = False  # the SIGCHLD pipe is watched for the attempt's exit
    while True:
        watch = [0] + ([pidfd] if pidfd is not None else []) + ([sigchld] if waiting else [])
        ready, _, _ = select.select(watch, [], [])
        status = None
        if pidfd is not None and pidfd in ready:
            _, status = os.waitpid(child, 0)
            os.close(pidfd)
            pidfd = None
        elif waiting and sigchld in ready:
            _drain(sigchld)
            done, status = os.waitpid(child, os.WNOHANG)
            waiting = not done
            status = status if done else None
        if status is not None:
            _reply({"op": "exited", "status": _status_text(status)})
        if 0 not in ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            break
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            command = json.loads(line)
            if command["op"] == "spawn":
                child = os.fork()
                if child == 0:
                    try:
                        _child(config, int(command["start"]))
                    finally:
                        os._exit(70)
                if use_pidfd:
                    try:
                        pidfd = os.pidfd_open(child)
                    except OSError as exc:  # ENOSYS: gVisor without pidfd_open (release 20240729 has none)
                        if exc.errno != errno.ENOSYS:
                            raise
                        use_pidfd = False
                if not use_pidfd:
                    sigchld = sigchld if sigchld is not None else _sigchld_pipe()
                    waiting = True
                    os.kill(os.getpid(), signal.SIGCHLD)  # an attempt that exited before the handler still counts
            elif command["op"] == "kill":
                if pidfd is not None:
                    os.close(pidfd)
                    pidfd = None
                waiting = False
                _kill_all(child, is_init)
                child = None
                clean = all([_wipe(d) for d in config["scratch"]])  # noqa: C419 - wipe every directory, no short-circuit
                _reply({"op": "cleaned", "clean": clean})


def _kill_all(child, is_init):
    """Kill the attempt and everything it started, then reap."""
    if is_init:
        # As pid 1 of the sandbox's pid namespace, kill(-1) reaches every other process in it,
        # including daemons that left the child's session.
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    elif child is not None:
        try:
            os.killpg(child, signal.SIGKILL)  # unsafe-local mode: the child's session only
        except (ProcessLookupError, PermissionError):
            pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break


def _status_text(status):
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by signal {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exited with code {os.WEXITSTATUS(status)}"


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
