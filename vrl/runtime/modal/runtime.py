"""The `modal` runtime: the trainer's loop unchanged, sampling fanned out to Modal GPU workers.

`ModalPolicy` is the run's `PolicyHost` in the orchestrator; the weights live on the workers, which
build the same host the local runtime builds (`generator.backend` vllm or hf) and keep it warm:

- Seeded perturbations (ES): the orchestrator keeps only the list of updates (seeds and
  coefficients, a few hundred bytes per iteration); each member is one call of the worker's
  `sample` with that list, and the worker replays the updates it has not seen yet, perturbs its
  engine for the member and samples it. Calls run concurrently on as many containers as Modal
  gives; each member's completions stream into verification the moment its call returns.
- Trained weights (GRPO): the orchestrator trains an in-process copy (`trainable`); `publish`
  writes it to the Volume and the next shard calls load it.
- Verification: a `SandboxPool` of warm verifier sandboxes (or the orchestrator, `verify_in: local`).

The tests run this runtime as it is under the Modal emulator (tests/modal_emulator/).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from vrl.config import Section
from vrl.policy import (
    HostNeeds,
    PerturbationSpec,
    PolicyHost,
    Trainable,
    Unsupported,
    Variant,
    WeightsInfo,
    WeightStream,
)
from vrl.runtime.base import Runtime, VerificationPool
from vrl.runtime.modal import workers
from vrl.runtime.modal.credentials import require_credentials
from vrl.runtime.modal.output import modal_output
from vrl.runtime.modal.sandbox import (
    ModalSandbox,
    SandboxPool,
    pool_size,
    sandbox_memory_mb,
    spec_for,
)
from vrl.runtime.modal.verification import SandboxVerification
from vrl.runtime.modal.volume import VolumeWeights
from vrl.runtime.modal.workers import worker_dtype
from vrl.types import Completion, Task
from vrl.verifier import Verifier, close_unused

log = logging.getLogger(__name__)


# -- how calls reach the GPU functions ---------------------------------------------------------------


class ModalCaller:
    """Spawns one call of a remote function per argument set and yields `(index, result)` as each call
    returns (any order); a call that failed after Modal's retries is yielded as its exception.

    Calls, not one `.map()`: a map's inputs keep running when its consumer stops (modal 1.6.4's map has no
    handle to cancel them), so an abandoned iteration (a failed shard, Ctrl-C, a lost verifier) would
    leave GPU containers working, billed, on results nobody reads. Closing the stream cancels every call
    still running.
    """

    def imap(self, function: Any, argsets: Sequence[tuple], kwargs: dict[str, Any]) -> Iterator[tuple[int, Any]]:
        if not argsets:
            return
        done: queue.Queue = queue.Queue()
        calls: list[Any] = []

        def wait(index: int, call: Any) -> None:
            try:
                done.put((index, call.get()))
            except BaseException as exc:  # noqa: BLE001 - the consumer decides what a failed call means
                done.put((index, exc))

        pending: set[int] = set()
        try:
            for index, args in enumerate(argsets):
                calls.append(function.spawn(*args, **kwargs))
                pending.add(index)
                threading.Thread(target=wait, args=(index, calls[-1]), daemon=True, name=f"modal-call-{index}").start()
            while pending:
                index, out = done.get()
                pending.discard(index)
                yield index, out
        finally:
            for index in sorted(pending):
                try:
                    calls[index].cancel()
                except Exception as exc:  # noqa: BLE001 - the iteration's own error is the one to report
                    log.warning("could not cancel Modal call %s: %s", calls[index].object_id, exc)

    def close(self) -> None:
        """Nothing runs in the background once a stream is closed (its calls are done or cancelled)."""


# -- the policy host of a Modal run -------------------------------------------------------------------


class ModalPolicy(PolicyHost):
    """The weights on Modal GPU workers; see the module docstring."""

    name = "modal"

    def __init__(self, caller: ModalCaller, worker: Any, config: Any, store: VolumeWeights,
                 before_sample: Callable[[], None] | None = None, put: Callable[[dict[str, bytes]], None] | None = None):
        self.caller, self.worker, self.config = caller, worker, config
        self.store = store  # where published weights go, by the Volume's rules (volume.py)
        self.before_sample = before_sample  # the detached orchestrator's check at each iteration's start
        self.spec: PerturbationSpec | None = None
        # Every seeded update so far (`to_wire` data): on the Volume once each (`put`), the newest in every call.
        self.log = workers.UpdateLog(f"{workers.RUNS_DIR}/{store.run}/{workers.ES_DIR}", put or (lambda files: None),
                                     config.runtime.modal.snapshot_every)
        self.updates = self.log.updates
        self.weights: str | None = None  # the Volume file of the last published weights
        self.version = 0
        self._trainable: Trainable | None = None
        self.calls = 0  # worker calls made (tests check the fan-out)
        self.replayed: list[int] = []  # updates each call applied (catching up included)
        self._last_sample: float | None = None
        self._warned_cold = False
        self.environment: dict[str, Any] | None = None  # the run's environment, where it answers back
        self.mounted: Path | None = None  # the Volume's mount, in a container (a local model's copy comes from it)

    def episodes(self, runner: Any) -> None:
        """Each worker samples whole episodes with its own instance of the run's environment, built from the
        run's plugin and options (`vrl.plugins.environment_wire`: one made in code is refused)."""
        from vrl.plugins import environment_wire

        self.environment = environment_wire(runner.environment, self.config, *ModalRuntime.episodes_elsewhere(self.config))

    # -- sampling ------------------------------------------------------------------------------------
    def sample(self, tasks: Sequence[Task], variants: Sequence[Variant], seed: int | None = None
               ) -> Iterator[list[Completion]]:
        if not tasks or not variants:
            return
        if self.before_sample is not None:
            self.before_sample()
        if any(v.seed is not None for v in variants) and self.spec is None:
            raise RuntimeError("seeded variants need perturbations(spec) first")
        self._check_warm()
        seeded = [v for v in variants if v.seed is not None]
        if seeded:
            self.log.flush()  # the updates a behind worker catches up from, before any call can need them
        shared = {
            "config": workers.engine_config(self.config),
            "tasks": workers.tasks_to_wire(tasks),
            "seed": seed,
            "spec": workers.spec_to_wire(self.spec),
            "es": self.log.head() if seeded else None,  # only what is new: the newest update and digests
            "weights": self.weights,
            **({"environment": self.environment} if self.environment is not None else {}),
        }
        size = self.config.sampling.batch_size
        argsets: list[tuple] = []
        per_call = self.members_per_call(len(seeded))
        for i in range(0, len(seeded), per_call):  # members: on as many containers as Modal gives
            group = [workers.variant_to_wire(v) for v in seeded[i:i + per_call]]
            argsets.append((group if per_call > 1 else group[0], 0, len(tasks), False))
        if argsets and self.log.snapshot_due():
            argsets[0] = (*argsets[0][:3], True)  # one call writes θ to the Volume for cold workers
        for v in variants:
            if v.seed is None:  # the current weights: shards of tasks
                argsets += [(workers.variant_to_wire(v), s, min(s + size, len(tasks)), False)
                            for s in range(0, len(tasks), size)]
        self.calls += len(argsets)
        members = -(-len(seeded) // per_call)  # the member calls come first
        for index, out in self.caller.imap(self.worker, argsets, shared):
            if isinstance(out, BaseException):
                if index < members:
                    # An ES member whose call failed after Modal's retries: the optimizer drops it (and its
                    # antithetic partner) if few enough are lost (es.max_lost_share), else fails the iteration.
                    log.warning("ES member call %d failed after Modal's retries; the member is dropped from this "
                                "iteration: %s: %s", index, type(out).__name__, out)
                    continue
                # A shard of the current weights (GRPO, eval): never scored without it; the stream's close
                # cancels the calls still running.
                log.error("a GPU worker call failed after Modal's retries, so this iteration is not scored "
                          "(resume the run once the cause is fixed): %s: %s", type(out).__name__, out)
                raise out
            if out["snapshot"]:
                self.log.snapshot = max(self.log.snapshot, out["snapshot"])
            self.replayed.append(out["replayed"])
            by_variant: dict[int, list[Completion]] = {}
            for c in out["completions"]:
                completion = workers.completion_from_wire(c)
                by_variant.setdefault(completion.variant, []).append(completion)
            yield from by_variant.values()

    def _check_warm(self) -> None:
        """Warn once when an iteration outlasts the workers' scale-down window: they go cold between
        iterations, and each cold one reloads the model and catches up from the Volume."""
        rt, now = self.config.runtime.modal, time.monotonic()
        last, self._last_sample = self._last_sample, now
        if last is not None and now - last > rt.scaledown_window_s and not rt.min_containers and not self._warned_cold:
            self._warned_cold = True
            log.warning("an iteration took %.0f s, longer than runtime.modal.scaledown_window_s=%d: GPU workers scale "
                        "down between iterations and start cold; raise it above the iteration time (at most 3600) or "
                        "set runtime.modal.min_containers", now - last, rt.scaledown_window_s)

    def members_per_call(self, members: int) -> int:
        """ES members per worker call: `runtime.modal.members_per_call`, or by default one for full-rank
        noise and, for low-rank, as many as share the containers (one engine pass serves several)."""
        rt = self.config.runtime.modal
        if rt.members_per_call:
            return rt.members_per_call
        if self.spec is None or self.spec.noise != "lowrank" or members == 0:
            return 1
        return -(-members // rt.max_containers)

    # -- seeded perturbations: the workers replay the update list ----------------------------------
    def perturbations(self, spec: PerturbationSpec) -> WeightsInfo:
        self.spec = spec
        return WeightsInfo(names=(), numel=0, dtype=worker_dtype(self.config), exportable=False)

    def update(self, update: Any) -> None:
        """Record a `vrl.weights.update` update (as its `to_wire` data) for the workers to replay."""
        if self.spec is None:
            raise RuntimeError("update before perturbations(spec)")
        self.log.append(update.to_wire())

    def state(self) -> dict[str, Any]:
        raise Unsupported("the Modal runtime keeps the weights on its workers")

    def load_state(self, state: dict[str, Any]) -> None:
        raise Unsupported("the Modal runtime keeps the weights on its workers")

    # -- trained weights: through the Volume -------------------------------------------------------
    def trainable(self) -> Trainable:
        if self._trainable is None:
            from vrl.generate.hf import HFGenerator

            config, folder = self.config, self.config.runtime.modal.model_folder
            if self.mounted is not None and folder is not None:  # a detached orchestrator: the local model's copy
                from vrl.runtime.modal.models import local_copy

                config = config.model_copy(update={"model": str(local_copy(self.mounted, folder)), "generator":
                                                   config.generator.model_copy(update={"revision": None})})
            local = HFGenerator.from_config(config)
            self._trainable = Trainable(local.model, local.tokenizer, self.config.sampling)
        return self._trainable

    def publish(self, model: Any) -> None:
        if isinstance(model, WeightStream):  # written as one file
            model = model.collect()
        self.version += 1
        self.weights = self.store.publish(model, self.version)

    def close(self) -> None:
        self.store.close()


# -- the runtime -----------------------------------------------------------------------------------------


class ModalConfig(Section):
    """The Modal runtime (`runtime.kind: modal`): GPU workers, verifier sandboxes, a Volume (docs/modal.md)."""

    app_name: str = Field("vrl", min_length=1, description="Modal app name (shown in the Modal dashboard).")
    gpu: str | list[str] = Field(
        "H100", min_length=1, description="GPU type of the generation functions, e.g. 'H100', 'A100-80GB', 'L40S'; or a "
        "list of types Modal tries in order (a fallback when the first is scarce), e.g. ['H100', 'A100-80GB'].")
    cpu: float = Field(4.0, gt=0, description="CPU cores reserved per GPU container.")
    memory_mb: int = Field(65536, ge=1024, description="Memory (MiB) reserved per GPU container.")
    timeout_s: int = Field(3600, ge=10, description="Wall-clock cap for one GPU call (an ES member or a generation shard).")
    retries: int = Field(2, ge=0, le=10, description="Retries of a failed GPU call (preemption, OOM) before the run fails.")
    max_containers: int = Field(
        30, ge=1, description="GPU containers at most (ES: members evaluated at once; GRPO: shards at once)."
    )
    scaledown_window_s: int = Field(
        1200, ge=2, le=3600, description="Seconds an idle GPU container stays warm (keeps the base weights and replayed "
        "ES state); above one iteration's time (`loop_s`) workers stay warm across iterations (a Lean iteration of the "
        "case study takes 538 s); the run warns when an iteration outlasts it.")
    min_containers: int = Field(
        0, ge=0, description="GPU containers Modal keeps running while the app runs (a run's app lives as long as the "
        "run): warm workers for the whole run, billed while idle; 0: only scaledown_window_s keeps them.")
    snapshot_every: int = Field(
        10, ge=0, description="ES: every this many updates one worker writes θ to the Volume; a cold or behind worker "
        "starts from the newest snapshot, so it replays at most this many updates (0: never; it replays from the base).")
    members_per_call: int = Field(
        0, ge=0, description="ES members sampled by one worker call; 0: one for es.noise=full, and for lowrank as many "
        "as share runtime.modal.max_containers (one engine pass serves several low-rank members).")
    volume: str = Field("vrl", min_length=1, description="Modal Volume holding base weights, the HF cache and run directories.")
    model_folder: str | None = Field(
        None, description="Where a local --model (a GGUF file, converted on this machine first, or a model folder) "
        "lies on the Volume: models/<content hash>, recorded by vrl when the run starts and uploaded once; the workers "
        "and a detached orchestrator load it from there (docs/modal.md). None: --model is a Hub id or tiny. A resumed "
        "run refuses a file whose content changed.")
    secrets: list[str] = Field(
        default_factory=list,
        description="Modal Secret names (e.g. 'huggingface'), mounted on `vrl modal prepare` and the detached "
        "orchestrator only; never on GPU workers or verifier sandboxes, never logged.",
    )
    detach: bool = Field(False, description="Run the orchestrator itself on Modal; the run directory lives on the Volume.")
    orchestrator_gpu: str | None = Field(
        None, description="GPU for the detached orchestrator (GRPO trains there); None: CPU only (ES needs none)."
    )
    orchestrator_timeout_s: int = Field(
        86400, ge=60, le=86400, description="Function timeout of one detached orchestrator call (Modal's maximum is "
        "24 h); before it, the orchestrator saves and continues the run in a new call."
    )
    verify_in: Literal["sandbox", "local"] = Field(
        "sandbox", description="'sandbox': verifiers run in Modal Sandboxes; 'local': in the orchestrator process."
    )
    sandboxes: int = Field(0, ge=0, description="Verifier sandboxes in the pool; 0: sized from the batch.")
    sandbox_mode: Literal["pool", "per_attempt"] = Field(
        "pool", description="'pool': long-lived warm sandboxes; 'per_attempt': a fresh sandbox for every attempt."
    )
    sandbox_cpu: float = Field(2.0, gt=0, description="CPU cores per verifier sandbox.")
    sandbox_memory_mb: int = Field(8192, ge=256, description="Memory (MiB) per verifier sandbox.")
    sandbox_timeout_s: int = Field(
        86400, ge=60, le=86400, description="Lifetime of a verifier sandbox (Modal's limit: 24 h); the pool replaces "
        "one a minute before it. Long: each replacement pays a start (a Lean sandbox imports Mathlib); the idle "
        "timeout, not this, ends the sandboxes of an orchestrator that died.")
    sandbox_idle_timeout_s: int = Field(
        600, ge=10, description="A verifier sandbox nobody writes to for this long ends (Modal's idle_timeout: only stdin "
        "writes count, not the sandbox's own work), so a dead orchestrator's sandboxes go away; while the run lives the "
        "pool pings idle ones, and writes a keep-alive line to busy ones (a long batch, a Lean warm-up), three times "
        "as often.")
    sandbox_start_timeout_s: float = Field(
        600.0, gt=0, description="How long a sandbox may take to become healthy (a Lean server imports Mathlib)."
    )
    block_network: bool = Field(True, description="Verifier sandboxes get no network (model-written code runs there).")
    output: bool = Field(
        True, description="Show Modal's own output (image builds, container logs) while this machine runs the app "
        "(modal.enable_output()); `vrl modal ... --quiet` turns it off. Inside a container Modal keeps the logs "
        "(`modal app logs`).")


class ModalRuntime(Runtime):
    """Sampling on Modal GPU workers, verification in Modal sandboxes; see the module docstring."""

    name = "modal"
    Config = ModalConfig
    weights_here = False  # the workers load the weights from the Volume
    runs_episodes = True  # each worker runs the episodes it samples (`ModalPolicy.episodes`)

    @classmethod
    def episodes_elsewhere(cls, config: Any) -> tuple[str, str]:
        return "the Modal workers", "run with --set runtime.kind=local"

    def __init__(self, config: Any, *, app: Any, worker: Any = None, volume_root: str | Path | None = None,
                 in_container: bool = False):
        self.config, self.in_container = config, in_container
        if not in_container:
            require_credentials()
        self.app = app
        self.volume_root = Path(volume_root or workers.VOLUME_ROOT)
        self.worker = worker or app.sample  # the GPU function's handle
        self.caller = ModalCaller()
        self._stack = contextlib.ExitStack()
        self._running = False
        self._lock = threading.Lock()
        self.sandbox_pool: SandboxPool | None = None
        self.before_sample: Callable[[], None] | None = None  # set by the detached orchestrator (detached.py)

    @classmethod
    def from_config(cls, config: Any) -> ModalRuntime:
        """Credentials first (one line saying how to set them up), then the run's app."""
        from vrl.runtime.modal.app import build_app

        require_credentials()  # before building anything
        return cls(config, app=build_app(config))

    @classmethod
    def verifies_in_process(cls, config: Any) -> bool:
        return config.runtime.modal.verify_in == "local"

    @classmethod
    def check(cls, config: Any) -> None:
        """Refused before anything starts: a local --model that cannot go to the Volume (`models.place`, which
        records its Volume folder in `runtime.modal.model_folder`); episodes whose turns the environment's own verifier judges
        (`vrl.repair.RepairEpisodes` with more than one turn: proof repair, test-report repair). On Modal a
        worker runs its episodes beside its engine, and no verifier runs there (a Lean server and its
        re-check, a bubblewrap sandbox for model code: those are in the verifier sandboxes), so each repair
        turn would fail, or judge model code in a GPU container that mounts the Volume."""
        from vrl.errors import UsageError
        from vrl.plugins import registry
        from vrl.repair import RepairEpisodes
        from vrl.runtime.modal.models import place

        place(config)
        env = registry().environment(config.plugin, **config.env_options)
        if isinstance(env, RepairEpisodes) and env.multi_turn:
            raise UsageError(f"environment {env.name!r} judges every turn of its episodes with its verifier (-o turns="
                             f"{env.turns}: repair), and on Modal episodes run in the GPU workers, where no verifier "
                             "runs; use -o turns=1 on Modal, or --set runtime.kind=local for repair")

    def _ensure_running(self) -> None:
        """Start the ephemeral Modal app (once) when orchestrating from this machine."""
        with self._lock:
            if self._running or self.in_container:
                return
            self._stack.enter_context(modal_output(self.config.runtime.modal.output))
            self._stack.enter_context(self.app.app.run())
            self._running = True

    def policy(self, config: Any, needs: HostNeeds | None = None) -> PolicyHost:
        self._ensure_running()
        run = config.logging.name or "run"
        policy = ModalPolicy(self.caller, self.worker, config, self._weights_store(run), self.before_sample,
                             put=self._put_files)
        if self.in_container:  # the detached orchestrator: a local model is on the Volume already
            policy.mounted = self.volume_root
        elif config.runtime.modal.model_folder is not None:  # a local model (models.py): uploaded once, before the
            import modal  # first worker call (the app runs, so its Volume exists)

            from vrl.runtime.modal.models import upload

            upload(config, modal.Volume.from_name(config.runtime.modal.volume))
        return policy

    def _put_files(self, files: dict[str, bytes]) -> None:
        """Files onto the Volume for the workers (ES updates): one batch upload, allowed from anywhere and
        committed at once."""
        import io

        import modal

        with modal.Volume.from_name(self.config.runtime.modal.volume).batch_upload(force=True) as batch:
            for rel, data in files.items():
                batch.put_file(io.BytesIO(data), rel)

    def _weights_store(self, run: str) -> VolumeWeights:
        """Inside a container: write the mounted Volume and commit; on this machine: upload (Modal allows
        `commit()` only in a container)."""
        import modal

        volume = modal.Volume.from_name(self.config.runtime.modal.volume)
        return VolumeWeights(run, volume=volume, root=self.volume_root if self.in_container else None)

    def verification(self, verifier: Verifier | None, config: Any, attempts_per_iteration: int | None = None
                     ) -> VerificationPool:
        v, rt = config.verifier, config.runtime.modal
        if rt.verify_in == "local":
            if verifier is None:
                raise ValueError("runtime.modal.verify_in=local judges attempts in this process: pass its verifier")
            return VerificationPool(verifier, batch_size=v.batch_size, concurrency=v.concurrency, timeout_s=v.timeout_s)
        # The sandboxes run their own copy of the plugin's verifier; a local one is not needed.
        if verifier is not None:
            close_unused(verifier)
        self.sandbox_pool = self.sandboxes(config, attempts_per_iteration)
        # The pool bounds each request and start itself; an infrastructure failure fails the iteration.
        return SandboxVerification(self.sandbox_pool, batch_size=v.batch_size, concurrency=v.concurrency)

    def sandboxes(self, config: Any, attempts_per_iteration: int | None = None) -> SandboxPool:
        """The verifier sandbox pool for this run, sized from the iteration's attempts."""
        from vrl.plugins import registry

        rt, v = config.runtime.modal, config.verifier
        attempts = attempts_per_iteration or config.tasks_per_iteration
        size = pool_size(attempts, v.batch_size, v.concurrency, rt.sandboxes)
        env = registry().environment(config.plugin, **config.env_options)
        spec = spec_for(env, config.plugin, config.env_options)
        from vrl.runtime.modal.images import plugin_for_environment, verifier_recipe

        image = verifier_recipe(plugin_for_environment(config.plugin), base=spec.image, apt=spec.apt).build()
        argv = spec.command("python", rt.sandbox_start_timeout_s)
        memory_mb = sandbox_memory_mb(spec, rt.sandbox_memory_mb)

        def factory():
            # In the detached orchestrator `app` is None: Modal then uses the container's own app.
            return ModalSandbox(self.app.app if self.app is not None else None, image, argv, cpu=rt.sandbox_cpu,
                                memory_mb=memory_mb,
                                timeout_s=rt.sandbox_timeout_s, block_network=rt.block_network and not spec.network,
                                workdir=spec.workdir, env=spec.env, idle_timeout_s=rt.sandbox_idle_timeout_s)

        lifetime = max(30.0, rt.sandbox_timeout_s - 60.0)  # replace before Modal ends it
        return SandboxPool(factory, size, mode=rt.sandbox_mode, request_timeout_s=v.timeout_s,
                           start_timeout_s=rt.sandbox_start_timeout_s, lifetime_s=lifetime,
                           keepalive_s=rt.sandbox_idle_timeout_s / 3)

    def close(self) -> None:
        """Stop background callers and the ephemeral app."""
        self.caller.close()
        self._stack.close()
        self._running = False
