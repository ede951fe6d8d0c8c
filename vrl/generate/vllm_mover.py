"""The driver half of how a vLLM engine's weights move: `Mover`, one subclass per engine mode, each
paired with its worker extension in the same module (`vllm_inplace`: full-rank ES in place;
`vllm_slots`: low-rank ES members in LoRA slots; `vllm_trained`: weights pushed from a trained copy
or from ready tensors), and `EngineWeights`, what the two ES movers' weights share.

The sampler (`vrl.generate.vllm.VLLMGenerator`) owns the engine and asks its mover to get the
weights ready before each generation pass; benchmarks read a mover's timings through `counters()`.
torch is imported where it is used: the sampler's module must stay importable without it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from vrl.policy import PerturbationSpec, Unsupported
from vrl.weights.update import Update

if TYPE_CHECKING:
    import torch


class Mover:
    """How one engine's weights move; the engine's mode picks the subclass (`vrl.generate.vllm.MOVERS`)."""

    #: The worker extension vLLM mixes into the engine's workers for this mover (a qualified name).
    extension: ClassVar[str] = ""

    def __init__(self, engine: Any):
        self.engine = engine  # the VLLMGenerator: rpc, weights_changed, sleep state, model path
        self.params: EngineWeights | None = None  # ES's weights, once `perturbable` made them (ES movers)
        self._counters: dict[str, float] = {}

    def before_pass(self) -> None:
        """Write what the engine owes before a generation pass reads its weights (nothing by default)."""

    def lora_request(self) -> Any:
        """The LoRA adapter every plain generation request runs with (None: the engine's own weights)."""
        return None

    def perturbable(self, spec: PerturbationSpec) -> Any:
        """ES's weights for `spec` (`EngineParams` or `EngineLowRank`); only the ES movers have them."""
        raise Unsupported(f"{type(self).__name__} does not perturb the engine's weights")

    def counters(self) -> dict[str, float]:
        """Seconds of this mover's last operations (e.g. `sync_s`, `members_s`, `update_worker_s`: the
        last ES update inside the workers)."""
        out = dict(self._counters)
        if self.params is not None and self.params.last_update_s is not None:
            out["update_worker_s"] = self.params.last_update_s
        return out

    def _count(self, name: str, seconds: float | None) -> None:
        if seconds is not None:
            self._counters[name] = float(seconds)

    def _timed(self, name: str, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        self._count(name, time.perf_counter() - start)
        return out


class EngineWeights:
    """θ of the selected HF parameters, kept by the engine's workers (`vllm_worker.MasterExtension`):
    the update, snapshots and checks that full-rank and low-rank ES share."""

    def __init__(self, generator: Any, hf_shapes: dict[str, list[int]]):
        self.generator, self.hf_shapes, self.names = generator, hf_shapes, list(hf_shapes)
        self.last_update_s: float | None = None  # the last update's time inside the workers (the slowest)

    def flush(self) -> None:
        """Write what the engine owes before anything reads its weights (nothing by default)."""

    def _written(self) -> None:
        """The engine now holds cast(θ) in every selected weight."""
        self.generator.weights_changed()

    def update(self, update: Update) -> None:
        if not update:
            return
        times = self.generator.rpc("vrl_update", update.to_wire())  # engine ← cast(θ')
        self.last_update_s = max(float(t) for t in times)
        self._written()

    def checksum(self) -> str:
        """θ's fingerprint, computed inside the workers (one per tensor-parallel shard, joined)."""
        return "/".join(self.generator.rpc("vrl_checksum"))

    def state(self) -> dict[str, torch.Tensor]:
        from vrl.generate.vllm_worker import unpack_tensor

        return {n: unpack_tensor(v) for n, v in self.generator.rpc("vrl_state")[0].items()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in state or list(state[n].shape) != self.hf_shapes[n]]
        if missing:
            raise ValueError(f"snapshot does not match the model at parameter {missing[0]}")
        from vrl.generate.vllm_worker import pack_tensor

        self.generator.rpc("vrl_load_state", {n: pack_tensor(state[n].float()) for n in self.names})
        self._written()

    def engine_weights(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The engine's current (base) values of HF parameters `names`, un-fused (CPU copies)."""
        self.flush()
        return self.generator.rpc("vrl_hf_weights", self.hf_shapes, list(names))[0]
