"""The `modal` runtime: the trainer's loop unchanged, generation fanned out to Modal GPU functions.

- ES: the orchestrator keeps only the history (`RemoteES`, no weights); for each iteration all N
  members are launched at once with `.map()` over the GPU worker's `es_member`; each member's
  completions stream into verification as soon as they arrive.
- GRPO: the orchestrator trains (locally, or on a GPU when detached); generation shards go to
  `generate_shard`; after each update the weights are written to the Volume and the shards reload.
- Verification: a `SandboxPool` of warm verifier sandboxes (or the orchestrator, `verify_in: local`).

`execute="local"` runs the very same function bodies in this process through Modal's `.local()`
(and local processes for sandboxes): how the tests check the runtime without a Modal account.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vrl.generate.base import Generator
from vrl.optim.base import Optimizer, Variant
from vrl.optim.es import ES, BaseModelRef, ESHistory
from vrl.runtime.base import Runtime, VerificationPool
from vrl.runtime.modal import workers
from vrl.runtime.modal.sandbox import ModalSandbox, ProcessSandbox, SandboxPool, pool_size, spec_for
from vrl.types import Completion, Task
from vrl.verifier import Verifier

log = logging.getLogger(__name__)


# -- how calls reach the GPU functions ---------------------------------------------------------------


class Caller:
    """Fans calls of one remote method out; returns a future per call, in input order."""

    def map(self, method: Any, argsets: Sequence[tuple], kwargs: dict[str, Any]) -> list[concurrent.futures.Future]:
        raise NotImplementedError

    def close(self) -> None:
        """Stop background work."""


class ModalCaller(Caller):
    """`method.map(...)` on Modal, drained by a background thread into futures (outputs in order)."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="vrl-modal-map")

    def map(self, method: Any, argsets: Sequence[tuple], kwargs: dict[str, Any]) -> list[concurrent.futures.Future]:
        futures = [concurrent.futures.Future() for _ in argsets]
        columns = [list(col) for col in zip(*argsets)] if argsets else []

        def drain() -> None:
            i = 0
            try:
                for i, out in enumerate(method.map(*columns, kwargs=kwargs, order_outputs=True, return_exceptions=True)):
                    if isinstance(out, BaseException):
                        futures[i].set_exception(out)
                    else:
                        futures[i].set_result(out)
            except Exception as exc:  # noqa: BLE001 - the map itself failed: every unfinished call fails with it
                for f in futures:
                    if not f.done():
                        f.set_exception(exc)

        self._pool.submit(drain)
        return futures

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class LocalCaller(Caller):
    """Runs each call's body in this process with Modal's `.local()`, one at a time, in order.

    One thread, because the warm state (the ES replica) is per process, as in one container.
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vrl-modal-local")

    def map(self, method: Any, argsets: Sequence[tuple], kwargs: dict[str, Any]) -> list[concurrent.futures.Future]:
        return [self._pool.submit(method.local, *args, **kwargs) for args in argsets]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# -- ES with the weights on the workers -------------------------------------------------------------------


class _NoWeights:
    """Stands in for ES's flat parameters in the orchestrator: updates happen by replay on the workers."""

    names: tuple[str, ...] = ()
    numel = 0

    def __init__(self, dtype: str):
        self.dtype = dtype

    def perturb(self, seed: int, sign: int, sigma: float) -> None:
        pass

    def restore(self) -> None:
        pass

    def update(self, terms: Any) -> None:
        pass

    def state(self) -> dict:
        raise RuntimeError("the Modal runtime keeps no ES weights in the orchestrator; es.snapshot_every must be 0")


class RemoteES(ES):
    """ES whose state is only its history: tell/save/load/resume as in `ES`, weights on the GPU workers."""

    def __init__(self, config: Any, seed: int, base: dict[str, Any], dtype: str):
        if config.snapshot_every:
            raise ValueError(
                "es.snapshot_every needs the weights in the orchestrator; on Modal the workers rebuild θ from the "
                "history (and stay warm across iterations). Set es.snapshot_every=0."
            )
        super().__init__(config, seed=seed, base=base)
        self.dtype = dtype

    def setup(self, generator: Any) -> None:
        self.generator = generator
        c = self.config
        self.params = _NoWeights(self.dtype)  # type: ignore[assignment]
        self.history = ESHistory(
            base=BaseModelRef(**{**self.base, "dtype": self.dtype}), sigma=c.sigma, alpha=c.step_size,
            population_size=c.population_size, antithetic=c.antithetic, normalization=c.normalization,
            include=list(c.include), exclude=list(c.exclude),
        )
        if hasattr(generator, "bind"):
            generator.bind(self)

    @contextlib.contextmanager
    def activate(self, variant: Variant) -> Iterator[None]:
        # The member's perturbation is applied on its worker; nothing changes here.
        yield

    @property
    def members(self) -> list[Variant] | None:
        """The variants of the iteration in progress (between ask and tell)."""
        return self._variants


def _worker_dtype(config: Any) -> str:
    """The dtype workers load the base model in (recorded in the ES history)."""
    dtype = config.generator.dtype
    if dtype != "auto":
        return dtype
    return "bfloat16" if config.generator.device != "cpu" else "float32"


class ESMemberGenerator(Generator):
    """Generation for `RemoteES`: on the first request of an iteration, every member is launched."""

    def __init__(self, caller: Caller, method: Any, sampling: Any):
        self.caller, self.method, self.sampling = caller, method, sampling
        self.es: RemoteES | None = None
        self._key: tuple | None = None
        self._futures: list[concurrent.futures.Future] = []
        self.launches = 0

    def bind(self, es: RemoteES) -> None:
        self.es = es

    def stream(self, tasks: Sequence[Task], n: int = 1, variant: int = 0, seed: int | None = None) -> Iterator[list[Completion]]:
        if self.es is None or self.es.members is None or self.es.history is None:
            raise RuntimeError("ESMemberGenerator needs a RemoteES that has asked for this iteration's members")
        members, history = self.es.members, self.es.history
        key = (len(history.iterations), tuple(t.id for t in tasks), n, seed, tuple((m.seed, m.sign) for m in members))
        if key != self._key:
            shared = {
                "history": history.model_dump(mode="json"),
                "tasks": workers.tasks_to_wire(tasks),
                "sampling": self.sampling.model_dump(mode="json"),
                "sample_seed": seed,
                "n": n,
            }
            argsets = [(m.seed, m.sign, m.index) for m in members]
            self._futures, self._key = self.caller.map(self.method, argsets, shared), key
            self.launches += 1
        yield [workers.completion_from_wire(c) for c in self._futures[variant].result()]


class ShardGenerator(Generator):
    """GRPO / eval generation: shards of tasks to `generate_shard`; weights reach workers via the Volume.

    The orchestrator keeps a local model (`model`, `tokenizer`: GRPO trains it); `sync_weights`
    writes it to `weights_dir` and the next shards load that file.
    """

    def __init__(self, caller: Caller, method: Any, config: Any, weights_dir: Path, commit: Any = None):
        from vrl.generate.hf import HFGenerator

        self.caller, self.method, self.sampling = caller, method, config.sampling
        local = HFGenerator.from_config(config)
        self.model, self.tokenizer = local.model, local.tokenizer
        self.ref = {"model": config.model, "revision": config.generator.revision,
                    "dtype": _worker_dtype(config), "weights": None}
        self.weights_dir, self.version, self._commit = Path(weights_dir), 0, commit

    def stream(self, tasks: Sequence[Task], n: int = 1, variant: int = 0, seed: int | None = None) -> Iterator[list[Completion]]:
        size = self.sampling.batch_size
        argsets = [
            (workers.tasks_to_wire(tasks[start : start + size]), None if seed is None else seed + start)
            for start in range(0, len(tasks), size)
        ]
        kwargs = {"model": dict(self.ref), "n": n, "variant": variant, "sampling": self.sampling.model_dump(mode="json")}
        for future in self.caller.map(self.method, argsets, kwargs):
            yield [workers.completion_from_wire(c) for c in future.result()]

    def sync_weights(self) -> None:
        self.version += 1
        path = workers.save_weights(self.model, self.weights_dir / f"v{self.version:06d}.safetensors")
        if self._commit is not None:
            self._commit()
        self.ref["weights"] = str(path)
        for old in sorted(self.weights_dir.glob("v*.safetensors"))[:-2]:
            old.unlink()


# -- the runtime -----------------------------------------------------------------------------------------


class ModalRuntime(Runtime):
    """Generation on Modal GPU functions, verification in Modal sandboxes; see the module docstring."""

    name = "modal"

    def __init__(self, config: Any, *, app: Any = None, worker: Any = None, execute: str = "modal",
                 volume_root: str | Path | None = None, in_container: bool = False):
        if execute not in ("modal", "local"):
            raise ValueError(f"execute={execute!r}; choose modal or local")
        self.config, self.execute, self.in_container = config, execute, in_container
        if execute == "modal" and not in_container:
            from vrl.runtime.modal.launch import require_credentials

            require_credentials()
        if app is None and worker is None:
            from vrl.runtime.modal.app import build_app

            app = build_app(config)
        self.app = app
        self.volume_root = Path(volume_root or workers.VOLUME_ROOT)
        self.worker = worker or app.worker(str(self.volume_root) if execute == "local" else workers.VOLUME_ROOT)
        self.caller: Caller = LocalCaller() if execute == "local" else ModalCaller()
        self._stack = contextlib.ExitStack()
        self._running = False
        self._lock = threading.Lock()
        self.sandbox_pool: SandboxPool | None = None

    def _ensure_running(self) -> None:
        """Start the ephemeral Modal app (once) when orchestrating from this machine."""
        with self._lock:
            if self._running or self.execute == "local" or self.in_container:
                return
            self._stack.enter_context(self.app.app.run())
            self._running = True

    def optimizer(self, config: Any) -> Optimizer:
        if config.optimizer == "es":
            base = {"model": config.model, "revision": config.generator.revision}
            return RemoteES(config.es, seed=config.seed, base=base, dtype=_worker_dtype(config))
        return super().optimizer(config)

    def generator(self, config: Any) -> Generator:
        self._ensure_running()
        if config.generator.backend != "hf":
            raise ValueError("the Modal workers generate with the hf backend for now; set generator.backend=hf")
        if config.optimizer == "es":
            gen: Generator = ESMemberGenerator(self.caller, self.worker.es_member, config.sampling)
        else:
            run = config.logging.name or "run"
            weights_dir = self.volume_root / workers.RUNS_DIR / run / "weights"
            gen = ShardGenerator(self.caller, self.worker.generate_shard, config, weights_dir, self._commit_volume())
        return _Closing(gen, self)

    def _commit_volume(self) -> Any:
        if self.execute == "local" or self.app is None:
            return None
        return self.app.volume.commit

    def verification(self, verifier: Verifier, config: Any) -> VerificationPool:
        v, rt = config.verifier, config.runtime
        if rt.verify_in == "local":
            return VerificationPool(verifier, batch_size=v.batch_size, concurrency=v.concurrency, timeout_s=v.timeout_s)
        # The sandboxes run their own copy of the plugin's verifier; the local one is not needed.
        _close_quietly(verifier)
        self.sandbox_pool = self.sandboxes(config)
        # The first batch also waits for the pool to start (a Lean server imports Mathlib).
        outer = v.timeout_s + rt.sandbox_start_timeout_s
        return VerificationPool(self.sandbox_pool, batch_size=v.batch_size, concurrency=v.concurrency, timeout_s=outer)

    def sandboxes(self, config: Any) -> SandboxPool:
        """The verifier sandbox pool for this run, sized from the iteration's attempts."""
        from vrl.plugins import registry

        rt, v = config.runtime, config.verifier
        per_task = config.es.population_size if config.optimizer == "es" else config.grpo.num_generations
        size = pool_size(config.tasks_per_iteration * per_task, v.batch_size, v.concurrency, rt.sandboxes)
        env = registry().environment(config.plugin, **config.env_options)
        spec = spec_for(env, config.plugin, config.env_options)
        if self.execute == "local":
            def factory():
                return ProcessSandbox.for_spec(spec, rt.sandbox_start_timeout_s)
        else:
            from vrl.runtime.modal.images import plugin_for_environment, verifier_recipe

            image = verifier_recipe(plugin_for_environment(config.plugin), base=spec.image).build()
            argv = spec.command("python", rt.sandbox_start_timeout_s)

            def factory():
                return ModalSandbox(self.app.app, image, argv, cpu=rt.sandbox_cpu, memory_mb=rt.sandbox_memory_mb,
                                    timeout_s=rt.sandbox_timeout_s, block_network=rt.block_network and not spec.network,
                                    workdir=spec.workdir, env=spec.env)
        lifetime = max(30.0, rt.sandbox_timeout_s - 60.0)  # replace before Modal ends it
        return SandboxPool(factory, size, mode=rt.sandbox_mode, request_timeout_s=v.timeout_s,
                           start_timeout_s=rt.sandbox_start_timeout_s, lifetime_s=lifetime)

    def close(self) -> None:
        """Stop background callers and the ephemeral app."""
        self.caller.close()
        self._stack.close()
        self._running = False


class _Closing(Generator):
    """Forwards to a generator and shuts the runtime down when the trainer closes it (last)."""

    def __init__(self, inner: Generator, runtime: ModalRuntime):
        self.inner, self.runtime = inner, runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def stream(self, tasks, n=1, variant=0, seed=None):
        return self.inner.stream(tasks, n=n, variant=variant, seed=seed)

    def sync_weights(self) -> None:
        self.inner.sync_weights()

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.runtime.close()


def _close_quietly(verifier: Verifier) -> None:
    import asyncio

    try:
        asyncio.run(verifier.aclose())
    except Exception as exc:  # noqa: BLE001 - closing an unused verifier must not stop the run
        log.debug("closing the unused local verifier: %s", exc)
