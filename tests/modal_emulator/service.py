"""The emulated Modal service: apps, function calls, containers, Volumes and Sandboxes.

It runs in the test process (threads behind a Unix socket); the fake `modal` package talks to it from
the client and from every container. The rules it enforces, and where Modal states them:

Containers (modal.com/docs/guide/lifecycle-functions, /guide/scale, modal/_runtime/user_code_imports.py)
- each container is its own OS process, in its image's filesystem (images.py), with its own warm state
  (started fresh, or forked from a zygote of its kind that imported what a fresh one imports: zygote.py;
  VRL_MODAL_EMULATOR_FRESH=1 starts every one fresh):
  the class is built with its parameters and `@modal.enter` runs once per container; one container
  pool per function and per set of class parameters; at most `max_containers` at once; a container idle
  for `scaledown_window` seconds (2 to 3600, modal/_functions.py; 60 when unset here: Modal's default
  is the server's) stops, unless that would leave fewer than `min_containers` ("Minimum number of
  containers to keep running", modal/app.py);
- a function is sent as the client pickled it (`serialized=True`: cloudpickle, modal/_serialization.py);
  a client Python other than the image's fails to deserialize (DeserializationError, Modal's message);
  arguments and results cross as pickles: an unpicklable one fails as it does on Modal; one that holds a
  Modal handle goes through modal's own serializer (fake/modal/_real.py): an unhydrated handle is refused,
  a class handle or `Obj` fails to deserialize in the receiver (modal 1.6.4 drops a Cls's metadata).

Calls (modal/_functions.py, modal/parallel_map.py, modal.com/docs/guide/retries, /guide/preemption)
- `.map()` inputs go to containers in random order; `order_outputs=False` yields in completion order;
  an input's exception is raised (or yielded with `return_exceptions=True`); `.spawn()` returns a
  FunctionCall whose `get(timeout)` raises TimeoutError while it runs; `cancel()` drops its inputs;
- a user exception is retried up to `retries` times; a container that crashes mid-input (`kill`) gets
  its input rescheduled on another container; a preempted container (`preempt`: SIGINT, then exit) has
  its input restarted on another container *after* it is gone ("Modal will gracefully terminate the
  Function and restart it on the same input"); preemption does not count against `retries`;
  `nonpreemptible=True` functions are never preempted (and a GPU function cannot be nonpreemptible);
- `app.run()` authenticates the client first: a token the workspace does not know (`service.tokens`)
  raises AuthError, as the server's UNAUTHENTICATED answer does (modal/_grpc_client.py);
- an app that is not running has no callable functions (ExecutionError); `app.run()` ends by stopping
  the app's containers unless `detach=True` (then its calls go on); `app.run()` fails on a named Secret
  that does not exist (the tests create them: `service.secrets[name] = {...}`);
- `App.lookup("ap-...")` finds any app by id, and `App.stop()` "terminates all of its running containers
  ... and prevents new inputs from being processed" (modal/app.py): pending inputs fail, containers get
  SIGINT then a kill after the grace period (its sandboxes are not tracked: the pool ends its own);
- a `.map()` whose consumer stops early leaves its other inputs running (modal/parallel_map.py cancels
  only its own client tasks): only `FunctionCall.cancel()` stops an input. A running input it cancels
  gets InputCancellation raised in its user code, wherever that is (SIGUSR1's handler, as
  modal/_container_entrypoint.py sets it for sync functions); the container stays and takes the next one
  (with `terminate_containers=True` it is stopped instead).

Volumes (modal/volume.py `_Volume`, modal.com/docs/guide/volumes)
- a container mounts the Volume's committed state at start; it sees another's writes only after that
  writer's `commit()` and its own `reload()`; the client sees only committed state (`read_file`);
- `commit()` and `reload()` work only in a container that mounts the Volume: elsewhere RuntimeError
  ("commit() can only be called on a mounted volume inside a container", Modal's message);
- `commit()` reloads after committing and `reload()` is refused while a file of the Volume is open in
  the container, by a descriptor or a memory mapping (RuntimeError "there are open files preventing the
  operation");
- concurrent writers: per file, the last commit wins (a commit carries the files its container changed);
- a container that ends gracefully commits its changes (user_code_imports.py step 8); a killed one does not.
  Periodic background commits are not emulated (writes become visible no earlier than that).

Sandboxes (modal/sandbox/_sandbox.py, _impl_v1.py, io_streams.py)
- a sandbox is a process in its image's filesystem, env only what `env`/`secrets`/the image give,
  `workdir` (default /root), no network with `block_network`, killed after `timeout` (default 300 s),
  and after `idle_timeout` seconds without a stdin write (modal.com/docs/guide/sandbox);
- stdin: at most 2 MiB buffered between drains (BufferError, the client's check); stdout/stderr arrive
  from the server in chunks of any size, which the client joins into lines (by_line=True);
- a blocking call (`poll()`, `wait()`, `terminate()`, ...) inside a running event loop warns with
  AsyncUsageWarning (modal/_utils/async_utils.py); `.aio` variants do not.

gVisor (Modal runs containers and Sandboxes on gVisor: modal.com/docs/guide/vm-sandboxes, "rather than on top of gVisor")
- `bwrap` in a container or sandbox whose image installs bubblewrap refuses what it cannot do under gVisor
  (gvisor.py, each rule with its gVisor and bubblewrap issue): a network namespace of its own
  (`--unshare-net`, `--unshare-all` without `--share-net`) and `--disable-userns`; anything else runs
  this machine's bubblewrap. `refuse_bwrap(text)` breaks it outright (a test of how a failure reads).
  This machine's own `bwrap` (the tests', the emulator's) is untouched.

Timeouts and call identity (modal.com/docs/guide/timeouts, modal/_runtime/execution_context.py)
- an input that runs longer than its function's `timeout` (default 300 s) has its container terminated;
  the timeout is per attempt, retried up to `retries` times, then the call fails with
  FunctionTimeoutError;
- `modal.current_function_call_id()` in a container names the call of the input it runs: the same id
  when that input is restarted on another container (preemption, a crash) or retried;
- `FunctionCall.from_id(id).get(timeout=0)` raises TimeoutError while the call has unfinished inputs.

Dicts (modal/dict.py `_Dict`)
- a named Dict (`from_name`, NotFoundError unless `create_if_missing`) shared by every client and
  container; keys and values cross as pickles (a key matches by its pickled bytes);
  `put(key, value, skip_if_exists=True)` is atomic and returns whether it wrote.

Not emulated: GPU/CPU/memory limits and GPU types,
periodic background commits, memory snapshots, `min_containers` starting containers before any input
(emulated: idle containers do not scale down below it), registry images' own filesystems (a
`from_registry` image is this machine's OS with the image's added files), what a sandbox's image does
with PYTHONPATH (no /root on it, an assumption).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import random
import secrets as _secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any, Callable

from tests.modal_emulator import zygote
from tests.modal_emulator.images import EMU, Layout, materialize, validate

GRACE_S = 30.0  # a preempted container's time to exit before it is killed
BOOT_FAILURE_LIMIT = 2  # start-up crashes of one pool before its pending inputs fail
CRASH_LIMIT = 3  # crashes of one input before it fails
COMMIT_OUTSIDE = "commit() can only be called on a mounted volume inside a container"


@dataclass(eq=False)
class Call:
    fcid: str
    inputs: list[Input] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # input indices in completion order
    delivered: int = 0


@dataclass(eq=False)
class Input:
    iid: str
    call: Call
    index: int
    pool: Pool
    method: str | None
    blob: bytes
    status: str = "pending"  # pending, running, done
    ok: bool = False
    result: bytes = b""
    attempts: int = 0  # failures retried so far
    crashes: int = 0
    container: str | None = None


@dataclass(eq=False)
class Pool:
    fn: dict  # the function spec
    params: bytes | None
    pending: list[Input] = field(default_factory=list)
    containers: list[Container] = field(default_factory=list)
    boot_failures: int = 0
    boot_error: bytes | None = None


@dataclass(eq=False)
class Container:
    cid: str
    pool: Pool
    proc: subprocess.Popen | None = None
    ready: bool = False
    booted: bool = False  # it asked for its function (a fork that fails before is the zygote's fault)
    gone: bool = False
    stopping: bool = False
    preempted: bool = False
    interrupted: bool = False
    current: Input | None = None
    idle_since: float = field(default_factory=time.monotonic)
    started: float = 0.0  # when the current input started (its timeout counts from here)
    timed_out: bool = False
    control: deque = field(default_factory=deque)
    mounts: dict[str, tuple[str, Path]] = field(default_factory=dict)  # mount -> (volume, view dir)
    baselines: dict[str, dict] = field(default_factory=dict)
    inputs_done: int = 0
    kind: tuple = ()  # what a zygote of its kind shares (zygote.py)


@dataclass(eq=False)
class SandboxState:
    sid: str
    proc: subprocess.Popen
    out: dict[int, deque] = field(default_factory=lambda: {1: deque(), 2: deque()})
    eof: dict[int, bool] = field(default_factory=lambda: {1: False, 2: False})
    mounts: dict[str, tuple[str, Path]] = field(default_factory=dict)
    baselines: dict[str, dict] = field(default_factory=dict)
    stdin_bytes: int = 0
    active_at: float = field(default_factory=time.monotonic)  # the last stdin write (idle_timeout counts from it)


class Service:
    """One emulated Modal workspace. `start()` it, point the fake client at `env`, `close()` it."""

    def __init__(self, state: Path, seed: int = 0):
        self.state = Path(state)
        self.rng = random.Random(seed)
        self.cond = threading.Condition()
        self.layout = Layout(self.state)
        self.sock_dir = Path(tempfile.mkdtemp(prefix="modal-emu-"))  # short: AF_UNIX paths are limited
        self.address = str(self.sock_dir / "service.sock")
        self.key = _secrets.token_hex(16)
        self.apps: dict[str, dict] = {}
        self.functions: dict[str, dict] = {}
        self.pools: dict[tuple[str, bytes | None], Pool] = {}
        self.calls: dict[str, Call] = {}
        self.inputs: dict[str, Input] = {}
        self.containers: dict[str, Container] = {}
        self.sandboxes: dict[str, SandboxState] = {}
        self.secrets: dict[str, dict[str, str]] = {}
        self.tokens: dict[str, str] = {"ak-emulated": "as-emulated"}  # token id -> secret this workspace accepts
        self.dicts: dict[str, dict[bytes, bytes]] = {}
        self.log: list[dict] = []  # one row per input run: function, container, argument bytes, outcome
        self.hooks: dict[str, list[Callable[..., Any]]] = {}
        self.hook_errors: list[Exception] = []
        self._ids = itertools.count(1)
        self._closed = False
        self._spawns: queue.Queue = queue.Queue()
        self._timers: list[threading.Timer] = []

    # -- life ---------------------------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        return {"VRL_MODAL_EMULATOR": self.address, "VRL_MODAL_EMULATOR_KEY": self.key}

    def start(self) -> Service:
        (self.state / "volumes").mkdir(parents=True, exist_ok=True)
        (self.state / "logs").mkdir(exist_ok=True)
        self.layout.venv_entries  # noqa: B018 - read once, before any container
        self.layout.write_gvisor()
        self._listener = Listener(self.address, family="AF_UNIX", authkey=bytes.fromhex(self.key))
        threading.Thread(target=self._accept, daemon=True, name="modal-emu-accept").start()
        threading.Thread(target=self._watchdog, daemon=True, name="modal-emu-watchdog").start()
        threading.Thread(target=self._spawner, daemon=True, name="modal-emu-spawner").start()
        return self

    def _spawner(self) -> None:
        """Every container and sandbox process is started by this one long-lived thread: bwrap's
        --die-with-parent kills a process when the *thread* that started it ends (PR_SET_PDEATHSIG)."""
        while (job := self._spawns.get()) is not None:
            argv, kwargs, box, done = job
            try:
                box.append(subprocess.Popen(argv, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - raised in the asking thread
                box.append(exc)
            done.set()

    def _popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        box: list = []
        done = threading.Event()
        self._spawns.put((argv, kwargs, box, done))
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def close(self) -> None:
        with self.cond:
            if self._closed:
                return
            self._closed = True
            procs = [c.proc for c in self.containers.values() if c.proc] + [s.proc for s in self.sandboxes.values()]
            self.cond.notify_all()
        self._spawns.put(None)
        for timer in self._timers:
            timer.cancel()
        for proc in procs:
            if proc.poll() is None:
                _kill(proc)
        for proc in procs:
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):  # stdin's unsent bytes to a dead sandbox: BrokenPipeError
                        stream.close()
        if hasattr(self, "_listener"):
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as wake:
                wake.settimeout(2.0)  # an accept thread already gone leaves a full backlog: connect would block
                wake.connect(self.address)  # the accept thread returns, sees `_closed`, ends
            self._listener.close()
        shutil.rmtree(self.sock_dir, ignore_errors=True)

    def _later(self, seconds: float, fn: Callable[[], Any]) -> None:
        timer = threading.Timer(seconds, fn)
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids):04d}{_secrets.token_hex(3)}"

    def on(self, event: str, fn: Callable[..., Any]) -> None:
        """Call `fn(**info)` on `event`: input_started, input_finished, sandbox_stdin."""
        self.hooks.setdefault(event, []).append(fn)

    def _emit(self, event: str, **info: Any) -> None:
        for fn in self.hooks.get(event, ()):
            try:
                fn(**info)
            except Exception as exc:  # noqa: BLE001 - a test's hook must not crash the emulated service
                self.hook_errors.append(exc)

    # -- the wire -----------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:  # noqa: BLE001 - a client that died mid-handshake; the listener goes on
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="modal-emu-conn").start()

    def _serve(self, conn) -> None:
        with conn:
            while True:
                try:
                    op, args = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply = ("ok", getattr(self, f"op_{op}")(*args))
                except BaseException as exc:  # noqa: BLE001 - the caller raises it
                    reply = ("err", exc)
                try:
                    conn.send(reply)
                except (OSError, ValueError):
                    return

    # -- apps and functions --------------------------------------------------------------------------
    def op_auth(self, token_id: str, token_secret: str) -> None:
        """The server's answer to a client's first call (ClientHello, modal/client.py): a token it does not
        know is refused with gRPC UNAUTHENTICATED, which the client raises as AuthError (modal/_grpc_client.py).
        The wording is the emulator's: the server's own is not in the client's source."""
        from modal.exception import AuthError

        if self.tokens.get(token_id) != token_secret:
            raise AuthError(f"the token {token_id!r} is not valid for this workspace (UNAUTHENTICATED)")

    def op_app_create(self, name: str | None) -> str:
        app_id = self._new_id("ap")
        with self.cond:
            self.apps[app_id] = {"name": name, "running": False, "functions": []}
        return app_id

    def op_function_create(self, app_id: str, spec: dict) -> str:
        from modal.exception import InvalidError

        if spec["nonpreemptible"] and spec["gpu"]:
            raise InvalidError("nonpreemptible is not supported for GPU Functions (modal.com/docs/guide/preemption)")
        fid = self._new_id("fu")
        with self.cond:
            self.functions[fid] = {**spec, "fid": fid, "app": app_id}
            self.apps[app_id]["functions"].append(fid)
        return fid

    def op_app_run(self, app_id: str) -> None:
        from modal.exception import NotFoundError

        with self.cond:
            for fid in self.apps[app_id]["functions"]:
                fn = self.functions[fid]
                validate(fn["image"])
                for name, _env in fn["secrets"]:
                    if name is not None and name not in self.secrets:
                        raise NotFoundError(f"Secret '{name}' not found")
                for volume, create in fn["volumes"].values():
                    self._volume_dir(volume, create)
            self.apps[app_id]["running"] = True

    def op_app_exit(self, app_id: str, detach: bool) -> None:
        if not detach:
            self.op_app_stop(app_id)

    def op_app_lookup(self, app_id: str) -> str:
        from modal.exception import NotFoundError

        with self.cond:
            if app_id not in self.apps:
                raise NotFoundError(f"App '{app_id}' not found")
        return app_id

    def op_app_stop(self, app_id: str) -> None:
        """Stop an app: its pending inputs fail, its containers stop (SIGINT, then a kill after the grace
        period), and it takes no new calls."""
        from modal.exception import RemoteError

        with self.cond:
            self.apps[app_id]["running"] = False
            for pool in self.pools.values():
                if pool.fn["app"] != app_id:
                    continue
                for inp in list(pool.pending):
                    pool.pending.remove(inp)
                    self._finish(inp, False, _pickle(RemoteError("the app was stopped")))
                for c in pool.containers:
                    self._interrupt(c)
            self.cond.notify_all()

    def app_running(self, app_id: str) -> bool:
        """Whether the app takes calls (tests)."""
        with self.cond:
            return self.apps[app_id]["running"]

    def live_containers(self) -> list[str]:
        """Every container alive now, of any app (tests: what is still billed)."""
        with self.cond:
            return [c.cid for c in self.containers.values() if not c.gone]

    # -- calls --------------------------------------------------------------------------------------
    def op_call_start(self, fid: str, method: str | None, params: bytes | None, blobs: list[bytes]) -> str:
        from modal.exception import ExecutionError

        with self.cond:
            fn = self.functions[fid]
            if not self.apps[fn["app"]]["running"]:
                raise ExecutionError(f"{fn['name']}: the App it is defined on is not running")
            pool = self.pools.setdefault((fid, params), Pool(fn, params))
            call = Call(self._new_id("fc"))
            self.calls[call.fcid] = call
            for i, blob in enumerate(blobs):
                inp = Input(self._new_id("in"), call, i, pool, method, blob)
                call.inputs.append(inp)
                self.inputs[inp.iid] = inp
                pool.pending.append(inp)
            self._scale(pool)
            self.cond.notify_all()
        return call.fcid

    def op_call_next(self, fcid: str, ordered: bool) -> tuple[bool, bytes]:
        with self.cond:
            call = self.calls[fcid]
            while True:
                if ordered:
                    inp = call.inputs[call.delivered]
                    ready = inp if inp.status == "done" else None
                else:
                    ready = call.inputs[call.finished[call.delivered]] if len(call.finished) > call.delivered else None
                if ready is not None:
                    call.delivered += 1
                    return ready.ok, ready.result
                self._wait()

    def op_call_get(self, fcid: str, timeout: float | None) -> tuple[bool, bytes]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            inp = self.calls[fcid].inputs[0]
            while inp.status != "done":
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError()
                self._wait(None if deadline is None else deadline - time.monotonic())
            return inp.ok, inp.result

    def op_call_cancel(self, fcid: str, terminate_containers: bool) -> None:
        """Cancelled inputs end without retry; a running one's output is dropped (Modal raises
        InputCancellation in it) and, with `terminate_containers`, its container is stopped."""
        from modal.exception import RemoteError

        with self.cond:
            for inp in self.calls[fcid].inputs:
                if inp.status == "done":
                    continue
                if inp.status == "pending":
                    inp.pool.pending.remove(inp)
                elif terminate_containers and inp.container in self.containers:
                    self._interrupt(self.containers[inp.container])
                elif inp.container in self.containers:  # InputCancellation in its user code; the container goes on
                    self.containers[inp.container].control.append(f"cancel:{inp.iid}")
                self._finish(inp, False, _pickle(RemoteError("Function call was cancelled")))
            self.cond.notify_all()

    def _finish(self, inp: Input, ok: bool, result: bytes) -> None:
        inp.status, inp.ok, inp.result = "done", ok, result
        inp.call.finished.append(inp.index)

    def _wait(self, timeout: float | None = 1.0) -> None:
        if self._closed:
            raise RuntimeError("the Modal emulator was closed")
        self.cond.wait(timeout if timeout is None else max(0.0, min(timeout, 1.0)))

    # -- containers ---------------------------------------------------------------------------------
    def _scale(self, pool: Pool) -> None:
        """Start containers for pending inputs, up to max_containers (under the lock)."""
        from modal.exception import RemoteError

        if pool.boot_failures >= BOOT_FAILURE_LIMIT:
            for inp in list(pool.pending):
                pool.pending.remove(inp)
                self._finish(inp, False, pool.boot_error or _pickle(RemoteError("container start-up failed")))
            return
        live = [c for c in pool.containers if not c.gone and not c.stopping]
        free = sum(1 for c in live if c.current is None)
        limit = pool.fn["max_containers"] or 1000
        for _ in range(min(len(pool.pending) - free, limit - sum(not c.gone for c in pool.containers))):
            self._start_container(pool)

    def _start_container(self, pool: Pool) -> None:
        c = Container(self._new_id("ta"), pool)
        fn = pool.fn
        image = materialize(fn["image"], self.state / "images")
        binds = {f"{EMU}/sock": self.sock_dir}
        for mount, (volume, _create) in fn["volumes"].items():
            view = self.state / "containers" / c.cid / mount.strip("/").replace("/", "_")
            shutil.copytree(self._volume_dir(volume), view)
            c.mounts[mount], c.baselines[mount] = (volume, view), _scan(view)
            binds[mount] = view
        env = {"PATH": f"{EMU}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
               "PYTHONUNBUFFERED": "1", "PYTHONPATH": "/root", "MODAL_IS_REMOTE": "1", "MODAL_TASK_ID": c.cid,
               **image.env, **self._secret_env(fn["secrets"]), **fn["env"],
               "VRL_MODAL_EMULATOR": f"{EMU}/sock/service.sock", "VRL_MODAL_EMULATOR_KEY": self.key,
               "VRL_MODAL_EMULATOR_CONTAINER": c.cid}
        log = open(self.state / "logs" / f"{c.cid}.log", "wb")  # noqa: SIM115 - the child holds it
        c.kind = zygote.kind(image.tree.parent.name, fn, env, list(fn["volumes"]))
        c.proc = self._fork(c.kind, image, env, binds, log) if zygote.enabled() else None
        if c.proc is None:
            argv = self.layout.bwrap(image, binds, "/root", env) + [f"{EMU}/bin/python", "-m", "modal._container"]
            c.proc = self._popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            zygote.starts["fresh"] += 1
        else:
            zygote.starts["forked"] += 1
        log.close()
        pool.containers.append(c)
        self.containers[c.cid] = c
        threading.Thread(target=self._reap, args=(c,), daemon=True, name=f"modal-emu-{c.cid}").start()

    def _fork(self, kind: tuple, image, env: dict[str, str], binds: dict[str, Path], log) -> Any:
        """A container forked from the zygote of its kind (zygote.py), or None: start a fresh one."""
        def start_zygote(state: Path) -> tuple[list[str], dict]:
            layout = Layout(state)
            layout.write_gvisor()
            empty = state / "empty"
            empty.mkdir(exist_ok=True)
            holes = {zygote.HOST: Path("/"), f"{EMU}/sock": empty, **{mount: empty for mount in binds if mount != f"{EMU}/sock"}}
            shared = {k: v for k, v in env.items() if k not in zygote.PER_CONTAINER}
            return layout.bwrap(image, holes, "/root", shared) + [f"{EMU}/bin/python"], {}

        spec = {"module": "modal._container", "cwd": "/root", "env": env,
                "binds": [(str(Path(source).resolve()), target, False) for target, source in binds.items()]
                + [(str(self.layout.gvisor.resolve()), f"{EMU}/gvisor", True)]}
        return zygote.fork(kind, start_zygote, spec, [log.fileno()])

    def _reap(self, c: Container) -> None:
        c.proc.wait()
        if isinstance(c.proc, zygote.Forked) and not c.booted:
            zygote.failed(c.kind, self.state / "logs" / f"{c.cid}.log")
        from modal.exception import RemoteError

        with self.cond:
            c.gone = True
            inp, c.current = c.current, None
            if inp is not None and inp.status == "running" and inp.container == c.cid:
                inp.status, inp.container = "pending", None
                if not c.preempted and not c.timed_out:
                    inp.crashes += 1
                if c.timed_out:  # per attempt: retried up to `retries`, then FunctionTimeoutError
                    self._timed_out(inp)
                elif inp.crashes >= CRASH_LIMIT:
                    self._finish(inp, False, _pickle(RemoteError(f"the container crashed {inp.crashes} times")))
                else:
                    inp.pool.pending.append(inp)  # restarted on the same input
            if not self._closed:
                self._scale(c.pool)
            self.cond.notify_all()

    def op_container_boot(self, cid: str) -> dict:
        with self.cond:
            c = self.containers[cid]
            c.booted = True
            fn = c.pool.fn
            python = materialize(fn["image"], self.state / "images").python
            return {"kind": fn["kind"], "serialized": fn["serialized"], "blob": fn["blob"], "module": fn["module"],
                    "qualname": fn["qualname"], "client_python": fn["client_python"], "image_python": python,
                    "params": c.pool.params, "volumes": fn["volumes"]}

    def op_container_failed(self, cid: str, error: bytes) -> None:
        with self.cond:
            c = self.containers[cid]
            c.stopping = True
            c.pool.boot_failures += 1
            c.pool.boot_error = error
            self.cond.notify_all()

    def op_container_ready(self, cid: str) -> None:
        with self.cond:
            self.containers[cid].ready = True

    def op_container_next(self, cid: str, modules: list[str] = ()) -> tuple | None:
        """The container's next input (None: it stops). `modules`: those it loaded since it last asked
        (what a zygote of its kind imports ahead, zygote.py)."""
        with self.cond:
            c = self.containers[cid]
            zygote.learn(c.kind, modules, c.inputs_done > 0)
            c.idle_since = time.monotonic()
            while True:
                if c.stopping or c.gone or self._closed:
                    return None
                if c.pool.pending:
                    inp = c.pool.pending.pop(self.rng.randrange(len(c.pool.pending)))  # random assignment
                    inp.status, inp.container, c.current = "running", cid, inp
                    c.started = time.monotonic()
                    break
                if time.monotonic() - c.idle_since >= c.pool.fn["scaledown_window"] and self._above_minimum(c.pool):
                    c.stopping = True
                    return None
                self.cond.wait(0.5)
        self.log.append({"function": c.pool.fn["name"], "method": inp.method, "container": cid, "iid": inp.iid,
                         "bytes": len(inp.blob), "call": inp.call.fcid})
        self._emit("input_started", service=self, container=cid, function=c.pool.fn["name"], input=inp)
        return inp.iid, inp.method, inp.blob

    def _above_minimum(self, pool: Pool) -> bool:
        """Whether an idle container may scale down: `min_containers` of the pool stay up (under the lock)."""
        live = sum(1 for c in pool.containers if not c.gone and not c.stopping)
        return live > (pool.fn.get("min_containers") or 0)

    def op_container_output(self, cid: str, iid: str, ok: bool, result: bytes) -> None:
        with self.cond:
            c, inp = self.containers[cid], self.inputs[iid]
            if c.preempted or c.timed_out:
                return  # the input runs again elsewhere (or fails) once this container is gone (_reap)
            c.current, c.idle_since = None, time.monotonic()
            c.inputs_done += 1
            if inp.status != "running" or inp.container != cid:
                return  # cancelled
            if not ok and inp.attempts < c.pool.fn["retries"]:
                inp.attempts += 1
                inp.status, inp.container = "pending", None
                c.pool.pending.append(inp)
            else:
                self._finish(inp, ok, result)
            self.cond.notify_all()
        self._emit("input_finished", service=self, container=cid, function=c.pool.fn["name"], input=inp)

    def op_container_control(self, cid: str) -> str:
        with self.cond:
            c = self.containers[cid]
            while not c.control:
                if c.gone or self._closed:
                    raise EOFError("container gone")
                self.cond.wait(1.0)
            return c.control.popleft()

    def _interrupt(self, c: Container) -> None:
        """Stop a container gracefully (under the lock): SIGINT now, a kill after the grace period."""
        if c.gone or c.interrupted:
            return
        c.stopping = c.interrupted = True
        c.control.append("interrupt")
        self.cond.notify_all()
        self._later(GRACE_S, lambda: c.proc.poll() is None and _kill(c.proc))

    def preempt(self, cid: str) -> None:
        """Preempt a container: SIGINT, exit (with its exit commit), its input restarted elsewhere."""
        with self.cond:
            c = self.containers[cid]
            if c.pool.fn["nonpreemptible"]:
                raise ValueError(f"{c.pool.fn['name']} is nonpreemptible")
            c.preempted = True
            self._interrupt(c)

    def kill(self, cid: str) -> None:
        """Crash a container (out of memory, lost host): no exit commit; its input runs again elsewhere."""
        _kill(self.containers[cid].proc)

    def running(self, function: str) -> list[str]:
        """Containers of `function` (its name, or the last part of its qualified name) alive now."""
        with self.cond:
            return [c.cid for c in self.containers.values()
                    if not c.gone and function in (c.pool.fn["name"], c.pool.fn["name"].rsplit(".", 1)[-1])]

    def _watchdog(self) -> None:
        while not self._closed:
            time.sleep(0.5)
            with self.cond:
                now = time.monotonic()
                for c in self.containers.values():  # Modal terminates an input's container at its timeout
                    if c.current is not None and not c.gone and not c.timed_out \
                            and now - c.started > c.pool.fn["timeout"]:
                        c.timed_out = c.stopping = True
                        _kill(c.proc)
                self.cond.notify_all()  # idle containers re-check their scale-down window

    def _timed_out(self, inp: Input) -> None:
        """An input whose container was terminated at its timeout (under the lock; it is pending again)."""
        from modal.exception import FunctionTimeoutError

        if inp.attempts < inp.pool.fn["retries"]:
            inp.attempts += 1
            inp.pool.pending.append(inp)
        else:
            timeout = inp.pool.fn["timeout"]
            self._finish(inp, False, _pickle(FunctionTimeoutError(f"Function timed out after {timeout} seconds "
                                                                  f"(the timeout of {inp.pool.fn['name']})")))

    def op_container_current(self, cid: str) -> str | None:
        """The call of the input the container runs now (`modal.current_function_call_id()`)."""
        with self.cond:
            c = self.containers[cid]
            return c.current.call.fcid if c.current is not None else None

    # -- dicts --------------------------------------------------------------------------------------
    def op_dict_open(self, name: str, create: bool) -> None:
        from modal.exception import NotFoundError

        with self.cond:
            if name not in self.dicts:
                if not create:
                    raise NotFoundError(f"Dict '{name}' not found")
                self.dicts[name] = {}

    def op_dict_get(self, name: str, key: bytes) -> tuple[bool, bytes | None]:
        with self.cond:
            data = self.dicts[name]
            return (True, data[key]) if key in data else (False, None)

    def op_dict_put(self, name: str, key: bytes, value: bytes, skip_if_exists: bool) -> bool:
        with self.cond:
            data = self.dicts[name]
            if skip_if_exists and key in data:
                return False
            data[key] = value
            return True

    def op_dict_pop(self, name: str, key: bytes) -> tuple[bool, bytes | None]:
        with self.cond:
            data = self.dicts[name]
            return (True, data.pop(key)) if key in data else (False, None)

    # -- volumes ------------------------------------------------------------------------------------
    def _volume_dir(self, name: str, create: bool = False) -> Path:
        from modal.exception import NotFoundError

        path = self.state / "volumes" / name
        if not path.is_dir():
            if not create:
                raise NotFoundError(f"Volume '{name}' not found")
            path.mkdir(parents=True)
        return path

    def volume(self, name: str) -> Path:
        """The committed state of a Volume (what a fresh container would mount)."""
        return self._volume_dir(name, create=True)

    def _holder(self, cid: str) -> Container | SandboxState:
        return self.containers.get(cid) or self.sandboxes[cid]

    def op_volume_mount_of(self, cid: str, name: str) -> str:
        holder = self._holder(cid)
        mounts = [m for m, (vol, _view) in holder.mounts.items() if vol == name]
        if not mounts or isinstance(holder, SandboxState):
            raise RuntimeError(COMMIT_OUTSIDE)
        return mounts[0]

    def op_volume_commit(self, cid: str, name: str, strict: bool) -> str | None:
        """Commit the container's changes to the files it touched; last commit wins per file."""
        holder = self._holder(cid)
        if strict:
            mount = self.op_volume_mount_of(cid, name)
        with self.cond:
            for m, (vol, view) in holder.mounts.items():
                if vol != name:
                    continue
                committed, before = self._volume_dir(name), holder.baselines[m]
                now = _scan(view)
                for rel, sig in sorted(now.items()):
                    if before.get(rel) != sig:
                        target = committed / rel
                        if sig[0] == "d":
                            if target.is_file():
                                target.unlink()
                            target.mkdir(parents=True, exist_ok=True)
                        else:
                            if target.is_dir():
                                shutil.rmtree(target)
                            target.parent.mkdir(parents=True, exist_ok=True)
                            shutil.copy2(view / rel, target)
                for rel in sorted(set(before) - set(now), reverse=True):
                    target = committed / rel
                    if target.is_dir():
                        shutil.rmtree(target)
                    elif target.exists():
                        target.unlink()
                holder.baselines[m] = now
        return mount if strict else None

    def op_volume_refresh(self, cid: str, name: str) -> None:
        """Replace the container's view with the committed state (in place: the view is mounted)."""
        holder = self._holder(cid)
        with self.cond:
            for m, (vol, view) in holder.mounts.items():
                if vol != name:
                    continue
                for entry in view.iterdir():
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
                shutil.copytree(self._volume_dir(name), view, dirs_exist_ok=True)
                holder.baselines[m] = _scan(view)

    def op_volume_read(self, name: str, path: str, create: bool = False) -> bytes:
        target = self._volume_dir(name, create) / path.lstrip("/")
        if not target.is_file():
            raise FileNotFoundError(f"No such file: {path}")
        return target.read_bytes()

    def op_volume_listdir(self, name: str, path: str, recursive: bool, create: bool = False) -> list[tuple]:
        base = self._volume_dir(name, create)
        start = base / path.lstrip("/")
        if not start.exists():
            raise FileNotFoundError(f"No such file or directory: {path}")
        entries = sorted(start.rglob("*") if recursive else start.iterdir())
        return [(str(p.relative_to(base)), "directory" if p.is_dir() else "file", p.stat().st_mtime,
                 p.stat().st_size) for p in entries]

    def op_volume_put(self, name: str, files: list[tuple[str, bytes]], force: bool, create: bool = False) -> None:
        base = self._volume_dir(name, create)
        with self.cond:
            for rel, data in files:
                target = base / rel.lstrip("/")
                if target.exists() and not force:
                    raise FileExistsError(f"{rel} already exists on Volume {name!r} (batch_upload(force=True) "
                                          "overwrites)")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)

    def op_volume_remove(self, name: str, path: str, recursive: bool, create: bool = False) -> None:
        """`Volume.remove_file`: from the committed state, from anywhere (a directory needs `recursive`)."""
        target = self._volume_dir(name, create) / path.lstrip("/")
        with self.cond:
            if not target.exists():
                raise FileNotFoundError(f"No such file or directory: {path}")
            if target.is_dir():
                if not recursive:
                    raise IsADirectoryError(f"{path} is a directory: remove_file(recursive=True) removes it")
                shutil.rmtree(target)
            else:
                target.unlink()

    # -- sandboxes ----------------------------------------------------------------------------------
    def op_sandbox_create(self, spec: dict) -> str:
        sid = self._new_id("sb")
        validate(spec["image"])
        image = materialize(spec["image"], self.state / "images")
        env = {"PATH": f"{EMU}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
               **image.env, **self._secret_env(spec["secrets"]), **spec["env"]}
        binds, mounts = {}, {}
        for mount, (volume, create) in spec["volumes"].items():
            view = self.state / "sandboxes" / sid / mount.strip("/").replace("/", "_")
            shutil.copytree(self._volume_dir(volume, create), view)
            binds[mount], mounts[mount] = view, (volume, view)
        argv = self.layout.bwrap(image, binds, spec["workdir"] or "/root", env, network=not spec["block_network"])
        proc = self._popen(argv + spec["args"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, start_new_session=True)
        sb = SandboxState(sid, proc, mounts=mounts, baselines={m: _scan(v) for m, (_vol, v) in mounts.items()})
        with self.cond:
            self.sandboxes[sid] = sb
        for fd, stream in ((1, proc.stdout), (2, proc.stderr)):
            threading.Thread(target=self._pump, args=(sb, fd, stream), daemon=True).start()
        threading.Thread(target=self._reap_sandbox, args=(sb,), daemon=True).start()
        if spec["timeout"]:
            self._later(spec["timeout"], lambda: proc.poll() is None and _kill(proc))
        if spec.get("idle_timeout"):
            threading.Thread(target=self._idle_watch, args=(sb, spec["idle_timeout"]), daemon=True).start()
        return sid

    def _pump(self, sb: SandboxState, fd: int, stream) -> None:
        """The server side of a sandbox stream: whatever the process wrote, in chunks of random size."""
        rng = random.Random(self.rng.random())
        while chunk := os.read(stream.fileno(), rng.randint(1, 1 << 16)):
            with self.cond:
                sb.out[fd].append(chunk)
                self.cond.notify_all()
        with self.cond:
            sb.eof[fd] = True
            self.cond.notify_all()

    def _reap_sandbox(self, sb: SandboxState) -> None:
        """A sandbox's Volume writes are committed when it ends."""
        sb.proc.wait()
        for volume, _view in sb.mounts.values():
            self.op_volume_commit(sb.sid, volume, False)

    def _idle_watch(self, sb: SandboxState, idle_s: float) -> None:
        """`idle_timeout`: a sandbox with no activity for that long is terminated. Activity is a running
        `exec`, stdin being written, or an open tunnel connection (modal.com/docs/guide/sandbox, "Idle
        Timeouts"); the work of the sandbox's own process is not. The emulated sandboxes have only stdin
        (no exec, no tunnels)."""
        while sb.proc.poll() is None and not self._closed:
            left = sb.active_at + idle_s - time.monotonic()
            if left <= 0:
                _kill(sb.proc)
                return
            time.sleep(min(left, 0.5))

    def op_sandbox_stdin(self, sid: str, data: bytes, eof: bool) -> None:
        sb = self.sandboxes[sid]
        self._emit("sandbox_stdin", service=self, sandbox=sb, data=data)
        sb.stdin_bytes += len(data)
        sb.active_at = time.monotonic()
        try:
            if data:
                sb.proc.stdin.write(data)
                sb.proc.stdin.flush()
            if eof:
                sb.proc.stdin.close()
        except (BrokenPipeError, ValueError) as exc:
            raise ValueError(f"Sandbox {sid} has terminated: cannot write to its stdin") from exc

    def op_sandbox_read(self, sid: str, fd: int) -> bytes | None:
        sb = self.sandboxes[sid]
        with self.cond:
            deadline = time.monotonic() + 0.5
            while not sb.out[fd] and not sb.eof[fd] and time.monotonic() < deadline:
                self.cond.wait(deadline - time.monotonic())
            if sb.out[fd]:
                return sb.out[fd].popleft()
            return None if sb.eof[fd] else b""

    def op_sandbox_poll(self, sid: str, timeout: float | None) -> int | None:
        proc = self.sandboxes[sid].proc
        if timeout is None:
            return proc.wait()
        return proc.poll()

    def op_sandbox_terminate(self, sid: str) -> None:
        proc = self.sandboxes[sid].proc
        if proc.poll() is None:
            _kill(proc)
        proc.wait()

    def stall_sandbox(self, sid: str, seconds: float) -> None:
        """What the sandbox runs makes no progress for `seconds` (a slow batch): every process below its
        top one is stopped (SIGSTOP), then continued. Its stdin still takes writes (the pipe buffers them)."""
        from vrl import reaper

        frozen = [i for i in reaper.tree(reaper.children(self.sandboxes[sid].proc.pid)) if reaper.alive(i)]
        for identity in frozen:
            with contextlib.suppress(OSError):
                os.kill(identity[0], signal.SIGSTOP)

        def thaw() -> None:
            for identity in frozen:
                if reaper.alive(identity):
                    with contextlib.suppress(OSError):
                        os.kill(identity[0], signal.SIGCONT)

        self._later(seconds, thaw)

    def refuse_bwrap(self, stderr: str) -> None:
        """From now on every `bwrap` in the emulated containers and sandboxes fails at once, printing `stderr`
        (exit 1): bubblewrap broken beyond gVisor's documented rules."""
        (self.layout.gvisor / "refuse").write_text(stderr)

    def kill_sandbox(self, sid: str) -> None:
        """A sandbox dies (out of memory, a crash of what it runs)."""
        self.op_sandbox_terminate(sid)

    def _secret_env(self, specs: list) -> dict[str, str]:
        env: dict[str, str] = {}
        for name, inline in specs:
            env.update(inline if name is None else self.secrets[name])
        return env


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL a container's or sandbox's process and every process below it. bwrap's process inside the
    namespace (its PID 1) dies with the outer one (`--die-with-parent`), unless the outer one is killed in
    the instant after it forked and before the child asked for that signal: about one container a suite
    run outlived its test that way here (a sleeping bwrap, PID 1 of its namespace, reparented to init).
    The processes below are killed first, found as `vrl.reaper` finds a run's (through /proc); killing a
    namespace's PID 1 ends the whole namespace."""
    from vrl import reaper

    if proc.poll() is not None:  # reaped: its pid may be another process's by now
        return
    for identity in reaper.tree(reaper.children(proc.pid)):
        if reaper.alive(identity):  # checked just before: a pid given to another process is left alone
            with contextlib.suppress(OSError):
                os.kill(identity[0], signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def _scan(root: Path) -> dict[str, tuple]:
    """Every path under `root` with what changes when it is written (kind, size, mtime, inode)."""
    out = {}
    for path in root.rglob("*"):
        st = path.lstat()
        rel = str(path.relative_to(root))
        out[rel] = ("d",) if path.is_dir() else ("f", st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def _pickle(exc: BaseException) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(exc, protocol=4)
