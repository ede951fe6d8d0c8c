"""The bodies of the Modal functions, as plain Python: what runs inside a GPU or orchestrator container.

Nothing here imports `modal`, so every body runs (and is tested) on any machine; `app.py` wraps them
in Modal functions. Arguments and results are JSON-able (tasks, histories and completions cross the
Modal boundary as dicts). Workers load weights from the Volume (`root`), never from the Hub.

Volume layout (mounted at `VOLUME_ROOT` in Modal containers)::

    hf/                      Hugging Face cache (`vrl modal prepare` fills it; workers read it offline)
    runs/<name>/             run directories of detached runs (metrics, es_history.json, state)
    runs/<name>/weights/vN/  GRPO weights after update N (the shard workers reload them)
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vrl.fileio import atomic_path
from vrl.policy import HostNeeds, PerturbationSpec, Variant
from vrl.types import Completion, Task

log = logging.getLogger(__name__)

VOLUME_ROOT = "/vrl"
HF_DIR = "hf"
RUNS_DIR = "runs"


def volume_env(root: str | os.PathLike = VOLUME_ROOT, offline: bool = True) -> dict[str, str]:
    """A container's environment: the Volume's HF cache; `offline` switches the Hub off (GPU workers).

    Set at container start, because huggingface_hub reads these variables when it is imported.
    """
    env = {"HF_HUB_CACHE": str(Path(root) / HF_DIR)}
    if offline:
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def warm_up() -> None:
    """Import the heavy modules when the container starts, not during the first call."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import vrl.generate.hf  # noqa: F401


# -- wire formats --------------------------------------------------------------------------------


def completion_to_wire(c: Completion) -> dict[str, Any]:
    """A completion as JSON, token ids and log-probs included (GRPO trains on exactly these)."""
    data = c.model_dump(mode="json")
    data.update(prompt_token_ids=c.prompt_token_ids, token_ids=c.token_ids, logprobs=c.logprobs)
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


def engine_config(config: Any) -> dict[str, Any]:
    """What a worker builds its host from: the run's model, seed, generator and sampling sections
    (JSON); runtime and logging do not concern it."""
    from vrl.config import dump

    data = dump(config)
    return {k: data[k] for k in ("model", "seed", "generator", "sampling")}


# -- the GPU worker's one method: sample variants of the weights ---------------------------------


class _Warm:
    """The container's host, kept between calls: what it was built from and which updates it holds."""

    key: str | None = None
    host: Any = None
    spec: PerturbationSpec | None = None
    applied: list[Any] = []  # the `vrl.weights.update` updates replayed so far
    weights: str | None = None


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
) -> list[dict[str, Any]]:
    """Completions of one variant on tasks[start:stop], from the host the local runtime would build.

    `config`: the run's model, seed, generator and sampling sections (`generator.backend` picks
    vllm or hf, as locally). Seeded variants (ES members) need `spec` and the run's `updates` so far:
    the warm host replays only the updates it has not applied yet, then samples the member with
    in-engine perturbation. `weights`: a Volume file of trained weights (GRPO) to sample instead of
    the base model. Sampling seeds follow the task's position in the whole list, so shards give
    what one call over every task gives.
    """
    from vrl.config import SamplingConfig, TrainConfig
    from vrl.generate import make_generator
    from vrl.generate.base import shard_seed

    cfg = TrainConfig.model_validate(config)
    wanted = spec_from_wire(spec)
    from vrl.weights.update import update_from_wire

    updates = [update_from_wire(u) for u in (updates or [])]
    key = json.dumps({k: config[k] for k in ("model", "generator")}, sort_keys=True)
    # Start from the base model for another run, or for history that does not extend what we hold.
    stale = (_WARM.key != key or _WARM.spec != wanted or updates[: len(_WARM.applied)] != _WARM.applied
             or (weights is None and _WARM.weights is not None))
    if stale:
        if _WARM.host is not None:
            _WARM.host.close()
        _WARM.host = _WARM.key = None
        # One call samples one variant (Modal maps members over calls).
        host = make_generator(cfg, HostNeeds("perturbations", wanted) if wanted is not None else None)
        if wanted is not None:
            host.perturbations(wanted)
        _WARM.key, _WARM.host, _WARM.spec, _WARM.applied, _WARM.weights = key, host, wanted, [], None
    if weights and weights != _WARM.weights:  # newly published trained weights: load them into the warm host
        _WARM.host.publish(load_weights_file(weights))
        _WARM.weights = weights
    host = _WARM.host
    for update in updates[len(_WARM.applied):]:
        host.update(update)
        _WARM.applied.append(update)
    host.sampling = SamplingConfig(**config["sampling"])
    v = Variant(**variant)
    out = host.sample(tasks_from_wire(tasks[start:stop]), [v], shard_seed(seed, start, v.samples_per_task))
    return [completion_to_wire(c) for batch in out for c in batch]


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
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
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
