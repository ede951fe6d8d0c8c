"""Low-rank ES with its members in LoRA slots: the base weights hold θ (updated in place, bit for bit
as the `hf` backend does) and each member of a call is served from its own LoRA adapter slot, so all
members sample in one generation pass.

Driver half: `LoRASlots` (the mover of an engine started in mode 'lowrank') and `EngineLowRank`;
worker half: `lora_slices`, `LowRankEngine` and `LoRASlotsExtension`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vrl.generate.vllm_lora import lora_factors_many, lora_scales
from vrl.generate.vllm_mover import EngineWeights, Mover
from vrl.generate.vllm_worker import MasterExtension, Slot, _timed, pack_tensor, slot_views, unpack_tensor
from vrl.policy import PerturbationSpec, Unsupported
from vrl.weights import noise as nz
from vrl.weights.factors import factor_keys_many
from vrl.weights.flat import FlatParams, triton_available
from vrl.weights.lowrank import LowRankParams
from vrl.weights.update import LowRankUpdate

log = logging.getLogger(__name__)


class LoRASlots(Mover):
    """Mode 'lowrank': a call's members are written into the engine's LoRA slots, then sampled at once."""

    extension = "vrl.generate.vllm_slots.LoRASlotsExtension"

    def __init__(self, engine: Any, slots: int = 0):
        super().__init__(engine)
        self.slots = slots  # LoRA slots the engine was started with (one per low-rank member of a call)
        self.params: EngineLowRank | None = None

    def perturbable(self, spec: PerturbationSpec) -> EngineLowRank:
        """Low-rank ES over the engine's selected linear layers, members served from its LoRA slots."""
        from vrl.generate.hf import meta_model
        from vrl.weights.lowrank import select_linear

        if not self.slots:
            raise Unsupported(
                "this vLLM engine was started without LoRA slots, which es.noise=lowrank serves its members "
                "from; start it with the ES run's needs (make_generator(config, optimizer.needs()))"
            )
        engine = self.engine
        chosen = select_linear(meta_model(engine.model_path, engine.revision), spec.include, spec.exclude)
        shapes = {name: list(module.weight.shape) for name, module in chosen}  # names of the weights
        self.params = EngineLowRank(engine, shapes, spec.rank, spec.sigma, self.slots)
        return self.params

    def load(self, members: Sequence[tuple[int, int]]) -> None:
        """Write a call's members (seed, sign) into the slots, timed as `members_s`."""
        if self.params is None:
            raise RuntimeError("call perturbations(spec) before sampling low-rank members")
        self._timed("members_s", self.params.load, members)


class EngineLowRank(EngineWeights):
    """What `LowRankParams` is for the hf backend, for weights that live in a vLLM engine.

    The workers keep θ (fp32) of the selected matrices and write `update`s into the engine's base
    weights bit for bit as the hf backend does; `load` writes a call's members into the engine's
    LoRA slots (`LowRankEngine`), and the generator tags each member's
    requests with its slot. Base weights never change between members, so `restore` is a no-op.
    """

    def __init__(self, generator: Any, hf_shapes: dict[str, list[int]], rank: int, sigma: float, slots: int):
        super().__init__(generator, hf_shapes)
        self.rank, self.sigma = rank, sigma
        info = generator.rpc("vrl_lowrank_setup", hf_shapes, rank, slots)[0]
        if "unserved" in info:  # selected weights the engine's LoRA layers do not serve (says the fix)
            raise Unsupported(str(info["unserved"]))
        self.numel, self.dtype, self.slots = int(info["numel"]), str(info["dtype"]), list(info["slots"])
        self.lora_dtype = str(info["lora_dtype"])
        log.info("low-rank ES in the engine: %d matrices, %d parameters, %d LoRA slots (%s)",
                 info["matrices"], self.numel, len(self.slots), self.lora_dtype)

    def load(self, members: Sequence[tuple[int, int]]) -> None:
        """Write members (seed, sign) into LoRA slots 0, 1, ... (adapter ids 1, 2, ...)."""
        if len(members) > len(self.slots):
            raise ValueError(f"{len(members)} low-rank members in one call, but this engine has {len(self.slots)} "
                             "LoRA slots (one per es.population_size member)")
        self.generator.rpc("vrl_lowrank_members", [(int(s), int(g)) for s, g in members], float(self.sigma))

    def perturb(self, seed: int, sign: int, sigma: float) -> None:
        raise Unsupported("low-rank members are served from LoRA slots (VLLMGenerator.sample), not written into "
                          "the base weights")

    def restore(self) -> None:
        """Nothing to do: members never change the base weights."""

    def slot(self, name: str, member: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(lora_a, lora_b) of matrix `name` for member position `member` of the last `load` (checks)."""
        a, b = self.generator.rpc("vrl_lora_slot", name, self.slots[member])[0]
        return unpack_tensor(a), unpack_tensor(b)


# -- inside the engine's workers -------------------------------------------------------------------
@dataclass(frozen=True)
class LoRASlice:
    """Where the engine's LoRA path serves one HF linear weight: slice `index` of LoRA layer `module`."""

    hf_name: str
    module: str
    index: int


def lora_slices(layout: Mapping[str, Slot], modules: Mapping[str, Sequence[int]]) -> dict[str, LoRASlice]:
    """Map each HF weight to the LoRA slice whose output rows are the ones that hold it.

    `modules`: each LoRA layer's name and its output slice sizes (vLLM's `output_slices`: one per
    fused member, e.g. q, k, v of `qkv_proj`). A weight at rows [row, row + rows) of engine tensor
    `<module>.weight` is the slice starting at `row` with `rows` rows. Raises ValueError naming the
    weights the engine's LoRA path does not serve.
    """
    out: dict[str, LoRASlice] = {}
    missing: list[str] = []
    for name, slot in layout.items():
        module = slot.engine_name.removesuffix(".weight")
        sizes = modules.get(module)
        offsets = list(itertools.accumulate([0, *sizes]))[:-1] if sizes else []
        hit = next((k for k, (o, size) in enumerate(zip(offsets, sizes or ())) if o == slot.row and size == slot.rows), None)
        if hit is None:
            missing.append(name)
        else:
            out[name] = LoRASlice(name, module, hit)
    if missing:
        served = sorted({m.rsplit(".", 1)[-1] for m in modules})
        raise ValueError(
            f"the vLLM engine's LoRA path does not serve {len(missing)} selected weight(s), e.g. {missing[0]}; it serves "
            f"the layers {', '.join(served)}. Leave the others out of low-rank ES (es.exclude), or use "
            "generator.backend=hf or es.noise=full"
        )
    return out


class LowRankEngine:
    """Low-rank ES in one engine: θ of the selected matrices (fp32 master, written into the engine's
    base weights by `update`, exactly as `LowRankParams` does on the hf backend) and the members of a
    sampling call written into the engine's LoRA slots.

    Member p of a call lives in LoRA slot `slots[p]` (adapter id p + 1, registered and pinned once,
    never loaded from disk). For matrix W (m×n) with integer factors a (m×r), b (n×r):

        lora_a[slot] = cast(C·bᵀ)          (r×n; C·b is exact in fp32)
        lora_b[slot] = cast(t·a)           (m×r; t = sign·round14(σ·C/√r), t·a exact in fp32)

    so lora_b·lora_a = σ·sign·A·Bᵀ/√r up to one rounding of each factor to the LoRA dtype (bf16:
    2⁻⁸ relative each) and up to C·round14(σ·C/√r) vs round14(σ·C²/√r) (< 2⁻¹⁴ relative). The base
    weights never change between members: there is nothing to restore.
    """

    # Noise elements generated at once by the torch path (CPU, or no triton): bounds its int64
    # temporaries (~64 MB each).
    CHUNK = 1 << 23

    def __init__(self, views: Mapping[str, torch.Tensor], layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                 rank: int, slots: Sequence[int]):
        self.params = LowRankParams(FlatParams.over(dict(views)), rank)
        self.layers = dict(layers)  # HF name → (lora_a stack, lora_b stack) of its slice
        self.rank, self.slots = rank, list(slots)
        by_shape: dict[tuple[int, ...], list[str]] = {}
        for name in self.layers:
            by_shape.setdefault(tuple(views[name].shape), []).append(name)
        self.groups = list(by_shape.items())  # matrices of one shape get their members' factors in one pass
        first_a, _ = next(iter(self.layers.values()))
        # On a GPU one kernel launch per shape draws the factors and writes them into the slots.
        self.use_triton = (first_a.device.type == "cuda" and triton_available()
                           and self.kernel_layout(views, self.layers))
        self._pointers = [
            tuple(torch.tensor([self.layers[n][i].data_ptr() for n in names], dtype=torch.int64, device=first_a.device)
                  for i in (0, 1))
            for _, names in self.groups
        ] if self.use_triton else []

    @staticmethod
    def kernel_layout(views: Mapping[str, torch.Tensor], layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether every stack is what `vllm_lora_triton.lora_slots` addresses by pointer arithmetic:
        contiguous lora_a S×1×R×n and lora_b S×1×m×R of one dtype, S and R the same for all (else the
        torch path, which indexes, writes them)."""
        first_a, _ = next(iter(layers.values()))
        slots, max_rank = first_a.shape[0], first_a.shape[2]
        for name, (a, b) in layers.items():
            m, n = views[name].shape
            if not (a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype == first_a.dtype
                    and tuple(a.shape) == (slots, 1, max_rank, n) and tuple(b.shape) == (slots, 1, m, max_rank)):
                return False
        return True

    @torch.no_grad()
    def load_members(self, members: Sequence[tuple[int, int]], sigma: float) -> None:
        """Write member p = (seed, sign) into LoRA slot `slots[p]`, for every selected matrix."""
        if not members:
            return
        r, k = self.rank, len(members)
        first_a, _ = next(iter(self.layers.values()))
        device, dtype = first_a.device, first_a.dtype
        index = torch.tensor(self.slots[:k], device=device)
        if self.use_triton:
            self._load_members_triton(members, sigma, index, first_a)
            return
        for shape, names in self.groups:
            per_chunk = max(1, self.CHUNK // (k * r * max(shape)))
            for at in range(0, len(names), per_chunk):
                chunk = names[at:at + per_chunk]
                lora_a, lora_b = lora_factors_many(members, chunk, shape, r, sigma, device, dtype)
                for name, la, lb in zip(chunk, lora_a, lora_b):
                    a_stack, b_stack = self.layers[name]
                    a_stack[index, 0, :r, :] = la
                    b_stack[index, 0, :, :r] = lb
                    if a_stack.shape[2] > r:  # the engine's max_lora_rank is above es.rank: the rest stays zero
                        a_stack[index, 0, r:, :] = 0
                        b_stack[index, 0, :, r:] = 0

    def _load_members_triton(self, members: Sequence[tuple[int, int]], sigma: float, index: torch.Tensor,
                             ref: torch.Tensor) -> None:
        """`load_members` in one kernel launch per matrix shape (the same bits as the torch path)."""
        from vrl.generate.vllm_lora_triton import lora_slots  # imports triton: GPU only

        r, device = self.rank, ref.device
        scales = lora_scales(members, r, sigma, device)
        names = [name for _, group in self.groups for name in group]
        keys = factor_keys_many([seed for seed, _ in members], names).to(device)
        at = 0
        for (shape, group), (a_ptrs, b_ptrs) in zip(self.groups, self._pointers):
            rows = len(group) * len(members)
            lora_slots(a_ptrs, b_ptrs, ref, keys[at:at + rows], scales, index, shape, ref.shape[2], r, nz.C)
            at += rows

    def update(self, update: LowRankUpdate) -> None:
        self.params.update(update)

    def state(self) -> dict[str, torch.Tensor]:
        return self.params.state()

    def checksum(self) -> str:
        return self.params.checksum()

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.params.load_state(dict(state))


def lora_manager(worker: Any) -> Any:
    """The LoRA adapter manager of an engine's worker; refuses an engine started without LoRA."""
    manager = getattr(getattr(worker.model_runner, "lora_manager", None), "_adapter_manager", None)
    if manager is None:
        raise ValueError("this engine was started without LoRA (enable_lora); its LoRA slots are where vrl writes "
                         "low-rank ES members and served adapters")
    return manager


def served_lora_layers(worker: Any, hf_shapes: Mapping[str, Sequence[int]], names: Sequence[str] | None = None) -> Any:
    """(engine parameters, layout, {HF weight: (lora_a stack, lora_b stack)}) for the weights `names`
    (default: every weight `hf_shapes` names; the layout needs the shapes of a fused weight's siblings
    too), each stack the LoRA layer's slice that serves the weight's rows; or why the engine's LoRA
    path does not serve one of them (a str: vLLM hands the driver a worker's exception without its message)."""
    manager = lora_manager(worker)
    params, layout = worker._vrl_layout(hf_shapes, whole=True)
    modules = {name: list(m.output_slices) for name, m in manager.modules.items()
               if hasattr(m, "lora_a_stacked") and hasattr(m, "output_slices")}
    try:
        slices = lora_slices(layout if names is None else {n: layout[n] for n in names}, modules)
    except ValueError as exc:
        return str(exc)
    layers = {n: (manager.modules[s.module].lora_a_stacked[s.index], manager.modules[s.module].lora_b_stacked[s.index])
              for n, s in slices.items()}
    return params, layout, layers


def pin_empty_adapters(worker: Any, ids: Sequence[int], rank: int) -> list[int]:
    """Register vLLM's zero adapter (as for its warm-up) under `ids`, pinned to LoRA slots and never
    loaded from disk (requests name them with a placeholder path); returns their slots."""
    manager = lora_manager(worker)
    ids = list(ids)
    if len(ids) > manager.lora_slots:
        raise ValueError(f"{len(ids)} adapters but the engine has {manager.lora_slots} LoRA slots (max_loras)")
    zeros = None
    for i in ids:
        if i not in manager.list_adapters():
            if zeros is None:
                embedding = getattr(worker.model_runner.lora_manager, "embedding_modules", {})
                zeros = manager.create_dummy_lora(i, rank, embedding)
            manager.add_adapter(zeros if zeros.id == i else zeros.clone(i))
        manager.pin_adapter(i)
    return [manager.lora_index_to_id.index(i) for i in ids]


class AdapterSlot:
    """A trained LoRA adapter held in one LoRA slot of an engine (GRPO with weight_transfer=adapter): each
    push writes every adapted weight's (A, s·B) into the slot's stacks, zeros beyond its rank."""

    def __init__(self, layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]], slot: int):
        self.layers, self.slot = dict(layers), slot

    @torch.no_grad()
    def write(self, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        if set(factors) != set(self.layers):
            odd = sorted(set(factors) ^ set(self.layers))
            raise ValueError(f"the adapter's weights changed since the engine took its first push (e.g. {odd[0]})")
        for name, (a, b) in factors.items():
            a_stack, b_stack = self.layers[name]
            r = a.shape[0]
            if r > a_stack.shape[2]:
                raise ValueError(f"{name}: adapter rank {r} is above the engine's max_lora_rank {a_stack.shape[2]}")
            a_stack[self.slot, 0, :r, :].copy_(a)
            b_stack[self.slot, 0, :, :r].copy_(b)
            if a_stack.shape[2] > r:
                a_stack[self.slot, 0, r:, :].zero_()
                b_stack[self.slot, 0, :, r:].zero_()


class LoRASlotsExtension(MasterExtension):
    """The worker extension of mode 'lowrank': members into LoRA slots over `LowRankEngine` (update and
    snapshots: `MasterExtension`)."""

    def vrl_lowrank_setup(self, hf_shapes: dict[str, list[int]], rank: int, members: int) -> dict[str, object]:
        """Register `members` empty adapters (ids 1..members, pinned to LoRA slots, never loaded from
        disk) and build the low-rank ES state over the selected matrices; returns a summary, or
        {"unserved": why} (before anything is registered) when the LoRA layers do not serve a selected
        weight: vLLM hands the driver a worker's exception without its message."""
        served = served_lora_layers(self, hf_shapes)
        if isinstance(served, str):
            return {"unserved": served}
        params, layout, layers = served
        slots = pin_empty_adapters(self, range(1, members + 1), rank)
        self._vrl_master = LowRankEngine(slot_views(params, layout), layers, rank, slots)
        flat = self._vrl_master.params.flat
        lora_dtype = str(next(iter(layers.values()))[0].dtype).removeprefix("torch.")
        log.info("vrl: low-rank ES over %d matrices in %d LoRA slots (rank %d, %s)", len(layers), members, rank, lora_dtype)
        return {"numel": flat.numel, "dtype": flat.dtype, "matrices": len(layers), "slots": slots, "lora_dtype": lora_dtype}

    def vrl_lowrank_members(self, members: list[tuple[int, int]], sigma: float) -> float:
        return _timed(self._vrl_require().load_members, [(int(s), int(g)) for s, g in members], float(sigma))

    def vrl_lora_slot(self, hf_name: str, slot: int) -> tuple[object, object]:
        """(lora_a, lora_b) of one matrix in one LoRA slot, packed CPU copies (for checks)."""
        a_stack, b_stack = self._vrl_require().layers[hf_name]
        return pack_tensor(a_stack[slot, 0]), pack_tensor(b_stack[slot, 0])
