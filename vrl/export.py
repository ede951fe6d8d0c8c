"""`vrl export`: a trained run as a standard Hugging Face model folder (weights, config, tokenizer).

- ES: the base model (`es_history.json`'s `base`, or the locally built `tiny`) with the history
  replayed onto it, from the newest matching snapshot when there is one; θ_t is rebuilt bit for
  bit, as `--resume` does, and the weights are written in the dtype the run sampled with.
- GRPO: the newest checkpoint at or before the run's last finished iteration. Full fine-tuning
  saved the model itself; a LoRA run saved a peft adapter, which is merged into the base weights
  here, so the folder loads with `AutoModelForCausalLM.from_pretrained` (and vLLM) without peft.
  The adapter itself stays in the run directory (`grpo/iter-NNNNNN/policy`).

The folder always carries the tokenizer: the `tiny` model has no Hub repository to fetch one from.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


class ExportError(ValueError):
    """The run cannot be exported as asked; the message says why and what to do."""


def is_run_dir(path: str | Path) -> bool:
    """Whether `path` is a vrl run directory (its config.json is a TrainConfig, not a model config)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"plugin", "optimizer", "model"} <= data.keys()


def export_run(run: str | Path, out: str | Path, device: str = "auto") -> dict[str, Any]:
    """Write the trained model of run directory `run` to `out` (must not exist or be empty).

    Returns what was exported: optimizer, iteration, base model and the folder.
    """
    run, out = Path(run), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not empty; choose another --out or remove it")
    config, finished = _check_run(run)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent if out.parent.exists() else None))
    try:
        if config["optimizer"] == "es":
            info = _export_es(run, config, finished, tmp, device)
        elif config["optimizer"] == "grpo":
            info = _export_grpo(run, config, finished, tmp, device)
        else:
            raise ExportError(f"{run} was trained with optimizer {config['optimizer']!r}; export knows es and grpo")
        (tmp / "vrl_export.json").write_text(json.dumps({"run": str(run.resolve()), **info}, indent=2) + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()  # empty, checked above
        shutil.move(str(tmp), str(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**info, "out": str(out)}


def _check_run(run: Path) -> tuple[dict[str, Any], int]:
    if not is_run_dir(run):
        raise ExportError(f"{run} is not a vrl run directory (no config.json with plugin, optimizer and model)")
    state = run / "state.json"
    finished = json.loads(state.read_text())["iteration"] if state.is_file() else 0
    if finished < 1:
        raise ExportError(f"{run} has no finished iteration yet; train it first (`vrl train --resume {run}`)")
    return json.loads((run / "config.json").read_text()), finished


def _save(model, tokenizer, folder: Path) -> None:
    # ES moved the weights into flat shared buffers; safetensors needs each tensor to own its storage.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no per-shard bar on the console
    try:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


# -- ES -----------------------------------------------------------------------------------------------
def _export_es(run: Path, config: dict[str, Any], finished: int, folder: Path, device: str) -> dict[str, Any]:
    from vrl.generate.hf import load_model_and_tokenizer
    from vrl.optim.es import HISTORY_FILE, ESHistory, FlatParams, replay, select_parameters

    path = run / HISTORY_FILE
    if not path.is_file():
        raise ExportError(f"{run} is an ES run without {HISTORY_FILE}; it cannot be rebuilt")
    try:
        history = ESHistory.read(path)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    if len(history.iterations) < finished:
        raise ExportError(f"{path} has {len(history.iterations)} iterations but the run finished {finished}")
    history.iterations = history.iterations[:finished]  # an update saved after the last finished iteration
    base = history.base
    dtype = base.dtype if base.dtype in ("float32", "bfloat16", "float16") else config["generator"]["dtype"]
    model, tokenizer = load_model_and_tokenizer(base.model, device, dtype, base.revision)
    params = FlatParams(select_parameters(model, history.include, history.exclude))
    start = _load_es_snapshot(run, history, params, finished)
    with torch.no_grad():
        replay(history, params, start, finished)
    _save(model, tokenizer, folder)
    return {"optimizer": "es", "iteration": finished, "base_model": base.model, "dtype": dtype,
            "replayed_from": start}


def _load_es_snapshot(run: Path, history, params, finished: int) -> int:
    """Load the newest snapshot that belongs to this history (digest) at or before `finished`; its iteration."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from vrl.optim import noise as nz
    from vrl.optim.es import SNAPSHOT_DIR

    for path in sorted((run / SNAPSHOT_DIR).glob("iter-*.safetensors"), reverse=True):
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        t = int(meta.get("iteration", -1))
        if 0 < t <= finished and meta.get("noise") == nz.NOISE_VERSION and meta.get("digest") == history.digest(t):
            with torch.no_grad():
                params.load_state(load_file(str(path)))
            return t
    return 0


# -- GRPO ---------------------------------------------------------------------------------------------
def grpo_checkpoint(run: Path, finished: int) -> Path:
    """The newest GRPO checkpoint at or before iteration `finished` (the one `--resume` would load)."""
    found = sorted(p for p in (run / "grpo").glob("iter-*") if p.is_dir() and not p.name.endswith(".tmp"))
    usable = [p for p in found if int(p.name.removeprefix("iter-")) <= finished]
    if not usable:
        raise ExportError(f"{run} has no GRPO checkpoint at or before iteration {finished} in {run / 'grpo'}")
    return usable[-1]


def _export_grpo(run: Path, config: dict[str, Any], finished: int, folder: Path, device: str) -> dict[str, Any]:
    ckpt = grpo_checkpoint(run, finished)
    iteration = int(ckpt.name.removeprefix("iter-"))
    if iteration < finished:
        log.warning("the newest GRPO checkpoint of %s is after iteration %d (the run finished %d): exporting it",
                    run, iteration, finished)
    policy = ckpt / "policy"
    info = {"optimizer": "grpo", "iteration": iteration, "base_model": config["model"]}
    if not (policy / "adapter_config.json").is_file():
        # Full fine-tuning: the checkpoint is already a Hugging Face folder (save_pretrained + tokenizer).
        shutil.copytree(policy, folder, dirs_exist_ok=True)
        return {**info, "lora": False}
    try:
        from peft import PeftModel
    except ImportError as exc:
        raise ExportError("this run trained a LoRA adapter; merging it needs peft: pip install 'vrl[lora]'") from exc
    from vrl.generate.hf import load_model_and_tokenizer

    gen = config["generator"]
    model, tokenizer = load_model_and_tokenizer(config["model"], device, gen["dtype"], gen.get("revision"))
    merged = PeftModel.from_pretrained(model, str(policy)).merge_and_unload()
    _save(merged, tokenizer, folder)
    return {**info, "lora": True, "merged": True}
