"""Weights pushed into the engine whole: from the HF copy GRPO trains in this process (mode 'trained'),
or ready tensors by checkpoint name (mode 'sample': Modal's GRPO workers, evaluation).

Driver half: `PushedWeights` (the mover of both modes: `trainable`, `publish`) and `_share` (CUDA IPC
handles for tensors on a GPU); worker half: `LoadWeightsExtension`, which loads them through the
model's own `load_weights` (it fuses and shards).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import torch

from vrl.generate.vllm_mover import Mover
from vrl.generate.vllm_worker import WorkerBase, pack_tensor, rebuild_weights
from vrl.policy import Trainable, Unsupported

log = logging.getLogger(__name__)


class PushedWeights(Mover):
    """Modes 'trained' and 'sample': the engine's weights change only by `publish`."""

    extension = "vrl.generate.vllm_trained.LoadWeightsExtension"

    def __init__(self, engine: Any):
        super().__init__(engine)
        self.model: torch.nn.Module | None = None  # GRPO's trainable HF copy (`trainable`), pushed by `publish`
        self._pushed = False
        self._since_push = 0

    def trainable(self) -> Trainable:
        """An HF copy of the model on `generator.device` (loaded once): GRPO trains it, `publish` pushes it.

        From now on the engine also returns sampling log-probs (`generator.vllm.sampling_logprobs`).
        """
        from vrl.generate.hf import load_model_and_tokenizer

        engine = self.engine
        if engine.mode != "trained":
            raise Unsupported(f"this engine was started in mode {engine.mode!r}; a trained copy needs one started with "
                              "the GRPO run's needs (mode 'trained': make_generator(config, optimizer.needs()))")
        if self.model is None:
            # No initial push: engine and copy load the same checkpoint in the same dtype.
            self.model, _ = load_model_and_tokenizer(engine.model_path, engine.train_device, engine.dtype, engine.revision)
            engine.logprobs = engine.sampling_logprobs
        return Trainable(self.model, engine.tokenizer, engine.sampling)

    def publish(self, model: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        """Push `model` (the trained copy, or tensors by checkpoint name) into the engine: on the first
        call, then every `sync_every` calls; the push's time is the `sync_s` counter."""
        from vrl.weights.export import weights_for_engine

        engine = self.engine
        self._since_push += 1
        if self._pushed and self._since_push < engine.sync_every:
            return
        t0 = time.perf_counter()
        if engine._asleep:
            engine._wake_up(["weights"])
        weights = list(model.items()) if isinstance(model, Mapping) else weights_for_engine(model)
        payload = _share(weights, engine.device_order)
        engine.rpc("vrl_load_weights", payload)
        del payload, weights
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
        if engine._asleep:
            engine._wake_up(["kv_cache"])
            engine._asleep = False
        engine.weights_changed()
        self._pushed, self._since_push = True, 0
        self._count("sync_s", time.perf_counter() - t0)
        log.debug("vllm: pushed weights in %.3f s", self._counters["sync_s"])


def _share(weights: list[tuple[str, torch.Tensor]], engine_order: list[str] | None = None) -> list[tuple[str, Any]]:
    """(name, what the worker needs to see the tensor) per weight; keep `weights` alive until it loaded.

    A CUDA tensor crosses to the engine process as an IPC handle (no copy); an engine running in
    this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) gets the tensor itself; CPU tensors go as bytes.
    A handle names the device by this process's ordinal; an engine that numbers the GPUs otherwise
    (`engine_order`, see `_visible_gpu`) gets the ordinal of the same physical GPU in its numbering.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    mine = visible_ids() if engine_order is not None else None
    out: list[tuple[str, Any]] = []
    for name, t in weights:
        if in_process:
            out.append((name, t))
        elif not t.is_cuda:
            out.append((name, pack_tensor(t)))
        else:
            rebuild, args = reduce_tensor(t)
            if mine is not None:
                args = list(args)
                args[_STORAGE_DEVICE] = engine_order.index(mine[args[_STORAGE_DEVICE]])
                args = tuple(args)
            out.append((name, (rebuild, args)))
    return out


_STORAGE_DEVICE = 6  # position of the device ordinal in torch's rebuild_cuda_tensor arguments


def visible_ids() -> list[str]:
    """The physical ids of the GPUs this process sees, in its order."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


# -- inside the engine's workers -------------------------------------------------------------------
_LORA = re.compile(r"(^|\.)lora_|\.base_layer\.")


class LoadWeightsExtension(WorkerBase):
    """The worker extension of modes 'trained' and 'sample': whole weights loaded in place."""

    def vrl_load_weights(self, payload: list[tuple[str, object]]) -> int:
        """Load HF-named weights in place through the model's own `load_weights` (fuses, shards)."""
        weights = rebuild_weights(payload)
        lora = [n for n, _ in weights if _LORA.search(n)]
        if lora:
            raise ValueError(f"got LoRA parameter names ({lora[0]}, ...); merge adapters before syncing weights")
        model = self._vrl_model()
        with torch.no_grad():
            model.load_weights(weights=iter(weights))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        count = len(weights)
        del weights
        return count
