"""Weights pushed into the engine whole: from the HF copy GRPO trains in this process (mode 'trained'),
or ready tensors by checkpoint name (mode 'sample': Modal's GRPO workers, evaluation).

Four transports (`generator.vllm.weight_transfer`, resolved per engine by `transfer_for`):
- the trained LoRA adapter alone ('adapter', GRPO with `use_peft`): the engine serves it from one
  LoRA slot (vLLM's LoRA layers over the untouched base; the slot is pinned to an adapter id that is
  never loaded from disk, as low-rank ES's members are) and each push writes the adapter's factors
  (A, s·B) into the slot's stacks through CUDA IPC handles (`AdapterTransfer`,
  `vllm_slots.AdapterSlot`); every plain request runs with it (`PushedWeights.lora_request`).
- vLLM's native weight-transfer engines (`vllm.distributed.weight_transfer`, mode 'trained'):
  `start_weight_update` → `update_weights` → `finish_weight_update` through `NativeTransfer`, with
  CUDA IPC handles when the engine is one worker on the trainer's GPU ('ipc') and an NCCL broadcast
  from the trainer to every worker when it sits on other GPUs ('nccl'). The engines are vLLM's own,
  registered under `DIRECT` names with one change (`direct_engine`): an unquantized model loads each
  weight in place, as vLLM's loader does at start-up, instead of through vLLM's layerwise reload (which
  rebuilds every layer and copies it back: 121 vs 56 ms for 1.5B on an H200, docs/benchmarks.md).
- vrl's own worker extension ('extension'; mode 'sample', engines in this process, tensor-parallel
  engines that include the trainer's GPU): `_share` (CUDA IPC handles, device ordinals translated)
  and `LoadWeightsExtension`, which loads through the model's own `load_weights` (it fuses and shards).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import types
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch

from vrl.generate.vllm_mover import Mover
from vrl.generate.vllm_worker import WorkerBase, _timed, pack_tensor, rebuild_weights
from vrl.policy import Trainable, Unsupported, WeightStream
from vrl.weights.export import release_shared

log = logging.getLogger(__name__)


class PushedWeights(Mover):
    """Modes 'trained' and 'sample': the engine's weights change only by `publish`."""

    extension = "vrl.generate.vllm_trained.LoadWeightsExtension"

    def __init__(self, engine: Any):
        super().__init__(engine)
        self.model: torch.nn.Module | None = None  # GRPO's trainable HF copy (`trainable`), pushed by `publish`
        self._pushed = False
        self._since_push = 0
        self._native: NativeTransfer | None = None  # vLLM's weight-transfer engine, set up on the first push
        self._adapter: AdapterTransfer | None = None  # the served LoRA adapter ('adapter'), set up likewise
        # The trained copy lives in another process (a driver process's parent): pushed tensors were
        # received by CUDA IPC handle, which torch will not share again (`_push_whole` copies them first).
        self.received = False

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
        return Trainable(self.model, engine.tokenizer, engine.sampling, separate=True)

    def publish(self, model: torch.nn.Module | Mapping[str, torch.Tensor] | WeightStream) -> None:
        """Push `model` (the trained copy, tensors by checkpoint name, or a `WeightStream` of them, pushed
        bucket by bucket in one update) into the engine: on the first call, then every `sync_every`
        calls; the push's time is the `sync_s` counter."""
        from vrl.weights.export import weights_for_engine

        engine = self.engine
        self._since_push += 1
        if self._pushed and self._since_push < engine.sync_every:
            return
        t0 = time.perf_counter()
        if engine._asleep:
            engine._wake_up(["weights"])
        if engine.weight_transfer == "adapter":
            if not isinstance(model, torch.nn.Module):
                raise Unsupported("this engine serves a LoRA adapter (weight_transfer=adapter); it takes the trained "
                                  "model, not tensors by name")
            if self._adapter is None:
                self._adapter = AdapterTransfer(engine)
            self._adapter.send(model)
            release_shared()
        elif isinstance(model, WeightStream):
            self._push_whole(model)  # (releases what it shared after each bucket)
        else:
            self._push_whole([list(model.items()) if isinstance(model, Mapping) else weights_for_engine(model)])
        if engine._asleep:
            engine._wake_up(["kv_cache"])
            engine._asleep = False
        engine.weights_changed()
        self._pushed, self._since_push = True, 0
        self._count("sync_s", time.perf_counter() - t0)
        log.debug("vllm: pushed weights in %.3f s", self._counters["sync_s"])

    def _push_whole(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """Every weight, bucket by bucket, by vLLM's native transfer ('ipc', 'nccl': one update session) or
        vrl's loader ('extension': one load per bucket); a bucket may be freed once the next is drawn."""
        engine = self.engine
        if self.received and engine.weight_transfer != "nccl":  # (NCCL broadcasts them as they are)
            buckets = (_own(bucket) for bucket in buckets)
        if engine.weight_transfer in ("ipc", "nccl"):
            if self._native is None:
                self._native = NativeTransfer(engine.llm, engine.weight_transfer, engine.train_device,
                                              engine.tensor_parallel_size)
            self._native.send(buckets)
        else:
            for bucket in buckets:
                engine.rpc("vrl_load_weights", _share(bucket, engine.device_order))
                release_shared()

    def lora_request(self) -> Any:
        """The served adapter's request (after the first push with weight_transfer=adapter), else None."""
        return self._adapter.request if self._adapter is not None else None


class AdapterTransfer:
    """The trained LoRA adapter served from one LoRA slot of the engine: the first push pins adapter id
    `ID` to a slot (an empty adapter, never loaded from disk); each push writes every adapted weight's
    (A, s·B) into it through CUDA IPC handles (`vrl_adapter_write`). Only the adapter travels."""

    ID = 1
    PATH = "vrl://lora-slot"  # requests must name a path; this adapter id is never loaded from one

    def __init__(self, engine: Any):
        self.engine = engine
        self.request: Any = None  # what generation requests carry, once the slot is set up

    def send(self, model: torch.nn.Module) -> None:
        from vrl.weights.export import lora_factors_for_engine

        factors = lora_factors_for_engine(model)
        if self.request is None:
            from vllm.lora.request import LoRARequest

            # Every HF weight's shape (the engine's layout places a weight by its fused siblings), and
            # which of them the adapter changes.
            shapes = {n.replace(".base_layer.", "."): list(p.shape) for n, p in model.named_parameters() if "lora_" not in n}
            rank = max(a.shape[0] for a, _ in factors.values())
            info = self.engine.rpc("vrl_adapter_setup", shapes, sorted(factors), rank)[0]
            if "unserved" in info:
                raise Unsupported(f"{info['unserved']} (generator.vllm.weight_transfer=adapter; use auto to push "
                                  "the merged weights)")
            self.request = LoRARequest("vrl-policy", self.ID, self.PATH)
        flat = [(f"{n}{_A}", a) for n, (a, _) in factors.items()] + [(f"{n}{_B}", b) for n, (_, b) in factors.items()]
        self.engine.rpc("vrl_adapter_write", _share(flat, self.engine.device_order))


_A, _B = "|lora_a", "|lora_b"  # the two factors of one weight on the wire


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


Transfer = Literal["auto", "ipc", "nccl", "extension", "adapter"]
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
MAX_ADAPTER_RANK = LORA_RANKS[-1]


def lora_rank_for(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds a rank-`rank` adapter."""
    return next(r for r in LORA_RANKS if r >= rank)


def transfer_for(choice: Transfer, mode: str, *, engine_gpus: list[str], train_gpu: str | None,
                 in_process: bool = False, adapter: int = 0, launched: bool = False) -> str:
    """How weights reach an engine: 'adapter' (the LoRA adapter alone), 'ipc', 'nccl' (vLLM's native
    engines) or 'extension' (vrl's loader).

    `engine_gpus`: the physical ids of the engine's workers' GPUs; `train_gpu`: the physical id of the
    GPU the trained copy lives on (None: not on a GPU); `adapter`: the rank of the LoRA adapter GRPO
    trains (0: none); `launched`: this process is one rank of a torchrun launch. 'auto' picks IPC for
    one worker on the trainer's GPU, NCCL for workers all on other GPUs, and vrl's loader otherwise
    (mode 'sample', an engine in this process, a CPU copy, a tensor-parallel engine that includes the
    trainer's GPU: NCCL cannot put two ranks on one GPU; a torchrun launch, for IPC: vLLM's IPC sender
    gathers every rank's handles over the launch's default process group, a collective that rank 0's
    push alone would wait on forever); a LoRA run pushes W + ΔW merged. 'adapter' (asked for
    explicitly; one engine worker) serves the adapter from a LoRA slot: 47 ms per push against 81 ms
    merged (1.5B, rank 16, H200), but generation through vLLM's LoRA path is ~30 % slower, so not the
    default. An explicit choice that cannot work is refused.
    """
    native_possible = mode == "trained" and not in_process and train_gpu is not None
    adapter_possible = mode == "trained" and 0 < adapter <= MAX_ADAPTER_RANK and len(engine_gpus) == 1
    if choice == "extension":
        return "extension"
    if choice == "adapter":
        if not adapter_possible:
            why = ("grpo.use_peft is off: there is no adapter" if not adapter else
                   f"grpo.lora_r={adapter} is above the largest rank vLLM serves ({MAX_ADAPTER_RANK})"
                   if adapter > MAX_ADAPTER_RANK else "the engine is tensor-parallel (vrl writes whole factors into "
                   "one worker's LoRA slot)")
            raise ValueError(f"generator.vllm.weight_transfer=adapter cannot move this engine's weights: {why}; "
                             "use generator.vllm.weight_transfer=auto")
        return "adapter"
    if choice == "auto":
        if not native_possible:
            return "extension"
        if engine_gpus == [train_gpu]:
            return "extension" if launched else "ipc"
        return "extension" if train_gpu in engine_gpus else "nccl"
    if not native_possible:
        why = ("it moves weights only in mode 'trained' (GRPO)" if mode != "trained" else
               "the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)" if in_process else
               "the trained copy is not on a GPU")
        raise ValueError(f"generator.vllm.weight_transfer={choice} cannot move this engine's weights: {why}; "
                         "use generator.vllm.weight_transfer=auto")
    if choice == "ipc" and launched:
        raise ValueError("generator.vllm.weight_transfer=ipc cannot push from rank 0 of a torchrun launch alone: vLLM's "
                         "IPC sender gathers every rank's handles over the launch's process group; use auto or extension")
    if choice == "ipc" and engine_gpus != [train_gpu]:
        raise ValueError(f"generator.vllm.weight_transfer=ipc needs the engine to be one worker on the trainer's GPU "
                         f"({train_gpu}); it runs on {engine_gpus}: use nccl or auto")
    if choice == "nccl" and train_gpu in engine_gpus:
        raise ValueError(f"generator.vllm.weight_transfer=nccl needs the engine on GPUs other than the trainer's "
                         f"({train_gpu}; NCCL puts one rank on a GPU); it runs on {engine_gpus}: use ipc or auto")
    return choice


#: The vLLM backend name of each native transport's engine (`register_direct_engines`).
DIRECT = {"ipc": "vrl_ipc", "nccl": "vrl_nccl"}


def direct_engine(base: type) -> type:
    """vLLM's weight-transfer engine class `base`, loading an unquantized model's weights in place.

    vLLM's IPC and NCCL engines wrap every update in its layerwise reload (each layer rebuilt from
    metadata, loaded, processed, copied back into the original storage), which weights that need
    processing after loading (quantized kernels) require. A dense model's `load_weights` writes
    straight into its parameters (it fuses and shards), so this engine skips the wrapping unless the
    model is quantized; transport and receive are the base engine's own.
    """

    class Direct(base):  # type: ignore[misc, valid-type]
        def start_weight_update(self) -> None:
            if getattr(self.model_config, "quantization", None):
                super().start_weight_update()

        def finish_weight_update(self) -> None:
            if getattr(self.model_config, "quantization", None):
                super().finish_weight_update()

    Direct.__name__ = Direct.__qualname__ = f"Direct{base.__name__}"
    return Direct


def register_direct_engines() -> None:
    """Register the `DIRECT` engines with vLLM's `WeightTransferEngineFactory` (once per process; the
    engine's workers do it when they import this module, before their model loads)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    for name, base in ((DIRECT["ipc"], ipc_engine_module().IPCWeightTransferEngine),
                       (DIRECT["nccl"], NCCLWeightTransferEngine)):
        try:
            WeightTransferEngineFactory.register_engine(name, direct_engine(base))
        except ValueError:  # registered already (this module was imported before)
            pass


def ipc_engine_module() -> types.ModuleType:
    """vLLM's `weight_transfer.ipc_engine`. vLLM 0.26 imports ray at that module's top, though only its
    'ray' send mode uses it and vLLM does not depend on ray: where ray is absent, the module is imported
    against a stand-in that refuses every use, removed again right after (no other import sees it)."""
    name = "vllm.distributed.weight_transfer.ipc_engine"
    try:
        import vllm.distributed.weight_transfer.ipc_engine as module
        return module
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
    stand_in = types.ModuleType("ray")

    def _refuse(attr: str) -> Any:
        raise ModuleNotFoundError(f"ray is not installed (vLLM's IPC weight transfer asked for ray.{attr})")

    stand_in.__getattr__ = _refuse  # type: ignore[method-assign]
    sys.modules["ray"] = stand_in
    try:
        import importlib

        return importlib.import_module(name)
    finally:
        if sys.modules.get("ray") is stand_in:
            del sys.modules["ray"]


class NativeTransfer:
    """The trainer's side of vLLM's native weight transfer for one engine (`LLM` in this process).

    'ipc': every weight goes as a CUDA IPC handle keyed by the GPU's UUID (vLLM's
    `IPCWeightTransferEngine.trainer_send_weights`, no copy); 'nccl': the trainer joins an NCCL group
    with the engine's workers (rank 0; ranks 1.. are the workers) on its first push and broadcasts
    packed buffers while the workers receive (`update_weights` runs in a thread beside the broadcast).
    """

    def __init__(self, llm: Any, backend: str, device: str, workers: int):
        self.llm, self.backend, self.workers = llm, backend, workers
        self.device = torch.device(device)
        self._group: Any = None

    def _on_device(self) -> Any:
        """The trainer's GPU as the current device (vLLM's senders read it), as a context."""
        import contextlib

        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _connect(self) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
        from vllm.utils.network_utils import get_open_port

        info = {"master_address": "127.0.0.1", "master_port": get_open_port(), "world_size": 1 + self.workers}
        joined = _in_thread(self.llm.init_weight_transfer_engine, {"init_info": {**info, "rank_offset": 1}})
        with self._on_device():
            self._group = NCCLWeightTransferEngine.trainer_init(info)
        joined()

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """One update session (start → update per bucket → finish), finished even when a bucket fails."""
        if self.backend == "nccl" and self._group is None:
            self._connect()
        self.llm.start_weight_update()
        try:
            with self._on_device(), torch.no_grad():
                for bucket in buckets:
                    if self.backend == "ipc":
                        self._send_ipc(bucket)
                        release_shared()
                    else:
                        self._send_nccl(bucket)
        finally:
            self.llm.finish_weight_update()

    def _send_ipc(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        from dataclasses import asdict

        engine = ipc_engine_module().IPCWeightTransferEngine

        def to_engine(info: Any) -> None:
            self.llm.update_weights({"update_info": asdict(info)})

        engine.trainer_send_weights(iter(weights), {"send_mode": to_engine})

    def _send_nccl(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        update = {"names": [n for n, _ in weights], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
                  "shapes": [list(t.shape) for _, t in weights], "packed": True}
        received = _in_thread(self.llm.update_weights, {"update_info": update})
        NCCLWeightTransferEngine.trainer_send_weights(iter(weights), {"group": self._group, "packed": True})
        received()


def _own(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """`bucket` with each CUDA tensor copied on its GPU: torch refuses to hand on a CUDA tensor this process
    received from another by IPC handle ("Attempted to send CUDA tensor received from another process")."""
    return [(name, t.clone() if t.is_cuda else t) for name, t in bucket]


def _in_thread(fn: Any, *args: Any) -> Any:
    """Run `fn(*args)` in a thread (a call that must run beside this one's collective); returns a
    function that waits for it and raises what it raised."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as exc:  # handed to the waiting caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="vrl-weight-transfer", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if failure:
            raise failure[0]

    return wait


_STORAGE_DEVICE = 6  # position of the device ordinal in torch's rebuild_cuda_tensor arguments


def visible_ids() -> list[str]:
    """The physical ids of the GPUs this process sees, in its order."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


# -- inside the engine's workers -------------------------------------------------------------------
_LORA = re.compile(r"(^|\.)lora_|\.base_layer\.")


if "vllm" in sys.modules:  # inside an engine's worker: before it builds its weight-transfer engine
    try:
        register_direct_engines()
    except ImportError as exc:  # an older vLLM: no native weight transfer ('extension' still works)
        log.debug("vLLM's native weight transfer is unavailable: %s", exc)


class LoadWeightsExtension(WorkerBase):
    """The worker extension of modes 'trained' and 'sample': whole weights loaded in place (vrl's own
    loader; vLLM's native transfer engines need nothing here but the import above), or a trained LoRA
    adapter written into its slot."""

    def vrl_adapter_setup(self, hf_shapes: dict[str, list[int]], adapted: list[str], rank: int) -> dict[str, object]:
        """Pin `AdapterTransfer.ID` to a LoRA slot and find the stacks of each `adapted` weight in it; returns
        a summary, or {"unserved": why} when the engine's LoRA layers do not serve one of them."""
        from vrl.generate.vllm_slots import AdapterSlot, pin_empty_adapters, served_lora_layers

        served = served_lora_layers(self, hf_shapes, adapted)
        if isinstance(served, str):
            return {"unserved": served}
        _, _, layers = served
        [slot] = pin_empty_adapters(self, [AdapterTransfer.ID], rank)
        self._vrl_adapter = AdapterSlot(layers, slot)
        return {"slot": slot, "matrices": len(layers)}

    def vrl_adapter_write(self, payload: list[tuple[str, object]]) -> float:
        """Write the adapter's factors (sent as `<weight>|lora_a`, `<weight>|lora_b`) into its slot; returns
        the seconds the write took (synchronised)."""
        slot = getattr(self, "_vrl_adapter", None)
        if slot is None:
            raise RuntimeError("call vrl_adapter_setup before writing an adapter")
        tensors = dict(rebuild_weights(payload))
        names = {n.rsplit("|", 1)[0] for n in tensors}
        return _timed(slot.write, {n: (tensors[n + _A], tensors[n + _B]) for n in names})

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
