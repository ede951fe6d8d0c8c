"""Engines driven from processes of their own (`runtime.local.driver_processes`).

In one process, every engine of a `HostPool` (one thread each) and the trainer share one interpreter:
an engine's Python-side work (vLLM's front end scheduling and detokenising, vrl's LoRA-slot and
perturbation bookkeeping, transformers' generate loop) waits for the GIL while another engine's runs.
A `DriverHost` is the `PolicyHost` of one engine that lives in a child process (started outside any
torchrun launch): the child builds the real host from the run's config, exactly as the in-process
runtime would, and serves this proxy's calls; this process only sends commands and receives completions.

How a child starts: multiprocessing's fork server forks it. The server is a fresh interpreter that this
process's first child starts, and it imports `PRELOAD` (torch, transformers, vrl's config and hf backend)
once; every child is a fork of it, so a child has neither CUDA nor any thread of this process (as a
spawned one) and starts with those imports done. Measured with tiny hf engines on the 2-core CPU machine
(issue 59): a child cost 2.2 CPU-seconds to start and close against 6.7 spawned, and the server 4.3
once, so two engines started in 9 CPU-seconds against 15, and each later pair in 4.4 against 13.
Nothing the server imports initialises CUDA or starts a Python thread (vLLM, which does both, is imported
by each child); numpy's OpenBLAS starts its idle thread pool, which it stops around a fork itself. The
child takes this process's environment at its start (`_take_environment`), as a spawned child would;
what the server imported read its own at import, which is this process's when its first child started.
The server ends once this process and every child have ended (its "alive" pipe); a child is the server's,
not this process's, so it is registered with `vrl.reaper` by pid. Where there is no fork server, children
are spawned.

What crosses the boundary (pickled through a pipe; tensors through shared memory, as
`torch.multiprocessing` sends them): the run's config (its JSON dump, once), tasks, variants and the
sampling seed; completion batches as the child's engine yields them; the `PerturbationSpec`; seeded
updates as their `to_wire` data (seeds and coefficients); θ for `state`/`load_state` (snapshots,
resume); counters. GRPO trains a model in this process (`Generator.trainable_elsewhere`, for a backend
that `trains_elsewhere`: hf, vllm) and `publish` sends its weights bucket by bucket, each bucket's tensors in
shared memory (CPU) or as CUDA IPC handles, so no bucket is copied through the pipe and the next is
drawn only once the child has loaded this one. The child learns where the trained copy lives
(`HostNeeds.train_device`) and is told when it exists (`Generator.trained_elsewhere`): a vLLM engine
then pushes what it received with the transport it would use beside the trainer (an NCCL broadcast to
an engine on another GPU straight from the received tensors; CUDA IPC or vrl's loader, on the
trainer's GPU, from a copy made in the child, as torch will not hand on a received CUDA tensor).
Multi-turn episodes run beside the engine: the child builds the run's environment from its plugin and
options (`vrl.plugins.environment_wire`; one made in code is refused) and samples whole episodes, as the
in-process host does.

Errors: an exception in the child is raised here as the same exception (type and one-line message;
its traceback is attached as a note). A child that dies (killed, out of memory, a crash in native
code) ends the call with a `DriverDied` naming the engine. `close()` always ends the child: it asks,
then terminates, then kills; and a child registered with `vrl.reaper` is ended with this process
however it ends (Ctrl-C, SIGKILL), along with the engine processes the child started itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from vrl import reaper
from vrl.distributed import outside_launch
from vrl.errors import UsageError
from vrl.policy import (
    HostNeeds,
    PerturbationSpec,
    PolicyHost,
    Trainable,
    Variant,
    WeightsInfo,
    WeightStream,
)
from vrl.types import Completion, Task

log = logging.getLogger(__name__)

CLOSE_GRACE_S = 30.0
"""Seconds `close` waits for the child to close its engine and exit (it may be finishing a generation
batch first) before it terminates it."""

ELSEWHERE = ("driver processes", "set runtime.local.driver_processes=false")
"""Who runs a run's episodes in driver processes, and the setting that keeps them in this process
(`Runtime.episodes_elsewhere`)."""

PRELOAD = ("torch", "transformers", "vrl.config", "vrl.generate.hf", "vrl.runtime.driver")
"""What the fork server imports once, so that each child starts with it imported: the modules every child
needs, none of which initialises CUDA or starts a thread of Python's at import (vLLM does both: each child
imports it for itself)."""

_END = object()


class DriverDied(UsageError, RuntimeError):
    """An engine's driver process ended while the run still needed it."""


class DriverHost(PolicyHost):
    """The `PolicyHost` of one engine driven from a child process; see the module docstring.

    `DriverHost(config, needs, gpu, label)` starts the child and returns (the first also waits for the fork
    server's imports); the first call (or
    `ready()`) waits until its engine is up, so several engines start side by side (`start`).
    """

    def __init__(self, config: Any, needs: HostNeeds | None, gpu: str | None, label: str):
        from vrl.config import dump

        if needs is not None and needs.moves == "trained" and needs.train_device is None:
            needs = dataclasses.replace(needs, train_device=trainer_device(config))

        self.name = f"driver process of {label}"
        self.label = label
        self.config = config
        self._trainable: Trainable | None = None
        self._lock = threading.Lock()  # one call at a time on the pipe
        self._sending = threading.Lock()  # whole messages: `close` may send while a sampling thread aborts
        self._ready = False
        self._closed = False
        ctx = _context()
        self._conn, child = ctx.Pipe()
        level = logging.getLogger("vrl").getEffectiveLevel()
        with outside_launch(), reaper.reaped_children() as started:
            self._proc = ctx.Process(target=_serve, args=(child, dump(config), needs, gpu, label, level, dict(os.environ)),
                                     name=f"vrl-driver-{label}", daemon=False)
            self._proc.start()
            # The fork server's child, not ours: registered by name (`reaped_children` sees only our own
            # children, among them the fork server when this start started it).
            started |= reaper.identities([self._proc.pid])
        self._started = started
        child.close()  # only the child holds its end: a dead child reads as the end of the pipe here

    @classmethod
    def start(cls, config: Any, needs: HostNeeds | None, gpus: Sequence[str | None]) -> list[DriverHost]:
        """One driven engine per entry of `gpus` (as `Generator.engines` places them), started side by
        side; returns when every engine is up, or closes them all and raises the first failure."""
        hosts: list[DriverHost] = []
        try:
            for i, gpu in enumerate(gpus):
                hosts.append(cls(config, needs, gpu, f"engine {i}" + (f" (GPU {gpu})" if gpu is not None else "")))
            for host in hosts:
                host.ready()
        except BaseException:
            for host in hosts:
                with contextlib.suppress(Exception):
                    host.close()
            raise
        return hosts

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def ready(self) -> None:
        """Wait until the child's engine is up (raises what building it raised)."""
        if not self._ready:
            with self._lock:
                if not self._ready:
                    self._reply("start")
                    self._ready = True

    # -- the pipe ------------------------------------------------------------------------------------
    def _recv(self, doing: str) -> tuple[str, Any]:
        """The child's next message; `DriverDied` if it ended instead of answering."""
        try:
            ready = wait([self._conn, self._proc.sentinel])
            if self._conn in ready or self._conn.poll():  # what it sent before it ended is still read
                return self._conn.recv()
        except (EOFError, OSError):
            pass
        raise self._died(doing)

    def _died(self, doing: str) -> DriverDied:
        self._proc.join(timeout=5)
        code = self._proc.exitcode
        how = ("is still running but closed its pipe" if code is None else
               f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}")
        return DriverDied(f"the driver process of {self.label} (pid {self._proc.pid}) {how} during {doing}; "
                          "its own output above says why (out of memory, a crash in the engine); the run's "
                          "finished iterations are kept, resume it once the cause is fixed")

    def _send(self, message: tuple[Any, ...], doing: str) -> None:
        try:
            with self._sending:
                self._conn.send(message)
        except (OSError, ValueError):  # the pipe is gone: the child has ended
            raise self._died(doing) from None

    def _reply(self, doing: str) -> Any:
        kind, value = self._recv(doing)
        if kind == "err":
            raise _raised(value, self.label)
        return value

    def _call(self, op: str, *args: Any) -> Any:
        self.ready()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            self._send((op, args), op)
            return self._reply(op)

    # -- PolicyHost ----------------------------------------------------------------------------------
    def sample(self, tasks: Sequence[Task], variants: Sequence[Variant], seed: int | None = None
               ) -> Iterator[list[Completion]]:
        """The child's `sample`, batch by batch as its engine yields them. Closing this stream early
        asks the child to stop after the batch it is on (as an in-process engine would)."""
        self.ready()
        with self._lock:
            self._send(("sample", (list(tasks), list(variants), seed)), "sample")
            ended = False
            try:
                while True:
                    kind, value = self._recv("sample")
                    if kind == "batch":
                        yield value
                    elif kind == "end":
                        ended = True
                        return
                    else:
                        ended = True
                        raise _raised(value, self.label)
            finally:
                if not ended:  # closed early: stop the child's stream and read what it still sends
                    with contextlib.suppress(Exception):
                        self._send(("abort", ()), "sample")
                        while self._recv("sample")[0] == "batch":
                            pass

    def perturbations(self, spec: PerturbationSpec) -> WeightsInfo:
        return self._call("perturbations", spec)

    def update(self, update: Any) -> None:
        self._call("update", update.to_wire())  # seeds and coefficients

    def state(self) -> dict[str, Any]:
        return self._call("state")

    def load_state(self, state: dict[str, Any]) -> None:
        self._call("load_state", state)

    def counters(self) -> dict[str, float]:
        return self._call("counters")

    def episodes(self, runner: Any) -> None:
        """The child samples whole episodes with its own instance of the run's environment."""
        from vrl.plugins import environment_wire

        self._call("episodes", environment_wire(runner.environment, self.config, *ELSEWHERE))

    def trainable(self) -> Trainable:
        """GRPO's model, in this process (`Generator.trainable_elsewhere`: loaded as the engine's weights
        were); the engine samples what `publish` sends it."""
        if self._trainable is None:
            from vrl.generate import generator_class

            trainable = generator_class(self.config.generator.backend).trainable_elsewhere(self.config)
            self._call("trained_elsewhere")
            self._trainable = trainable
        return self._trainable

    def follow_trained(self) -> None:
        """The copy this engine samples is trained in this process (another host of the pool handed it out):
        the child is told as `trainable` tells it, and loads nothing here."""
        self._call("trained_elsewhere")

    def publish(self, model: Any) -> None:
        """Send `model`'s weights (the module, tensors by checkpoint name, or a `WeightStream`) to the engine,
        one bucket at a time: the child asks for each (`next`) once it has loaded the one before, so the
        stream's contract holds and at most one bucket is shared at once. Tensors cross in shared memory
        (CPU: the storage moves there once and is shared from then on) or as CUDA IPC handles; none is
        copied through the pipe. The child may stop asking (its host skipped the push, or failed)."""
        from vrl.weights.export import published_buckets, release_shared

        buckets = published_buckets(model)  # checkpoint names, LoRA merged
        self.ready()
        with self._lock:
            self._send(("publish", ()), "publish")
            kind, value = self._recv("publish")
            remaining = iter(buckets)
            while kind == "next":  # the next bucket is drawn only when the engine asks for it
                release_shared()
                bucket = next(remaining, _END)
                self._send(("end", ()) if bucket is _END else ("bucket", bucket), "publish")
                kind, value = self._recv("publish")
            if kind == "err":
                raise _raised(value, self.label)

    def decouple(self) -> None:
        self._call("decouple")

    def close(self) -> None:
        """Close the child's engine and end the child: asked first (it finishes the batch it is on), then
        SIGTERM after `CLOSE_GRACE_S`, then SIGKILL. Safe to call twice, and from another thread while a
        call is waiting (a stream then ends after the child's current batch; another call raises `DriverDied`)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._send(("close", ()), "close")
        deadline = time.monotonic() + CLOSE_GRACE_S
        while self._proc.is_alive() and time.monotonic() < deadline:
            if self._lock.acquire(blocking=False):  # nobody else reads: drain, so a child sending is not stuck
                try:
                    with contextlib.suppress(EOFError, OSError):
                        while self._conn.poll(0.05):
                            self._conn.recv()
                finally:
                    self._lock.release()
            else:
                self._proc.join(0.05)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self._proc.is_alive():
                break
            log.warning("%s did not exit in time: sending %s", self.name, sig.name)
            with contextlib.suppress(OSError):
                os.kill(self._proc.pid, sig)
            self._proc.join(10)
        self._proc.join(1)
        reaper.release(self._started)
        self._conn.close()


def _context() -> multiprocessing.context.BaseContext:
    """How children start: by multiprocessing's fork server, which imports `PRELOAD` when the first child
    starts (the server is itself a fresh interpreter, so a child has no CUDA context and no thread of this
    process); "spawn" where there is none."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (this process's first child)
    return ctx


def trainer_device(config: Any) -> str:
    """The device GRPO's copy is trained on in this process (`trainable_elsewhere` loads it on
    generator.device), a GPU named by its index here: the child sees the same GPUs, numbered alike."""
    from vrl.generate.hf import resolve_device

    device = resolve_device(config.generator.device)
    if device.type == "cuda" and device.index is None:
        import torch

        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _raised(data: tuple[Any, str], label: str) -> BaseException:
    """The child's exception, to raise here, with its traceback attached as a note."""
    exc, text = data
    exc.add_note(f"raised in the driver process of {label}:\n{text}")
    return exc


def _wire_error(exc: BaseException) -> tuple[BaseException, str]:
    """`exc` as the parent will raise it: itself when it survives pickling, else a RuntimeError that
    keeps its type's name and message."""
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - an exception type that does not round-trip
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    exc.__traceback__ = None
    exc.__cause__ = exc.__context__ = None
    return exc, text


def _serve(conn: Connection, config_data: dict[str, Any], needs: HostNeeds | None, gpu: str | None, label: str,
           level: int, environ: dict[str, str]) -> None:
    """The child's life: build the engine, then serve the parent's calls until it says close (or is gone)."""
    # Ctrl-C reaches the terminal's whole process group; the parent decides what stops, and closes us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _take_environment(environ)
    logging.basicConfig(level=level, format=f"[{label}] %(levelname)s %(name)s: %(message)s")
    host = None
    try:
        from vrl.config import TrainConfig
        from vrl.generate import generator_class

        config = TrainConfig.model_validate(config_data)
        host = generator_class(config.generator.backend).engines(config, needs, [gpu])[0]
        conn.send(("ok", None))
        while True:
            try:
                op, args = conn.recv()
            except EOFError:  # the parent is gone
                return
            if op == "close":
                return
            if op == "abort":  # a stream the parent closed after its end had been sent
                continue
            try:
                if op == "sample":
                    if _stream(conn, host, *args):
                        return
                    continue
                if op == "publish":
                    args = (WeightStream(_buckets(conn)),)
                if op == "update":
                    from vrl.weights.update import update_from_wire

                    args = (update_from_wire(args[0]),)
                if op == "episodes":  # the run's environment, built here from its plugin and options
                    from vrl.episodes import Episodes
                    from vrl.plugins import environment_from_wire

                    args = (Episodes(environment_from_wire(args[0])),)
                result = getattr(host, op)(*args)
            except Exception as exc:  # noqa: BLE001 - the parent raises it
                conn.send(("err", _wire_error(exc)))
            else:
                conn.send(("ok", result))
    except (BrokenPipeError, ConnectionResetError, EOFError):  # the parent is gone
        return
    except BaseException as exc:  # building the engine failed: the parent raises it
        with contextlib.suppress(Exception):
            conn.send(("err", _wire_error(exc)))
    finally:
        if host is not None:
            host.close()


def _take_environment(environ: dict[str, str]) -> None:
    """The parent's environment at this child's start, as a spawned child has it (the fork server's is the
    parent's when the server started). Offline mode set since reaches what the server imported, as
    `vrl.hub.go_offline` makes it reach the parent's own imports."""
    if environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)
    from vrl import hub

    if hub.offline_requested():
        hub.go_offline()


def _buckets(conn: Connection) -> Iterator[list[tuple[str, Any]]]:
    """The buckets of a `publish`, asked of the parent one at a time (each once the last is loaded)."""
    while True:
        conn.send(("next", None))
        kind, bucket = conn.recv()
        if kind != "bucket":
            return
        yield bucket


def _stream(conn: Connection, host: PolicyHost, tasks: list[Task], variants: list[Variant], seed: int | None
            ) -> bool:
    """One `sample` call: every batch, then ("end",) or ("err", ...). The engine's stream is drawn in a
    thread of its own into a queue, so the engine keeps going while the parent is slow to read (a batch
    is larger than the pipe holds, and the parent reads beside its trainer); this thread only sends.
    After each batch sent, a message from the parent stops it (abort, or close): the stream stops after
    the batch it is on and what it queued is dropped. Returns whether the parent asked to close.

    At debug level (`vrl -v`) each call logs where its time went: the engine's stream, the sends (how
    long the parent took to take the batches), and how long after the engine's last batch the parent
    had them all."""
    batches: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
    stop = threading.Event()
    t0 = time.perf_counter()
    engine_done = [t0]  # when the engine's stream ended

    def produce() -> None:
        end: tuple[str, Any] = ("end", None)
        try:
            stream = host.sample(tasks, variants, seed)
            try:
                for batch in stream:
                    batches.put(("batch", batch))
                    if stop.is_set():
                        break
            finally:
                stream.close()
        except BaseException as exc:  # noqa: BLE001 - the parent raises it (and the sender must not wait forever)
            end = ("err", exc)
        engine_done[0] = time.perf_counter()
        batches.put(end)

    producer = threading.Thread(target=produce, name="vrl-driver-stream", daemon=True)
    producer.start()
    closing = False
    sent, sending = 0, 0.0
    try:
        while True:
            kind, value = batches.get()
            if kind == "batch":
                if stop.is_set():
                    continue  # the parent stopped reading batches
                t = time.perf_counter()
                conn.send(("batch", value))
                sent, sending = sent + 1, sending + time.perf_counter() - t
                if conn.poll():
                    closing = conn.recv()[0] == "close"
                    stop.set()
                continue
            conn.send(("err", _wire_error(value)) if kind == "err" and not stop.is_set() else ("end", None))
            end = time.perf_counter()
            log.debug("sample: %d batches; the engine's stream took %.3f s, sending them %.3f s; the parent had the "
                      "last %.3f s after the engine's end", sent, engine_done[0] - t0, sending, end - engine_done[0])
            return closing
    finally:  # also when the parent is gone: the engine is not left mid-stream in another thread
        stop.set()
        producer.join()
