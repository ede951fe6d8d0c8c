"""Full-rank ES in place: each member's perturbation is written straight into the engine's own (fused)
weights and θ restored after it, bit for bit as the `hf` backend moves its weights.

Driver half: `InPlace` (the mover of an engine started in mode 'perturb') and `EngineParams`;
worker half: `EngineES` (the fp32 master θ over the engine rows) and `InPlaceExtension`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vrl.generate.vllm_mover import EngineWeights, Mover
from vrl.generate.vllm_worker import MasterExtension, _timed, slot_views
from vrl.policy import PerturbationSpec
from vrl.weights.flat import FlatParams
from vrl.weights.update import FullRankUpdate, check_kind

log = logging.getLogger(__name__)


class InPlace(Mover):
    """Mode 'perturb': ES members perturb the engine's weights one after another."""

    extension = "vrl.generate.vllm_inplace.InPlaceExtension"

    def __init__(self, engine: Any):
        super().__init__(engine)
        self.params: EngineParams | None = None

    def perturbable(self, spec: PerturbationSpec) -> EngineParams:
        return self.es_params(spec.include, spec.exclude)

    def es_params(self, include: Sequence[str], exclude: Sequence[str]) -> EngineParams:
        """The engine's selected weights as seeded perturbations move them (an fp32 θ in the worker)."""
        from vrl.generate.hf import meta_model
        from vrl.weights.flat import select_parameters

        engine = self.engine
        chosen = select_parameters(meta_model(engine.model_path, engine.revision), include, exclude)
        self.params = EngineParams(engine, {n: list(p.shape) for n, p in chosen})
        return self.params

    def before_pass(self) -> None:
        if self.params is not None:
            self.params.flush()


class EngineParams(EngineWeights):
    """What `FlatParams` is for the hf backend, for weights that live in a vLLM engine.

    Same interface (perturb, restore, update, state, load_state); each call runs in the engine's
    workers, which hold the fp32 master θ in HF layout and write into the fused engine tensors.

    `restore` is deferred: ES restores after every member, but the next member's `perturb` (or the
    iteration's `update`) rewrites every selected weight anyway, so the engine only writes cast(θ)
    when something is about to read it (`flush`: the generator's next pass, `engine_weights`). A
    member then costs one pass over the weights instead of two.
    """

    def __init__(self, generator: Any, hf_shapes: dict[str, list[int]]):
        super().__init__(generator, hf_shapes)
        info = generator.rpc("vrl_es_setup", hf_shapes)[0]
        self.numel = int(info["numel"])
        self._dtype = str(info["dtype"])
        self._restore_due = False
        log.info("ES in the engine: %d HF tensors in %d engine tensors, %d parameters",
                 info["tensors"], info["engine_tensors"], self.numel)

    @property
    def dtype(self) -> str:
        return self._dtype

    def perturb(self, seed: int, sign: int, sigma: float) -> None:
        self.generator.rpc("vrl_es_perturb", seed, sign, sigma)  # overwrites every selected weight
        self._restore_due = False
        self.generator.weights_changed()

    def restore(self) -> None:
        """Mark the engine for cast(θ); written by `flush` before anything reads the weights."""
        self._restore_due = True

    def flush(self) -> None:
        """Write a deferred restore into the engine (no-op when none is due)."""
        if self._restore_due:
            self.generator.rpc("vrl_es_restore")
            self._written()

    def _written(self) -> None:
        self._restore_due = False
        super()._written()


# -- inside the engine's workers -------------------------------------------------------------------
class EngineES:
    """ES state for one engine's weights: the HF-layout fp32 master θ, written straight into the engine rows.

    `perturb` writes cast(θ + σ·sign·ε(seed)) into the engine rows and `restore` writes cast(θ)
    (bit-exact), each in one fused pass that reads θ once and writes each weight once; `update`
    applies ES update terms to θ in fp32 and writes cast(θ). Noise comes from the same `FlatParams`
    code as the `hf` backend, so the result does not depend on where a tensor lives. Extra device
    memory: θ only (4 bytes per parameter); there is no staging copy of the weights.
    """

    def __init__(self, views: Mapping[str, torch.Tensor]):
        self.flat = FlatParams.over(dict(views))
        self.names = list(views)

    @torch.no_grad()
    def perturb(self, seed: int, sign: int, sigma: float) -> None:
        self.flat.perturb(seed, sign, sigma)

    @torch.no_grad()
    def restore(self) -> None:
        self.flat.restore()

    @torch.no_grad()
    def update(self, *iterations: FullRankUpdate) -> None:
        """θ ← θ + Σⱼ cⱼ·s(seedⱼ) for each iteration's update in order; the engine then holds cast(θ)."""
        wrote = False
        for update in iterations:
            check_kind(update, "full")
            if update:
                self.flat.update(update)  # writes cast(θ) into the engine as it goes
                wrote = True
        if not wrote:
            self.flat.restore()  # still leave the engine at cast(θ), as after any update

    def state(self) -> dict[str, torch.Tensor]:
        return self.flat.state()

    def checksum(self) -> str:
        return self.flat.checksum()

    @torch.no_grad()
    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.flat.load_state(dict(state))


class InPlaceExtension(MasterExtension):
    """The worker extension of mode 'perturb': perturb and restore over `EngineES` (update and snapshots:
    `MasterExtension`)."""

    def vrl_es_setup(self, hf_shapes: dict[str, list[int]]) -> dict[str, object]:
        """Build the HF-layout ES state from the engine's current weights (θ₀); returns a summary."""
        params, layout = self._vrl_layout(hf_shapes, whole=True)
        self._vrl_master = EngineES(slot_views(params, layout))
        flat = self._vrl_master.flat
        log.info("vrl: in-engine ES over %d HF tensors in %d engine tensors", len(layout),
                 len({s.engine_name for s in layout.values()}))
        return {"numel": flat.numel, "dtype": flat.dtype, "tensors": len(layout),
                "engine_tensors": len({s.engine_name for s in layout.values()})}

    def vrl_es_perturb(self, seed: int, sign: int, sigma: float) -> float:
        return _timed(self._vrl_require().perturb, seed, sign, sigma)

    def vrl_es_restore(self) -> float:
        return _timed(self._vrl_require().restore)
