"""The Modal app of a run: per-role images, the GPU worker, `prepare_model`, the detached orchestrator.

Built from the run's `runtime.modal` section (`ModalConfig`: GPU type, timeouts, retries, containers are settings, so the
functions are declared when the app is built, with `serialized=True`). Each role sits next to its
image, in the spirit of modal-labs' examples::

    sample             gpu image, gpu=runtime.modal.gpu, Volume at /vrl, no secrets:
                       one variant on a shard of tasks, on the host the local runtime would build
                       (vllm or hf): an ES member (seed + the run's updates, replayed warm) or the
                       current weights (GRPO, eval; trained weights from the Volume) -> completions
    prepare_model      orchestrator image, CPU only, Volume, secrets: base weights + tokenizer of a Hub id onto the
                       Volume (a local model is uploaded from the user's machine instead: models.py)
    orchestrate        orchestrator image (+ optional GPU for GRPO), Volume, secrets: the detached loop
    stop_app           orchestrator image, a quarter core: stops a detached run's app after its last call
    verifier sandboxes verifier image per plugin, block_network, no secrets (created by the runtime)
"""

from dataclasses import dataclass, field
from typing import Any

from vrl.runtime.modal import workers
from vrl.runtime.modal.images import ImageRecipe, gpu_recipe, orchestrator_recipe, requested_plugins

PREPARE_TIMEOUT_S = 3 * 3600
STOP_WAIT_S = 600.0
"""How long `stop_app` waits for the run's call to return. A call still running then (Modal re-runs a
preempted or crashed input under the same call id) is no end: `stop_app` leaves the app alone, and the
call spawns another `stop_app` when it really ends."""


def gpu_options(runtime: Any) -> dict[str, Any]:
    """The keyword options the GPU worker is declared with (from the run's `runtime.modal` section)."""
    return {
        "gpu": runtime.gpu,
        "cpu": runtime.cpu,
        "memory": runtime.memory_mb,
        "timeout": runtime.timeout_s,
        "retries": runtime.retries,
        "max_containers": runtime.max_containers,
        "scaledown_window": runtime.scaledown_window_s,
        # kept warm while the app runs (a run's ephemeral app: the run)
        **({"min_containers": runtime.min_containers} if runtime.min_containers else {}),
    }


def orchestrator_options(runtime: Any) -> dict[str, Any]:
    """The detached orchestrator's options: long timeout (it continues itself in a new call before it),
    optional GPU (GRPO's learner), no retries, and not preemptible where Modal allows it (a CPU function;
    a GPU one is restarted on the same input and resumes its run: detached.py)."""
    return {"gpu": runtime.orchestrator_gpu, "timeout": runtime.orchestrator_timeout_s, "retries": 0, "cpu": 2.0,
            "nonpreemptible": not runtime.orchestrator_gpu,
            # a GPU orchestrator trains (GRPO's learner): the workers' memory, not Modal's small default
            **({"memory": runtime.memory_mb} if runtime.orchestrator_gpu else {})}


@dataclass
class ModalApp:
    """A built app and its parts, so callers (and tests) can reach each role."""

    app: Any
    recipes: dict[str, ImageRecipe]
    images: dict[str, Any]
    volume: Any
    secrets: list[Any]
    sample: Any
    prepare_model: Any
    orchestrate: Any
    stop_app: Any
    options: dict[str, dict[str, Any]] = field(default_factory=dict)


def build_app(config: Any) -> ModalApp:
    """Declare the Modal app for `config` (a `TrainConfig`). Needs `pip install 'vrl-core[modal]'`; no account."""
    try:
        import modal
    except ImportError as exc:  # pragma: no cover - the extra is installed in tests
        raise RuntimeError("the Modal runtime needs the modal package: pip install 'vrl-core[modal]'") from exc

    rt = config.runtime.modal
    plugins = requested_plugins(config)  # the run's plugins only, installed in each image as distributions
    recipes = {"gpu": gpu_recipe(plugins),
               "orchestrator": orchestrator_recipe(plugins, gpu=bool(rt.orchestrator_gpu), verifies=rt.verify_in == "local")}
    images = {role: recipe.build() for role, recipe in recipes.items()}
    volume = modal.Volume.from_name(rt.volume, create_if_missing=True)
    secrets = [modal.Secret.from_name(name) for name in rt.secrets]
    root = workers.VOLUME_ROOT
    app = modal.App(rt.app_name)
    opts = {"gpu": gpu_options(rt), "orchestrator": orchestrator_options(rt)}

    # The Hub switches are read when huggingface_hub is imported, so they are set for the container.
    # A plain function, not a class: its handle crosses call boundaries (the detached orchestrator gets it as
    # an argument), and modal 1.6.4's serializer drops a class handle's metadata, so an `Obj` argument fails
    # to deserialize in the container. The warm state lives in the module (`workers._WARM`), one per container.
    @app.function(image=images["gpu"], volumes={root: volume}, env=workers.volume_env(root), serialized=True,
                  name="sample", **opts["gpu"])
    def sample(variant: dict | list, start: int, stop: int, write_snapshot: bool = False, *, config: dict,
               tasks: list, seed: int | None, spec: dict | None = None, es: dict | None = None,
               weights: str | None = None, environment: dict | None = None, probe: bool = False) -> dict:
        """Generation on one GPU; warm across calls (base weights, replayed ES state, loaded shards)."""
        if probe:  # `vrl modal doctor`: what this image holds, and whether CUDA sees the GPU
            return workers.environment_report(gpu=True)
        if weights or not workers.model_visible(config, root):
            # New GRPO weights, or a local model uploaded, after this container mounted the Volume.
            _reload(root)
        # ES: a worker that is behind reloads to see the newest updates; a θ snapshot it writes is committed.
        return workers.sample_call(variant, start, stop, write_snapshot, config=config, tasks=tasks, seed=seed,
                                   spec=spec, es=es, weights=weights, root=root, environment=environment,
                                   reload=lambda: _reload(root), commit=lambda: _commit(root))

    volume_name = rt.volume

    def _reload(mount: str) -> None:
        if mount == workers.VOLUME_ROOT:  # only inside Modal; a local run reads the directory itself
            modal.Volume.from_name(volume_name).reload()

    def _commit(mount: str) -> None:
        if mount == workers.VOLUME_ROOT:
            modal.Volume.from_name(volume_name).commit()

    # The CPU image: downloading and checking the tokenizer needs no vllm (nor the GPU image's build).
    @app.function(image=images["orchestrator"], volumes={root: volume}, secrets=secrets, timeout=PREPARE_TIMEOUT_S,
                  cpu=2.0, memory=8192, serialized=True, name="prepare_model")
    def prepare_model(model: str, revision: str | None = None, mount: str = workers.VOLUME_ROOT) -> dict:
        info = workers.prepare_model(model, revision, mount)
        if mount == workers.VOLUME_ROOT:
            modal.Volume.from_name(volume_name).commit()
        return info

    @app.function(image=images["orchestrator"], volumes={root: volume}, secrets=secrets, serialized=True,
                  env=workers.volume_env(root, offline=False),  # datasets may still come from the Hub
                  name="orchestrate", **opts["orchestrator"])
    def orchestrate(config_data: dict, resume: bool = False, worker: Any = None, orchestrator: Any = None,
                    predecessor: str | None = None, app_id: str | None = None, stopper: Any = None,
                    probe: str | None = None) -> dict:
        # `worker` (the `sample` function), `orchestrator` (this function) and `stopper` (`stop_app`): Function
        # handles, passed in because a closure cannot hold them before the app runs; the loop continues
        # itself in a new call, and the last call has the app (`app_id`) stopped once it has returned.
        if probe is not None:  # `vrl modal doctor`: the arguments arrived; the Volume and the worker answer
            return workers.in_orchestrator(root, probe, worker, reload=lambda: _reload(root),
                                           commit=lambda: _commit(root))
        from vrl.runtime.modal.detached import run_on_modal

        return run_on_modal(config_data, root, worker, resume=resume, volume=volume_name, orchestrator=orchestrator,
                            predecessor=predecessor, timeout_s=opts["orchestrator"]["timeout"], app_id=app_id,
                            stopper=stopper)

    wait_s = STOP_WAIT_S

    @app.function(image=images["orchestrator"], serialized=True, name="stop_app", cpu=0.25,
                  timeout=int(wait_s) + 300, retries=0)
    def stop_app(app_id: str, call_id: str) -> bool:
        """Stop the detached run's app once its last call has finished (its result stays readable), so no
        GPU container idles, billed, through its scale-down window after the run. Returns whether it did."""
        try:
            modal.FunctionCall.from_id(call_id).get(timeout=wait_s)
        except TimeoutError:  # the builtin (modal's poll): the call runs on, e.g. Modal restarted its input
            return False
        except Exception:  # noqa: BLE001 - failed or cancelled: finished either way
            pass
        modal.App.lookup(app_id).stop()
        return True

    return ModalApp(app, recipes, images, volume, secrets, sample, prepare_model, orchestrate, stop_app, opts)
