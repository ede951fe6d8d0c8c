"""Inside the vLLM engine: ES perturbation on the engine's own (fused) weights, and weight loading.

`VRLWorkerExtension` is mixed into every vLLM worker (`LLM(worker_extension_cls=...)`); the driver
calls its `vrl_*` methods with `llm.collective_rpc`. vLLM fuses some Hugging Face parameters into
one tensor (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`) and pads vocabulary rows. ES noise
is defined per *Hugging Face* parameter (`vrl.weights.noise`: member seed, HF name, element index),
so `engine_layout` maps each HF parameter explicitly to the rows of the engine tensor that hold
it. The worker keeps the fp32 master θ in HF layout (`FlatParams.over` those rows, the code the
`hf` backend uses) and one fused Triton launch writes a perturbation straight into the rows. A
member therefore sees bit for bit the weights the `hf` backend would.

This module imports no vLLM: the mapping is tested on CPU (tests/test_vllm_layout.py).
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vrl.generate.vllm_lora import lora_factors_many, lora_scales
from vrl.weights import noise as nz
from vrl.weights.factors import factor_keys_many
from vrl.weights.flat import FlatParams, triton_available
from vrl.weights.lowrank import LowRankParams
from vrl.weights.update import FullRankUpdate, LowRankUpdate, check_kind, update_from_wire

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


def slot_views(params: Mapping[str, torch.Tensor], layout: Mapping[str, Slot]) -> dict[str, torch.Tensor]:
    """For each HF name, the view of the engine tensor rows that hold it (writes go to the engine)."""
    return {name: params[s.engine_name].data[s.row : s.row + s.rows] for name, s in layout.items()}


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

    @torch.no_grad()
    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.flat.load_state(dict(state))


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

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.params.load_state(dict(state))


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


_LORA = re.compile(r"(^|\.)lora_|\.base_layer\.")


class VRLWorkerExtension:
    """Methods vLLM mixes into each worker; the driver calls them with `llm.collective_rpc("vrl_...")`."""

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

    def vrl_es_setup(self, hf_shapes: dict[str, list[int]]) -> dict[str, object]:
        """Build the HF-layout ES state from the engine's current weights (θ₀); returns a summary."""
        params, layout = self._vrl_layout(hf_shapes, whole=True)
        self._vrl_es = EngineES(slot_views(params, layout))
        flat = self._vrl_es.flat
        log.info("vrl: in-engine ES over %d HF tensors in %d engine tensors", len(layout),
                 len({s.engine_name for s in layout.values()}))
        return {"numel": flat.numel, "dtype": flat.dtype, "tensors": len(layout),
                "engine_tensors": len({s.engine_name for s in layout.values()})}

    def _vrl_require_es(self) -> EngineES:
        es = getattr(self, "_vrl_es", None)
        if es is None:
            raise RuntimeError("call vrl_es_setup before perturbing the engine's weights")
        return es

    # Each call waits for its GPU work and returns the seconds it took inside the worker, so the
    # driver's clock measures finished work (and benchmarks can separate it from RPC overhead).
    def vrl_es_perturb(self, seed: int, sign: int, sigma: float) -> float:
        return _timed(self._vrl_require_es().perturb, seed, sign, sigma)

    def vrl_es_restore(self) -> float:
        return _timed(self._vrl_require_es().restore)

    def vrl_es_update(self, update: dict[str, object]) -> float:
        """Apply an update sent as its `to_wire` data (collective_rpc carries plain data)."""
        return _timed(self._vrl_require_es().update, update_from_wire(update))

    def vrl_es_state(self) -> dict[str, object]:
        # Packed explicitly: vLLM's RPC encoding of tensors is not a contract we can rely on.
        return {n: pack_tensor(v) for n, v in self._vrl_require_es().state().items()}

    def vrl_es_load_state(self, state: dict[str, object]) -> None:
        self._vrl_require_es().load_state({n: unpack_tensor(v) for n, v in state.items()})

    # -- low-rank ES: members in LoRA slots ---------------------------------------------------------
    def vrl_lowrank_setup(self, hf_shapes: dict[str, list[int]], rank: int, members: int) -> dict[str, object]:
        """Register `members` empty adapters (ids 1..members, pinned to LoRA slots, never loaded from
        disk) and build the low-rank ES state over the selected matrices; returns a summary, or
        {"unserved": why} (before anything is registered) when the LoRA layers do not serve a selected
        weight: vLLM hands the driver a worker's exception without its message."""
        manager = getattr(getattr(self.model_runner, "lora_manager", None), "_adapter_manager", None)  # type: ignore[attr-defined]
        if manager is None:
            raise ValueError("this engine was started without LoRA (enable_lora); low-rank ES serves members as LoRA adapters")
        params, layout = self._vrl_layout(hf_shapes, whole=True)
        served = {name: list(m.output_slices) for name, m in manager.modules.items()
                  if hasattr(m, "lora_a_stacked") and hasattr(m, "output_slices")}
        try:
            slices = lora_slices(layout, served)
        except ValueError as exc:
            return {"unserved": str(exc)}
        if members > manager.lora_slots:
            raise ValueError(f"{members} members but the engine has {manager.lora_slots} LoRA slots (max_loras)")
        zeros = None  # vLLM's zero adapter (as for its warm-up), registered under ids 1..members
        for p in range(members):
            if p + 1 not in manager.list_adapters():
                if zeros is None:
                    embedding = getattr(self.model_runner.lora_manager, "embedding_modules", {})  # type: ignore[attr-defined]
                    zeros = manager.create_dummy_lora(p + 1, rank, embedding)
                manager.add_adapter(zeros if zeros.id == p + 1 else zeros.clone(p + 1))
            manager.pin_adapter(p + 1)
        slots = [manager.lora_index_to_id.index(p + 1) for p in range(members)]
        layers = {n: (manager.modules[s.module].lora_a_stacked[s.index], manager.modules[s.module].lora_b_stacked[s.index])
                  for n, s in slices.items()}
        self._vrl_lowrank = LowRankEngine(slot_views(params, layout), layers, rank, slots)
        flat = self._vrl_lowrank.params.flat
        lora_dtype = str(next(iter(layers.values()))[0].dtype).removeprefix("torch.")
        log.info("vrl: low-rank ES over %d matrices in %d LoRA slots (rank %d, %s)", len(slices), members, rank, lora_dtype)
        return {"numel": flat.numel, "dtype": flat.dtype, "matrices": len(slices), "slots": slots, "lora_dtype": lora_dtype}

    def _vrl_require_lowrank(self) -> LowRankEngine:
        state = getattr(self, "_vrl_lowrank", None)
        if state is None:
            raise RuntimeError("call vrl_lowrank_setup before loading low-rank members")
        return state

    def vrl_lowrank_members(self, members: list[tuple[int, int]], sigma: float) -> float:
        return _timed(self._vrl_require_lowrank().load_members, [(int(s), int(g)) for s, g in members], float(sigma))

    def vrl_lowrank_update(self, update: dict[str, object]) -> float:
        return _timed(self._vrl_require_lowrank().update, update_from_wire(update))

    def vrl_lowrank_state(self) -> dict[str, object]:
        return {n: pack_tensor(v) for n, v in self._vrl_require_lowrank().state().items()}

    def vrl_lowrank_load_state(self, state: dict[str, object]) -> None:
        self._vrl_require_lowrank().load_state({n: unpack_tensor(v) for n, v in state.items()})

    def vrl_lora_slot(self, hf_name: str, slot: int) -> tuple[object, object]:
        """(lora_a, lora_b) of one matrix in one LoRA slot, packed CPU copies (for checks)."""
        a_stack, b_stack = self._vrl_require_lowrank().layers[hf_name]
        return pack_tensor(a_stack[slot, 0]), pack_tensor(b_stack[slot, 0])

    def vrl_hf_weights(self, hf_shapes: dict[str, list[int]], names: list[str]) -> dict[str, torch.Tensor]:
        """The engine's current values of some HF parameters, un-fused (CPU copies), for checks."""
        params, layout = self._vrl_layout(hf_shapes)
        views = slot_views(params, {n: layout[n] for n in names})
        return {n: v.detach().to("cpu", copy=True) for n, v in views.items()}

    def vrl_load_weights(self, payload: list[tuple[str, object]]) -> int:
        """Load HF-named weights in place through the model's own `load_weights` (fuses, shards)."""
        weights = rebuild_weights(payload)
        lora = [n for n, _ in weights if _LORA.search(n)]
        if lora:
            raise ValueError(f"got LoRA parameter names ({lora[0]}, ...); merge adapters before syncing weights")
        model = self._vrl_model()
        with torch.no_grad():
            model.load_weights(weights=iter(weights))
        torch.cuda.synchronize()
        count = len(weights)
        del weights
        # ES state (if any) no longer describes these weights.
        self._vrl_es = self._vrl_lowrank = None
        return count
