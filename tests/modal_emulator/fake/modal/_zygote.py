"""The fork server of emulated containers (tests/modal_emulator/zygote.py starts it): not part of modal's client.

It runs as `python -m modal._zygote CTL PRELOAD` inside a bubblewrap container of one image, with the
environment a container of one function gets (less its ids), the same argv prefix, the same /root
working directory, so `sys.path` is the one `python -m modal._container` has. It imports the modules a
fresh container of that function had imported (PRELOAD: the names, in import order, that container
reported), then forks one container per request on CTL (a SOCK_SEQPACKET socket):

- the fork (the outer process, which the service sees: bwrap's outer process) takes a mount namespace
  and a PID namespace of its own (and a user namespace where this process holds no CAP_SYS_ADMIN, as
  unprivileged bwrap makes one), binds the service's socket folder, its gVisor folder and the
  container's Volume views over the mount points made for them, and hides this machine's root, which
  the zygote holds at /opt/emu/host only for those binds;
- its child is PID 1 of the new namespace (bwrap's init: it mounts a fresh /proc and reaps), and that
  one's child (PID 2, as under bwrap, in PID 1's new session) runs the container: the request's stdio, exactly the
  request's environment and working directory, `modal._container` run as `__main__` (runpy, as `-m`
  does), the interpreter's exit handlers at its end.

A module the zygote imported for itself that the fresh container had not imported is dropped from
`sys.modules` in the child. No thread of Python may run here before a fork: the zygote refuses to serve
("unsafe") if one does, or if torch has initialised CUDA.
"""

import sys

_START = set(sys.modules)  # what the interpreter (and `-m modal._zygote`'s package import) loaded

import ctypes  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

HOST = "/opt/emu/host"  # this machine's root, for the binds (hidden in every container)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x20000, 0x10000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
CAP_SYS_ADMIN = 21
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, None), f"mount {source} on {target}")


def _caps() -> dict[str, int]:
    caps = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Cap"):
                key, value = line.split(":")
                caps[key] = int(value, 16)
    return caps


def _exit_code(status: int) -> int:
    """A waited child's status as bwrap's outer process passes it on."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _drop_caps(caps: dict[str, int]) -> None:
    """The capabilities this zygote has (bwrap's), not the full set a new user namespace gives."""
    for cap in range(64):
        if not caps["CapBnd"] >> cap & 1 and cap <= 40:
            _libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; unknown caps fail harmlessly

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    data = (Data * 2)()
    for i in range(2):
        data[i].effective = caps["CapEff"] >> (32 * i) & 0xFFFFFFFF
        data[i].permitted = caps["CapPrm"] >> (32 * i) & 0xFFFFFFFF
        data[i].inheritable = caps["CapInh"] >> (32 * i) & 0xFFFFFFFF
    _check(_libc.capset(ctypes.byref(Header(0x20080522, 0)), data), "capset")


def _outer(spec: dict, fds: list[int], caps: dict[str, int], zygote: int) -> None:
    """The forked container's outer process: namespaces, binds, then PID 1 (`_init`); waits for it."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    if os.getppid() != zygote:
        os._exit(1)
    privileged = bool(caps["CapEff"] >> CAP_SYS_ADMIN & 1)
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | (0 if privileged else CLONE_NEWUSER)), "unshare")
    if not privileged:  # unprivileged bwrap's mapping: this uid and gid only
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for source, target, readonly in spec["binds"]:
        _mount(HOST + source, target, None, MS_BIND | MS_REC)
        if readonly:
            flags = os.statvfs(target).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
            _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)
    if privileged:  # gone (its empty folder stays: removing it would take it from the zygote too)
        _check(_libc.umount2(HOST.encode(), MNT_DETACH), "umount")
    else:  # mounts a user namespace inherits are locked: covered instead
        _mount("tmpfs", HOST, "tmpfs", MS_RDONLY)
    pid = os.fork()
    if pid == 0:
        _init(spec, fds, caps, privileged)
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    os._exit(_exit_code(status))


def _init(spec: dict, fds: list[int], caps: dict[str, int], privileged: bool) -> None:
    """PID 1 of the container's namespace (bwrap's): a fresh /proc, the container as its child, reaping."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.setsid()  # bwrap's --new-session: the container is in PID 1's session
    pid = os.fork()
    if pid == 0:
        _container(spec, fds, caps, privileged)
    for fd in fds:
        os.close(fd)
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if done == pid:
            os._exit(_exit_code(status))


def _container(spec: dict, fds: list[int], caps: dict[str, int], privileged: bool) -> None:
    """The container's own process: what `python -m modal._container` would be, with the imports done."""
    code = 1
    try:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
        if not privileged:
            _drop_caps(caps)
        null = os.open("/dev/null", os.O_RDWR)
        os.dup2(null, 0)
        for target, fd in zip((1, 2), (fds[0], fds[1] if len(fds) > 1 else fds[0])):
            os.dup2(fd, target)
        for fd in {null, *fds}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(spec["env"])
        os.chdir(spec["cwd"])
        os.environ["PWD"] = spec["cwd"]  # what a fresh container's `init` shell exports
        del sys.argv[1:]  # runpy sets argv[0]; `-m modal._container` has no arguments
        for name in spec["drop"]:
            sys.modules.pop(name, None)
        if "numpy.random" in sys.modules:  # a fresh interpreter seeds numpy's global generator from the OS
            sys.modules["numpy.random"].seed()
        import runpy

        try:
            runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
            traceback.print_exc()
            code = 1
        threading._shutdown()  # non-daemon threads, as at a normal interpreter exit
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def main() -> None:
    ctl = socket.socket(fileno=int(sys.argv[1]))
    with open(sys.argv[2]) as f:
        names = f.read().split()
    failed = 0
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a module that only exists after a call (torch.ops.*, a pickle's)
            failed += 1
    problem = None
    if threading.active_count() != 1:
        problem = f"threads of Python run after the imports: {threading.enumerate()}"
    elif "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        problem = "torch initialised CUDA"
    keep = _START | set(names)
    drop = sorted(set(sys.modules) - keep)  # the zygote's own imports, which the fresh container did not have
    caps = _caps()
    me = os.getpid()
    ctl.send(pickle.dumps(("ready", me, {"preloaded": len(names), "failed": failed, "dropped": len(drop),
                                          "problem": problem})))
    if problem:
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready, _, _ = select.select([ctl, wake_r], [], [])
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                ctl.send(pickle.dumps(("exit", pid, status)))
        if ctl in ready:
            msg, fds, _flags, _addr = socket.recv_fds(ctl, 1 << 20, 4)
            if not msg:  # the service's process is gone
                return
            spec = pickle.loads(msg)
            spec["drop"] = drop
            pid = os.fork()
            if pid == 0:
                try:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    ctl.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    _outer(spec, fds, caps, me)
                except BaseException:  # noqa: BLE001
                    traceback.print_exc()
                os._exit(127)
            for fd in fds:
                os.close(fd)
            ctl.send(pickle.dumps(("forked", spec["id"], pid)))


if __name__ == "__main__":
    main()
