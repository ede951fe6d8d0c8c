"""Inside the vLLM engine, what every way of moving weights shares: where each HF parameter lives in
the engine's tensors, tensors across the RPC boundary, and `WorkerBase`, the base of each mode's
worker extension (`vllm_inplace.InPlaceExtension`, `vllm_slots.LoRASlotsExtension`,
`vllm_trained.LoadWeightsExtension`; one per engine, chosen by its mode).

vLLM fuses some Hugging Face parameters into
one tensor (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`) and pads vocabulary rows. ES noise
is defined per *Hugging Face* parameter (`vrl.weights.noise`: member seed, HF name, element index),
so `engine_layout` maps each HF parameter explicitly to the rows of the engine tensor that hold
it. The worker keeps the fp32 master θ in HF layout (`FlatParams.over` those rows, the code the
`hf` backend uses) and one fused Triton launch writes a perturbation straight into the rows. A
member therefore sees bit for bit the weights the `hf` backend would (`vllm_inplace`).

This module imports no vLLM: the mapping is tested on CPU (tests/test_vllm_layout.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vrl.weights.update import update_from_wire

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slot:
    """Where one HF parameter lives in the engine: rows [row, row + rows) of `engine_name`."""

    hf_name: str
    engine_name: str
    row: int
    rows: int


def engine_layout(
    hf_shapes: Mapping[str, Sequence[int]],
    engine_shapes: Mapping[str, Sequence[int]],
    packed: Mapping[str, Sequence[str]],
) -> dict[str, Slot]:
    """Map each HF parameter to its rows in the engine's tensors.

    `packed` is vLLM's `packed_modules_mapping` (e.g. {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}):
    a fused tensor holds its members' rows one after another, in that order, so a member's first
    row is the sum of the rows of the members before it (taken from the HF shapes). Unfused
    parameters keep their names; an engine tensor may have extra rows (vLLM pads vocabularies).
    Trailing dimensions must agree exactly. Raises ValueError naming the first parameter that
    does not fit.
    """
    member_of = {sub: (fused, i, subs) for fused, subs in packed.items() for i, sub in enumerate(subs)}
    layout: dict[str, Slot] = {}
    for name, shape in hf_shapes.items():
        shape = tuple(shape)
        parts = name.split(".")
        hit = next(((k, member_of[p]) for k, p in enumerate(parts) if p in member_of), None)
        row = 0
        if hit is None:
            engine_name = name
        else:
            k, (fused, index, subs) = hit
            engine_name = ".".join(parts[:k] + [fused] + parts[k + 1 :])
            for sibling in subs[:index]:
                sib_name = ".".join(parts[:k] + [sibling] + parts[k + 1 :])
                if sib_name not in hf_shapes:
                    raise ValueError(
                        f"cannot place {name} inside {engine_name}: its sibling {sib_name} is not a model parameter"
                    )
                row += int(hf_shapes[sib_name][0])
        if engine_name not in engine_shapes:
            sample = ", ".join(list(engine_shapes)[:4])
            raise ValueError(
                f"HF parameter {name} has no engine tensor {engine_name} (engine tensors look like: {sample}, ...); "
                "this architecture's names differ between transformers and vLLM, so in-engine ES cannot map it"
            )
        eshape = tuple(engine_shapes[engine_name])
        if eshape[1:] != shape[1:] or row + shape[0] > eshape[0]:
            raise ValueError(
                f"HF parameter {name} {list(shape)} does not fit rows {row}.. of engine tensor "
                f"{engine_name} {list(eshape)}"
            )
        if hit is not None and index == len(subs) - 1 and row + shape[0] != eshape[0]:
            raise ValueError(
                f"the members of {engine_name} ({', '.join(subs)}) have {row + shape[0]} rows but the engine "
                f"tensor has {eshape[0]}"
            )
        layout[name] = Slot(name, engine_name, row, int(shape[0]))
    _check_disjoint(layout)
    return layout


def _check_disjoint(layout: Mapping[str, Slot]) -> None:
    by_engine: dict[str, list[Slot]] = {}
    for slot in layout.values():
        by_engine.setdefault(slot.engine_name, []).append(slot)
    for engine_name, slots in by_engine.items():
        slots.sort(key=lambda s: s.row)
        for a, b in itertools.pairwise(slots):
            if a.row + a.rows > b.row:
                raise ValueError(f"{a.hf_name} and {b.hf_name} overlap inside engine tensor {engine_name}")


def engine_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The engine's parameters by name; a layer wrapped for LoRA keeps its weight under `.base_layer.`,
    which is dropped so names match an engine without LoRA (LoRA slots are not parameters)."""
    return {n.replace(".base_layer.", "."): p for n, p in model.named_parameters()}


def slot_views(params: Mapping[str, torch.Tensor], layout: Mapping[str, Slot]) -> dict[str, torch.Tensor]:
    """For each HF name, the view of the engine tensor rows that hold it (writes go to the engine)."""
    return {name: params[s.engine_name].data[s.row : s.row + s.rows] for name, s in layout.items()}


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def pack_tensor(t: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    """A CPU tensor as plain msgpack data: vLLM decodes tensor arguments of collective_rpc untyped."""
    t = t.detach().cpu().contiguous()
    return ("vrl-tensor", str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes())


def unpack_tensor(item: object) -> torch.Tensor:
    """The inverse of `pack_tensor` (a tensor passes through unchanged)."""
    if isinstance(item, torch.Tensor):
        return item
    tag, dtype, shape, data = item  # type: ignore[misc]
    if tag != "vrl-tensor":
        raise ValueError(f"expected a packed tensor, got {tag!r}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


def rebuild_weights(payload: Sequence[tuple[str, object]]) -> list[tuple[str, torch.Tensor]]:
    """Tensors sent by the driver: tensors as they are, CUDA IPC handles (rebuild, args) opened here."""
    out = []
    for name, item in payload:
        if isinstance(item, torch.Tensor):
            out.append((name, item))
        elif isinstance(item, (list, tuple)) and item and item[0] == "vrl-tensor":
            out.append((name, unpack_tensor(item)))
        else:
            rebuild, args = item  # type: ignore[misc]
            # The handle names the sender's device ordinal; the engine sees the same GPUs in the same order.
            out.append((name, rebuild(*args)))
    return out


class WorkerBase:
    """What every mover's worker extension shares: the engine's model, its parameters' shapes, where
    each HF parameter lives in them, and reading them back (checks). vLLM mixes the extension of the
    engine's mode into each worker (`LLM(worker_extension_cls=...)`); the driver calls its `vrl_*`
    methods with `llm.collective_rpc`."""

    def _vrl_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def vrl_engine_shapes(self) -> dict[str, list[int]]:
        """Engine parameter names and shapes (this worker's shard)."""
        return {n: list(p.shape) for n, p in engine_params(self._vrl_model()).items()}

    def _vrl_layout(self, hf_shapes: Mapping[str, Sequence[int]], whole: bool = False
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Slot]]:
        """The engine's parameters and where each HF parameter lives in them; `whole`: refuse a
        tensor-parallel shard (ES moves the whole model in one worker)."""
        if whole and self.parallel_config.tensor_parallel_size != 1:  # type: ignore[attr-defined]
            raise ValueError("in-engine ES needs generator.vllm.tensor_parallel_size=1 (one engine per GPU)")
        model = self._vrl_model()
        params = engine_params(model)
        layout = engine_layout(hf_shapes, {n: p.shape for n, p in params.items()},
                               getattr(model, "packed_modules_mapping", {}) or {})
        return params, layout

    def vrl_hf_weights(self, hf_shapes: dict[str, list[int]], names: list[str]) -> dict[str, torch.Tensor]:
        """The engine's current values of some HF parameters, un-fused (CPU copies), for checks."""
        params, layout = self._vrl_layout(hf_shapes)
        views = slot_views(params, {n: layout[n] for n in names})
        return {n: v.detach().to("cpu", copy=True) for n, v in views.items()}


class MasterExtension(WorkerBase):
    """What the two ES extensions share: the fp32 master θ their setup builds (`_vrl_master`: `EngineES`
    or `LowRankEngine`), updated, snapshotted and restored through the same three methods."""

    def _vrl_require(self):  # noqa: ANN202 - the mode's master
        master = getattr(self, "_vrl_master", None)
        if master is None:
            raise RuntimeError("call the extension's setup (vrl_es_setup or vrl_lowrank_setup) before moving θ")
        return master

    # Each call waits for its GPU work and returns the seconds it took inside the worker, so the
    # driver's clock measures finished work (and benchmarks can separate it from RPC overhead).
    def vrl_update(self, update: dict[str, object]) -> float:
        """Apply an update sent as its `to_wire` data (collective_rpc carries plain data)."""
        return _timed(self._vrl_require().update, update_from_wire(update))

    def vrl_state(self) -> dict[str, object]:
        # Packed explicitly: vLLM's RPC encoding of tensors is not a contract we can rely on.
        return {n: pack_tensor(v) for n, v in self._vrl_require().state().items()}

    def vrl_checksum(self) -> str:
        return self._vrl_require().checksum()

    def vrl_load_state(self, state: dict[str, object]) -> None:
        self._vrl_require().load_state({n: unpack_tensor(v) for n, v in state.items()})
