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
from typing import TYPE_CHECKING, Any

from vrl.errors import RunDirError
from vrl.optim import optimizer_class
from vrl.rundir import RunDir

if TYPE_CHECKING:
    from vrl.weights.export import ModelLoader

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
        try:
            info = optimizer_class(config["optimizer"]).export(run, config, finished, tmp, _loader(device))
        except NotImplementedError:
            raise ExportError(f"{run} was trained with optimizer {config['optimizer']!r}, which cannot export") from None
        except (ValueError, FileNotFoundError) as exc:  # an incomplete or inconsistent run directory
            raise ExportError(str(exc)) from None
        (tmp / "vrl_export.json").write_text(json.dumps({"run": str(run.resolve()), **info}, indent=2) + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()  # empty, checked above
        shutil.move(str(tmp), str(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**info, "out": str(out)}


def _loader(device: str) -> ModelLoader:
    """The base-model loader an optimizer's `export` gets: the hf backend's, on `device` (it also builds `tiny`)."""
    from vrl.generate.hf import load_model_and_tokenizer  # imports torch: only when a run is exported

    return lambda name, dtype, revision: load_model_and_tokenizer(name, device, dtype, revision)


def _check_run(run: Path) -> tuple[dict[str, Any], int]:
    if not is_run_dir(run):
        raise ExportError(f"{run} is not a vrl run directory (no config.json with plugin, optimizer and model)")
    run_dir = RunDir(run)
    finished = run_dir.completed_iterations()
    if finished < 1:
        raise ExportError(f"{run} has no finished iteration yet; train it first (`vrl train --resume {run}`)")
    try:
        run_dir.check_model("export")  # ES rebuilds θ from the base weights, a LoRA checkpoint applies to them
    except RunDirError as exc:
        raise ExportError(str(exc)) from None
    return run_dir.config(), finished
