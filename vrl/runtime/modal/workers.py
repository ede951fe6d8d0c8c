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
from pathlib import Path
from typing import Any

from vrl.config import SamplingConfig
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

    import vrl.generate.hf
    import vrl.optim.es  # noqa: F401


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


# -- (a) ES member evaluation ------------------------------------------------------------------------


def es_member(
    history: dict[str, Any],
    seed: int,
    sign: int,
    index: int,
    tasks: list[dict[str, Any]],
    sampling: dict[str, Any],
    sample_seed: int | None,
    n: int = 1,
    device: str = "auto",
) -> list[dict[str, Any]]:
    """Completions of one ES member: θ_t replayed from `history`, perturbed by (seed, sign), sampled.

    The replica (base weights + replayed θ) stays warm in the container between calls, so a call for
    the next iteration replays only the iterations the container has not seen (`vrl.optim.es`).
    """
    from vrl.optim.es import evaluate_member

    completions = evaluate_member(
        history, seed, sign, tasks_from_wire(tasks), SamplingConfig(**sampling),
        index=index, samples_per_task=n, sample_seed=sample_seed, device=device,
    )
    return [completion_to_wire(c) for c in completions]


# -- (b) GRPO / eval generation shards ------------------------------------------------------------


class _ShardModel:
    """A warm generator for one weights reference (base model + optional weights file)."""

    key: tuple | None = None
    generator: Any = None


_SHARD = _ShardModel()


def generate_shard(
    model: dict[str, Any],
    tasks: list[dict[str, Any]],
    n: int,
    variant: int,
    sampling: dict[str, Any],
    seed: int | None,
    device: str = "auto",
) -> list[dict[str, Any]]:
    """Completions for one shard of tasks with the weights `model` names.

    `model`: {"model": id, "revision": ..., "dtype": ..., "weights": path of a safetensors file with
    the trained weights (GRPO after an update) or None}. The container keeps the loaded model and
    reloads only when the reference changes.
    """
    from vrl.generate.hf import HFGenerator, load_model_and_tokenizer

    key = (model["model"], model.get("revision"), model.get("dtype", "auto"), model.get("weights"), device)
    if _SHARD.key != key:
        _SHARD.generator = _SHARD.key = None  # free the old weights first
        base_key = key[:3] + (device,)
        cached = getattr(_SHARD, "base", None)
        if cached is not None and cached[0] == base_key and model.get("weights"):
            net, tok = cached[1], cached[2]
        else:
            net, tok = load_model_and_tokenizer(model["model"], device, model.get("dtype", "auto"), model.get("revision"))
            _SHARD.base = (base_key, net, tok)
        if model.get("weights"):
            load_weights(net, model["weights"])
        _SHARD.generator, _SHARD.key = HFGenerator(net, tok, None), key
    generator = _SHARD.generator
    generator.sampling = SamplingConfig(**sampling)
    out = generator.generate(tasks_from_wire(tasks), n=n, variant=variant, seed=seed)
    return [completion_to_wire(c) for c in out]


def save_weights(model: Any, path: Path) -> Path:
    """Write the model's weights (safetensors, atomically) for shard workers to load."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp))
    os.replace(tmp, path)
    return path


def load_weights(model: Any, path: str | os.PathLike) -> None:
    """Load a `save_weights` file into `model` (names and shapes must match)."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m not in state]:
        missing = [m for m in missing if m not in state]
        if missing or unexpected:
            raise ValueError(f"weights {path} do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


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


# -- the detached orchestrator ----------------------------------------------------------------------


def orchestrate(config: dict[str, Any], root: str | os.PathLike, runtime: Any, resume: bool = False,
                on_iteration: Any = None) -> dict[str, Any]:
    """Run the whole training loop here (a Modal container), the run directory on the Volume.

    `runtime` is the `ModalRuntime` bound to the app's live functions; `on_iteration` commits the
    Volume after each iteration so metrics and the ES history survive a lost container, and
    `resume=True` continues the run directory found on the Volume.
    """
    from vrl.config import TrainConfig
    from vrl.rundir import RunDir
    from vrl.trainer import Trainer

    run_dir = None
    if resume:
        # Continue with the recorded config; only the number of iterations may grow.
        run_dir = RunDir.open(Path(root) / RUNS_DIR / str(config["logging"]["name"]))
        config = {**run_dir.config(), "iterations": config["iterations"]}
    cfg = TrainConfig.model_validate(config)
    cfg = cfg.model_copy(update={"logging": cfg.logging.model_copy(update={"runs_dir": Path(root) / RUNS_DIR})})
    trainer = Trainer(cfg, run_dir=run_dir, runtime=runtime, on_iteration=on_iteration)
    summary = trainer.run()
    return json.loads(json.dumps(summary, default=str))
