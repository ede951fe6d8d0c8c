"""The bodies of the Modal functions, as plain Python: what runs inside a GPU or orchestrator container.

Nothing here imports `modal`, so every body runs (and is tested) on any machine; `app.py` wraps them
in Modal functions. Arguments and results are JSON-able (tasks, histories and completions cross the
Modal boundary as dicts). Workers load weights from the Volume (`root`), never from the Hub.

Volume layout (mounted at `VOLUME_ROOT` in Modal containers)::

    hf/                      Hugging Face cache (`vrl modal prepare` fills it; workers read it offline)
    models/<key>/            local models (a GGUF file's conversion, a model folder), by content (models.py)
    runs/<name>/             run directories of detached runs (metrics, es_history.json, state)
    runs/<name>/es/          ES updates (updates/<n>.json) and θ snapshots (theta/<n>.safetensors) workers catch up from
    runs/<name>/weights/vN/  GRPO weights after update N (the shard workers reload them)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import platform
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vrl.fileio import atomic_path
from vrl.local_model import MODEL_FILES  # what goes to the Volume (a Hub snapshot, a local folder)
from vrl.policy import HostNeeds, PerturbationSpec, Variant
from vrl.types import Completion, Task

log = logging.getLogger(__name__)

VOLUME_ROOT = "/vrl"
HF_DIR = "hf"
RUNS_DIR = "runs"
MODELS_DIR = "models"


def volume_env(root: str | os.PathLike = VOLUME_ROOT, offline: bool = True) -> dict[str, str]:
    """A container's environment: the Volume's HF cache; `offline` switches the Hub off (GPU workers).

    Set at container start, because huggingface_hub reads these variables when it is imported.
    """
    env = {"HF_HUB_CACHE": str(Path(root) / HF_DIR)}
    if offline:
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def model_visible(config: dict[str, Any], root: str | os.PathLike = VOLUME_ROOT) -> bool:
    """False when the call's model is a local model's folder on the Volume (models.py) that this container does
    not see yet (uploaded after it mounted the Volume: it reloads first)."""
    model = str(config.get("model", ""))
    return not model.startswith(f"{Path(root)}/{MODELS_DIR}/") or Path(model).is_dir()


# -- wire formats --------------------------------------------------------------------------------


_KEPT_OUT = tuple(name for name, f in Completion.model_fields.items() if f.exclude)
"""Fields a completion's JSON leaves out (samples.jsonl does not show them) that cross the wire all the same:
token ids, log-probs, an episode's token mask (GRPO trains on exactly these)."""


def completion_to_wire(c: Completion) -> dict[str, Any]:
    """A completion as JSON, every field included (`_KEPT_OUT` too)."""
    data = c.model_dump(mode="json")
    data.update({name: getattr(c, name) for name in _KEPT_OUT})
    return data


def completion_from_wire(data: dict[str, Any]) -> Completion:
    return Completion(**data)


def tasks_to_wire(tasks: Sequence[Task]) -> list[dict[str, Any]]:
    return [t.model_dump(mode="json") for t in tasks]


def tasks_from_wire(rows: Sequence[dict[str, Any]]) -> list[Task]:
    return [Task.model_validate(r) for r in rows]


def variant_to_wire(v: Variant) -> dict[str, Any]:
    return {"index": v.index, "samples_per_task": v.samples_per_task, "seed": v.seed, "sign": v.sign}


def spec_to_wire(spec: PerturbationSpec | None) -> dict[str, Any] | None:
    return None if spec is None else {**asdict(spec), "include": list(spec.include), "exclude": list(spec.exclude)}


def spec_from_wire(data: dict[str, Any] | None) -> PerturbationSpec | None:
    if data is None:
        return None
    return PerturbationSpec(**{**data, "include": tuple(data["include"]), "exclude": tuple(data["exclude"])})


def worker_dtype(config: Any) -> str:
    """The dtype workers load the base model in (recorded in the ES history)."""
    dtype = config.generator.dtype
    if dtype != "auto":
        return dtype
    return "bfloat16" if config.generator.device != "cpu" else "float32"


def worker_path(config: Any, root: str | Path = VOLUME_ROOT) -> str | None:
    """Where a container that mounts the Volume at `root` finds the run's local model (None: not a local one)."""
    rt = getattr(config.runtime, "modal", None)
    folder = getattr(rt, "model_folder", None)
    return f"{str(root).rstrip('/')}/{folder}" if folder else None


def engine_config(config: Any) -> dict[str, Any]:
    """What a worker builds its host from: the run's model, seed, generator and sampling sections
    (JSON); runtime and logging do not concern it. A local model is its folder on the Volume (models.py),
    which has no Hub revision."""
    from vrl.config import dump

    data = dump(config)
    out = {k: data[k] for k in ("model", "seed", "generator", "sampling")}
    on_volume = worker_path(config)
    if on_volume is not None:
        out["model"], out["generator"] = on_volume, {**out["generator"], "revision": None}
    return out


# -- ES state: what a member call carries, and what a worker catches up from --------------------------
#
# A member call carries only what is new since the previous iteration: the newest update, the digests
# that say which history it extends, and where the rest lives. Every update is on the Volume once
# (`runs/<name>/es/updates/<n>.json`, uploaded by the orchestrator), and every `snapshot_every` updates
# one worker writes θ there (`runs/<name>/es/theta/<n>.safetensors`). A warm worker applies the new
# update; one that is behind (cold, or it missed an iteration) replays from its own state or the newest
# snapshot, whichever is nearer, so catch-up costs at most `snapshot_every` updates.

ES_DIR = "es"


def chain(digest: str, update: dict[str, Any]) -> str:
    """The digest of a history after `update`, from the digest before it ('' for no update)."""
    return hashlib.sha256((digest + json.dumps(update, sort_keys=True)).encode()).hexdigest()[:32]


def update_file(store: str | os.PathLike, n: int) -> Path:
    return Path(store) / "updates" / f"{n:06d}.json"


def snapshot_file(store: str | os.PathLike, n: int) -> Path:
    return Path(store) / "theta" / f"{n:06d}.safetensors"


class UpdateLog:
    """The orchestrator's side: the run's ES updates, each put on the Volume once, summarised per call.

    `put(files)` writes {Volume path: bytes} (a batch upload on Modal, plain files when the bodies run
    here); `store` is the run's ES directory on the Volume (`runs/<name>/es`).
    """

    def __init__(self, store: str, put: Callable[[dict[str, bytes]], None], snapshot_every: int = 0):
        self.store, self.put, self.snapshot_every = store, put, snapshot_every
        self.updates: list[dict[str, Any]] = []
        self.digests = [""]
        self.snapshot = 0  # the newest θ snapshot a call of this process wrote (0: none yet; a resumed run writes one)
        self._unsent: list[int] = []

    def append(self, update: dict[str, Any]) -> None:
        self.updates.append(update)
        self.digests.append(chain(self.digests[-1], update))
        self._unsent.append(len(self.updates) - 1)

    def flush(self) -> None:
        """Put the updates recorded since the last flush on the Volume (one upload, before the calls)."""
        if self._unsent:
            self.put({str(update_file(self.store, i)): json.dumps(self.updates[i]).encode() for i in self._unsent})
            self._unsent = []

    def snapshot_due(self) -> bool:
        return bool(self.snapshot_every) and len(self.updates) - self.snapshot >= self.snapshot_every

    def head(self) -> dict[str, Any]:
        """What every call carries: the newest update and the digests of the history before and after it
        (a worker finds the θ snapshots on the Volume itself)."""
        n = len(self.updates)
        recent = self.updates[-1:]
        return {"store": self.store, "count": n, "digest": self.digests[n], "before": self.digests[n - len(recent)],
                "recent": recent}


# -- the GPU worker's one method: sample variants of the weights ---------------------------------


class _Warm:
    """The container's host, kept between calls: what it was built from and which updates it holds."""

    key: str | None = None
    host: Any = None
    spec: PerturbationSpec | None = None
    count: int = 0  # updates applied to the host's θ
    digest: str = ""  # their history's digest
    weights: str | None = None
    replayed: int = 0  # updates applied in the last call (what catching up cost)
    # Set while a call changes the host's weights (catching up, loading trained weights, perturbing for a
    # member) and cleared once they are known again: still set at the next call, the last one stopped midway.
    # Modal's cancellation raises InputCancellation wherever the call is (modal/_container_entrypoint.py,
    # SIGUSR1), e.g. between an update's tensors and its count, or inside a perturbation's restore.
    unsettled: bool = False

    @property
    def applied(self) -> range:
        """The updates θ holds, by index (its length: how many)."""
        return range(self.count)


_WARM = _Warm()


def sample(
    variant: dict[str, Any],
    start: int,
    stop: int,
    *,
    config: dict[str, Any],
    tasks: list[dict[str, Any]],
    seed: int | None,
    spec: dict[str, Any] | None = None,
    updates: list[dict[str, Any]] | None = None,
    weights: str | None = None,
    environment: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """`sample_call` for a caller in this process that holds the run's whole update list (`updates`,
    `to_wire` data): the completions only. Modal calls carry `UpdateLog.head()` instead."""
    es = None
    if updates is not None:
        log = UpdateLog("", lambda files: None)
        for update in updates:
            log.append(update)
        es = log.head()
    out = sample_call(variant, start, stop, config=config, tasks=tasks, seed=seed, spec=spec, es=es, weights=weights,
                      history=updates, environment=environment)
    return out["completions"]


def sample_call(
    variant: dict[str, Any] | list[dict[str, Any]],
    start: int,
    stop: int,
    write_snapshot: bool = False,
    *,
    config: dict[str, Any],
    tasks: list[dict[str, Any]],
    seed: int | None,
    spec: dict[str, Any] | None = None,
    es: dict[str, Any] | None = None,
    weights: str | None = None,
    root: str | os.PathLike = VOLUME_ROOT,
    reload: Callable[[], None] | None = None,
    commit: Callable[[], None] | None = None,
    history: Sequence[dict[str, Any]] | None = None,
    environment: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Completions of one variant (or several: low-rank members share one engine pass) on tasks[start:stop],
    from the host the local runtime would build.

    `config`: the run's model, seed, generator and sampling sections (`generator.backend` picks
    vllm or hf, as locally). Seeded variants (ES members) need `spec` and `es` (`UpdateLog.head()`):
    the warm host applies the newest update, or catches up from the Volume under `root` (`reload` first
    makes the Volume's newest files visible; or from `history`, the whole update list, when the caller
    has it), then samples with in-engine perturbation; with `write_snapshot` it first writes θ to the
    Volume (`commit` publishes it). `weights`: a Volume file of trained weights (GRPO) to sample
    instead of the base model. `environment` (`vrl.plugins.environment_wire`): the run's environment answers back,
    so the host samples whole episodes with its own instance of it, as the local runtime's host does.
    Sampling seeds follow the task's position in the whole list, so shards give what one call over every
    task gives.
    Returns {"completions": [...], "snapshot": count written or None, "replayed": updates applied,
    "catch_up_s": seconds spent bringing θ up to date (reload, snapshot load, replay)}.
    """
    with _cancellation_held():  # imports, the plugin registry, a model load, catching up: never half done
        from vrl.config import SamplingConfig, TrainConfig
        from vrl.generate.base import shard_seed

        cfg = TrainConfig.model_validate(config)
        wanted = spec_from_wire(spec)
        key = json.dumps({**{k: config[k] for k in ("model", "generator")}, "environment": environment}, sort_keys=True)
        if _WARM.host is not None and _WARM.unsettled:
            log.warning("the previous call on this worker stopped while it changed the weights (a cancellation lands "
                        "anywhere): they are no longer known to match the run's history, so the model is loaded again")
            _fresh_host(cfg, key, wanted, environment)
        # Start from the base model for another model or selection, or after trained weights.
        if _WARM.key != key or _WARM.spec != wanted or (weights is None and _WARM.weights is not None):
            _fresh_host(cfg, key, wanted, environment)
        _WARM.unsettled = True  # until its weight changes are recorded (a failure here leaves it set)
        if weights and weights != _WARM.weights:  # newly published trained weights: load them into the warm host
            _WARM.host.publish(load_weights_file(weights))
            _WARM.weights = weights
        _WARM.replayed = 0
        written = None
        t0 = time.perf_counter()
        if es is not None and wanted is not None:
            _catch_up(cfg, key, wanted, es, Path(root), reload or (lambda: None), history, environment)
        catch_up_s = time.perf_counter() - t0
        if es is not None and wanted is not None and write_snapshot and es["count"]:
            written = _write_snapshot(Path(root) / es["store"], es["count"], es["digest"], reload or (lambda: None),
                                      commit or (lambda: None))
        _WARM.unsettled = False  # θ is what count and digest say (a cancellation held until here changes nothing)
    _WARM.unsettled = True  # sampling perturbs and restores θ: settled again once it has returned
    host = _WARM.host
    host.sampling = SamplingConfig(**config["sampling"])
    variants = [Variant(**v) for v in (variant if isinstance(variant, list) else [variant])]
    per_task = variants[0].samples_per_task
    out = [batch for batch in host.sample(tasks_from_wire(tasks[start:stop]), variants, shard_seed(seed, start, per_task))]
    _WARM.unsettled = False  # θ (every perturbation restored) is what count and digest say
    return {"completions": [completion_to_wire(c) for batch in out for c in batch], "snapshot": written,
            "replayed": _WARM.replayed, "catch_up_s": catch_up_s}


@contextlib.contextmanager
def _cancellation_held() -> Iterator[None]:
    """Modal cancels a sync function's input with SIGUSR1, whose handler raises InputCancellation wherever the
    code is (modal/_container_entrypoint.py). Inside this block a cancellation is held, and raised when the
    block ends: one that landed in an import, the plugin registry's first collection or a model load would
    leave the container's process broken for every later input (on the emulator: "unknown generator backend
    'hf'; installed: none" for the rest of the container's life). Sampling itself stays cancellable (what a
    cancellation leaves there, `_Warm.unsettled` catches). Outside a Modal container (no handler): nothing."""
    handler = signal.getsignal(signal.SIGUSR1)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield
        return
    held: list[tuple[int, Any]] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, handler)
        if held:
            handler(*held[0])  # Modal's handler: InputCancellation, here, with nothing half done


def _fresh_host(cfg: Any, key: str, wanted: PerturbationSpec | None, environment: dict[str, Any] | None) -> None:
    from vrl import episodes
    from vrl.generate import make_generator
    from vrl.plugins import environment_from_wire

    if _WARM.host is not None:
        _WARM.host.close()
    _WARM.host = _WARM.key = None
    _WARM.unsettled = False
    host = make_generator(cfg, HostNeeds("perturbations", wanted) if wanted is not None else None)
    if environment is not None:  # as the trainer attaches the run's environment to a local host
        episodes.attach(host, environment_from_wire(environment))  # (the GPU image holds the run's plugins)
    if wanted is not None:
        host.perturbations(wanted)
    _WARM.key, _WARM.host, _WARM.spec, _WARM.count, _WARM.digest, _WARM.weights = key, host, wanted, 0, "", None


def _catch_up(cfg: Any, key: str, wanted: PerturbationSpec, es: dict[str, Any], root: Path,
              reload: Callable[[], None], history: Sequence[dict[str, Any]] | None = None,
              environment: dict[str, Any] | None = None) -> None:
    """Bring the warm host's θ to the history `es` describes, replaying as few updates as it can (from
    the Volume's files, or from `history` when the caller passed the whole list)."""
    from vrl.weights.update import update_from_wire

    n, target = es["count"], es["digest"]
    if (_WARM.count, _WARM.digest) == (n, target):
        return
    recent = es["recent"]
    if (_WARM.count, _WARM.digest) == (n - len(recent), es["before"]):  # warm: only the newest update is new
        _apply(update_from_wire(u) for u in recent)
        return
    store = root / es["store"]
    if history is None:
        reload()  # the orchestrator's uploads (and workers' snapshots) since this container mounted the Volume
    updates: dict[int, dict[str, Any]] = {}

    def extends(start: int, digest: str) -> bool:
        for i in range(start, n):
            if i not in updates:
                updates[i] = history[i] if history is not None else json.loads(update_file(store, i).read_text())
            digest = chain(digest, updates[i])
        return digest == target

    # The nearest start that leads to the run's history: this host's own θ, the newest θ snapshot on the
    # Volume (its digest is in its header), or the base model.
    starts = [(_WARM.count, "own", _WARM.digest)] if _WARM.count <= n else []
    for path in (store / "theta").glob("*.safetensors") if history is None else ():
        if path.stem.isdigit() and _WARM.count < int(path.stem) <= n:
            starts.append((int(path.stem), "snapshot", path))
    for count, kind, where in sorted(starts, key=lambda s: s[0], reverse=True):
        if kind == "own":
            if extends(count, where):
                break
            continue
        meta = _snapshot_meta(where)
        if meta.get("count") == str(count) and extends(count, meta.get("digest", "")):
            state, _ = _read_snapshot(where)
            _WARM.host.load_state(state)
            _WARM.count, _WARM.digest = count, meta["digest"]
            break
    else:  # another history (another run, a rewind): from the base model
        if _WARM.count:
            _fresh_host(cfg, key, wanted, environment)
        if not extends(0, ""):
            raise RuntimeError(f"the ES updates on the Volume under {store} do not give the run's history")
    _apply(update_from_wire(updates[i]) for i in range(_WARM.count, n))
    if _WARM.digest != target:
        raise RuntimeError("the replayed ES history does not match the run's (digest mismatch)")


def _apply(updates: Any) -> None:
    for update in updates:
        _WARM.host.update(update)
        _WARM.digest = chain(_WARM.digest, update.to_wire())
        _WARM.count += 1
        _WARM.replayed += 1


def _write_snapshot(store: Path, count: int, digest: str, reload: Callable[[], None], commit: Callable[[], None]) -> int:
    """θ after `count` updates onto the Volume (safetensors, atomically, committed); older ones but the
    previous are removed (after a reload, so this container sees the snapshots others wrote)."""
    from safetensors.torch import save_file

    reload()
    path = snapshot_file(store, count)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in _WARM.host.state().items()}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata={"count": str(count), "digest": digest})
    for old in sorted(path.parent.glob("*.safetensors"))[:-2]:
        old.unlink()
    commit()
    return count


def _snapshot_meta(path: Path) -> dict[str, str]:
    """A θ snapshot's header metadata (count, digest), without reading its tensors."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def _read_snapshot(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def save_weights(model: Any, path: Path) -> Path:
    """Write the model's weights (safetensors, atomically) for workers to load: checkpoint names,
    LoRA adapters merged (as pushed into a vLLM engine), tied weights once."""
    from safetensors.torch import save_file

    from vrl.weights.export import weights_for_engine

    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in weights_for_engine(model)}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp))
    return path


def load_weights_file(path: str | os.PathLike) -> dict[str, Any]:
    """The tensors of a `save_weights` file, by name, on the GPU when there is one (a vLLM engine
    then loads them through CUDA IPC handles instead of serialised bytes)."""
    import torch
    from safetensors.torch import load_file

    return load_file(str(path), device="cuda" if torch.cuda.is_available() else "cpu")


# -- `vrl modal prepare` ------------------------------------------------------------------------------


def prepare_model(model: str, revision: str | None, root: str | os.PathLike) -> dict[str, Any]:
    """Put `model`'s weights and tokenizer into the Volume's HF cache once; idempotent.

    Runs where the Hub is reachable (a Modal container with the `huggingface` secret for gated
    models). Returns what is on the Volume: snapshot path, files and bytes. A second call finds the
    snapshot in the cache and downloads nothing.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = Path(root) / HF_DIR
    cache.mkdir(parents=True, exist_ok=True)
    patterns = list(MODEL_FILES)
    try:
        path = snapshot_download(model, revision=revision, cache_dir=str(cache), allow_patterns=patterns, local_files_only=True)
        downloaded = False
    except LocalEntryNotFoundError:  # not on the Volume yet
        path = snapshot_download(model, revision=revision, cache_dir=str(cache), allow_patterns=patterns)
        downloaded = True
    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
    if not any(f.suffix == ".safetensors" for f in files):
        raise RuntimeError(f"{model} has no .safetensors weights; vrl workers load safetensors only")
    check_offline_load(model, revision, root)
    return {
        "model": model,
        "revision": revision,
        "path": str(path),
        "files": [str(f.relative_to(path)) for f in files],
        "bytes": sum(f.stat().st_size for f in files),
        "downloaded": downloaded,
    }


def check_offline_load(model: str, revision: str | None, root: str | os.PathLike) -> None:
    """Load config and tokenizer from the Volume's cache with no Hub access (what workers will do)."""
    from transformers import AutoConfig, AutoTokenizer

    cache = str(Path(root) / HF_DIR)
    AutoConfig.from_pretrained(model, revision=revision, cache_dir=cache, local_files_only=True)
    AutoTokenizer.from_pretrained(model, revision=revision, cache_dir=cache, local_files_only=True)


# -- `vrl modal doctor`: the probes' container side ----------------------------------------------------

DOCTOR_DIR = "doctor"  # on the Volume: the doctor's round-trip files (it removes them)


def environment_report(gpu: bool) -> dict[str, Any]:
    """What this container's image holds: Python, vrl, torch (and vllm on the GPU image), and CUDA."""
    report: dict[str, Any] = {"python": platform.python_version()}
    try:
        report["vrl"] = importlib.metadata.version("vrl-core")
    except importlib.metadata.PackageNotFoundError:
        report["vrl"] = "not installed"
    for name in ("torch", "transformers") + (("vllm",) if gpu else ()):
        try:
            report[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - what is missing is the report
            report[name] = f"not importable ({type(exc).__name__}: {exc})".splitlines()[0]
    try:
        import torch

        report["cuda"] = bool(torch.cuda.is_available())
        report["device"] = torch.cuda.get_device_name(0) if report["cuda"] else None
    except Exception:  # noqa: BLE001
        report["cuda"], report["device"] = False, None
    return report


def in_orchestrator(root: str | os.PathLike, token: str, worker: Any, reload: Callable[[], None],
                    commit: Callable[[], None]) -> dict[str, Any]:
    """The orchestrator's side of the probe (inside its container): its image, the Volume (`reload` makes
    the client's upload visible, `commit` publishes the answer), then the GPU worker's probe."""
    t0 = time.perf_counter()
    report: dict[str, Any] = {"orchestrator": environment_report(gpu=False)}
    reload()
    folder = Path(root) / DOCTOR_DIR
    sent = (folder / f"{token}.txt").read_text()
    (folder / f"{token}.back").write_text(sent[::-1])
    commit()
    report["volume_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    report["worker"] = worker.remote(None, 0, 0, probe=True, config={}, tasks=[], seed=None)
    report["worker_s"] = time.perf_counter() - t1
    return report
