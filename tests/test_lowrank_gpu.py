"""Low-rank ES on the GPU (Triton kernels, the batched float64 update) equals the pure-torch reference
bit for bit, on GPU and against the CPU."""

from __future__ import annotations

import random

import pytest
import torch

from vrl.generate.vllm_lora import lora_factors
from vrl.weights.exact import F64_EXACT, PRODUCT_MAX
from vrl.weights.flat import FlatParams
from vrl.weights.lowrank import LowRankParams
from vrl.weights.update import LowRankUpdate

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the device machine)", allow_module_level=True)
pytest.importorskip("triton", reason="the low-rank ES kernels need triton")

# Shapes of Qwen2.5-1.5B linear layers (some sliced: the CPU reference is slow) and odd sizes that
# end inside a tile (tiles are 32×64).
SHAPES = {
    "model.layers.0.self_attn.q_proj.weight": (1536, 1536),
    "model.layers.0.self_attn.k_proj.weight": (256, 1536),
    "model.layers.0.mlp.down_proj.weight": (384, 8960),
    "model.layers.0.mlp.up_proj.weight": (1000, 384),
    "odd.weight": (7, 13),
    "tall.weight": (65, 1),
}
MEMBERS = [(0, 1), (0, -1), (2**40 + 3, 1), (123456789, -1), (17, 1)]


def _build(dtype: torch.dtype, device: str, use_triton: bool, rank: int) -> LowRankParams:
    g = torch.Generator().manual_seed(0)
    named = [(n, torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(dtype).to(device))) for n, s in SHAPES.items()]
    flat = FlatParams(named)
    flat.use_triton = use_triton
    return LowRankParams(flat, rank)


def _weights(p: LowRankParams) -> list[torch.Tensor]:
    return [w.cpu() for g in p.flat.groups for w in g.weight_views]


def _master(p: LowRankParams) -> list[torch.Tensor]:
    return [m.cpu() for g in p.flat.groups for m in g.master_views]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    # Bit patterns (torch.equal would call -0.0 == 0.0 and NaN != NaN).
    return all(torch.equal(x.view(torch.int16 if x.element_size() == 2 else torch.int32),
                           y.view(torch.int16 if y.element_size() == 2 else torch.int32)) for x, y in zip(a, b))


@pytest.mark.parametrize("rank", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_lowrank_perturb_and_update_match_the_reference(dtype: torch.dtype, rank: int) -> None:
    """The GPU paths: perturb by the Triton kernel, the update by `update_batched` (float64 bmm; these
    sums are below 2⁵³), against the torch reference on the GPU and on the CPU, bit for bit."""
    fast, ref_gpu, ref_cpu = (_build(dtype, "cuda", True, rank), _build(dtype, "cuda", False, rank),
                              _build(dtype, "cpu", False, rank))
    before = _weights(fast)
    for seed, sign in MEMBERS[:3]:
        for sigma in (1e-3, 3e-2):
            for p in (fast, ref_gpu, ref_cpu):
                p.perturb(seed, sign, sigma)
            torch.cuda.synchronize()
            assert _equal(_weights(fast), _weights(ref_gpu)), f"GPU kernel != GPU reference (seed {seed}, σ {sigma})"
            assert _equal(_weights(fast), _weights(ref_cpu)), f"GPU kernel != CPU reference (seed {seed}, σ {sigma})"
            assert not _equal(_weights(fast), before)
            for p in (fast, ref_gpu, ref_cpu):
                p.restore()
            assert _equal(_weights(fast), before)
    rng = random.Random(rank)
    for it in range(3):
        z = [round(rng.gauss(0, 1), 4) for _ in MEMBERS]
        update = LowRankUpdate.from_members(MEMBERS, z, alpha=1e-2 * (it + 1), rank=rank)
        for p in (fast, ref_gpu, ref_cpu):
            p.update(update)
    torch.cuda.synchronize()
    assert _equal(_master(fast), _master(ref_cpu)) and _equal(_master(fast), _master(ref_gpu))
    assert _equal(_weights(fast), _weights(ref_cpu))
    assert not _equal(_weights(fast), before)


@pytest.mark.parametrize("rank", [8, 64])
def test_triton_update_with_sums_beyond_2_pow_53_matches_the_int64_reference(rank: int) -> None:
    """Multipliers so large that the exact sum needs int64 (the CPU reference's slow path; on the GPU
    the Triton update kernel, `update_triton`) and int → fp32 conversion rounds: the kernel's int64
    accumulator and cvt.rn must give the same bits."""
    # Σ|mult|·r·510² must pass 2⁵³ at the smallest rank tested (8) to force the reference's int64 path;
    # the earlier multipliers (2³⁰+7, −2³¹+5, 2²⁹+1) gave 7.8·10¹⁵ < 2⁵³ at rank 8, so this line failed there.
    update = LowRankUpdate(terms=((5, 2**31 + 7), (6, -(2**32) + 5), (2**33, 2**30 + 1)), coeff=2.0**-60, rank=rank)
    assert sum(abs(w) for _, w in update.terms) * rank * PRODUCT_MAX > F64_EXACT
    fast, ref_cpu = _build(torch.float32, "cuda", True, rank), _build(torch.float32, "cpu", False, rank)
    for p in (fast, ref_cpu):
        p.update(update)
    torch.cuda.synchronize()
    assert _equal(_master(fast), _master(ref_cpu)) and _equal(_weights(fast), _weights(ref_cpu))


def test_triton_lowrank_writes_rows_of_a_larger_tensor_in_place() -> None:
    """`FlatParams.over` (a vLLM engine's fused q/k/v rows): perturb (Triton) and update (batched) write each
    view and nothing around it."""
    host = torch.full((40 + 24 + 3, 96), 7.0, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(1)
    host[:40] = (torch.randn(40, 96, generator=g) * 0.02).to(torch.bfloat16)
    host[40:64] = (torch.randn(24, 96, generator=g) * 0.02).to(torch.bfloat16)
    fast = LowRankParams(FlatParams.over({"q.weight": host[:40], "k.weight": host[40:64]}), 8)
    assert fast.flat.use_triton
    cpu_named = [("q.weight", torch.nn.Parameter(host[:40].cpu())), ("k.weight", torch.nn.Parameter(host[40:64].cpu()))]
    ref = LowRankParams(FlatParams(cpu_named), 8)
    fast.perturb(9, -1, 0.05)
    ref.perturb(9, -1, 0.05)
    torch.cuda.synchronize()
    assert _equal([host[:40].cpu(), host[40:64].cpu()], _weights(ref))
    update = LowRankUpdate.from_members([(9, 1), (9, -1)], [1.5, -0.25], 0.1, 8)
    for p in (fast, ref):
        p.restore()
        p.update(update)
    torch.cuda.synchronize()
    assert _equal([host[:40].cpu(), host[40:64].cpu()], _weights(ref))
    assert bool((host[64:] == 7).all())


@pytest.mark.parametrize(("rank", "max_rank"), [(8, 16), (8, 8), (1, 8)])
def test_triton_member_load_writes_the_lora_slots_of_the_torch_path(rank: int, max_rank: int) -> None:
    """`LowRankEngine.load_members` on a GPU (one kernel per matrix shape) writes the same bits into
    vLLM-shaped LoRA stacks (slots×1×R×n, slots×1×m×R) as its torch path, equal to the CPU reference
    `lora_factors` cast to bf16: zeros beyond es.rank, other slots untouched."""
    from vrl.generate.vllm_slots import LowRankEngine

    shapes = {"l0.q": (1536, 1536), "l0.k": (256, 1536), "l0.down": (1536, 8960), "l1.q": (1536, 1536),
              "odd": (7, 13), "tall": (65, 1)}
    members, slots, n_slots = [(5, 1), (5, -1), (2**40 + 3, 1), (77, -1)], [6, 0, 3, 2, 1], 7
    g = torch.Generator().manual_seed(2)
    views = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16).cuda() for n, s in shapes.items()}

    def stacks() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {n: (torch.full((n_slots, 1, max_rank, s[1]), 7.0, dtype=torch.bfloat16, device="cuda"),
                    torch.full((n_slots, 1, s[0], max_rank), 7.0, dtype=torch.bfloat16, device="cuda"))
                for n, s in shapes.items()}

    fast_layers, ref_layers = stacks(), stacks()
    fast, ref = LowRankEngine(views, fast_layers, rank, slots), LowRankEngine(views, ref_layers, rank, slots)
    assert fast.use_triton
    ref.use_triton = False
    for engine in (fast, ref):
        engine.load_members(members, 0.03)
    torch.cuda.synchronize()
    for name, shape in shapes.items():
        (fa, fb), (ra, rb) = fast_layers[name], ref_layers[name]
        assert _equal([fa.cpu(), fb.cpu()], [ra.cpu(), rb.cpu()]), name
        cpu_a, cpu_b = lora_factors(members, name, shape, rank, 0.03)
        for p, slot in enumerate(slots[:len(members)]):
            assert _equal([fa[slot, 0, :rank].cpu(), fb[slot, 0, :, :rank].cpu()],
                          [cpu_a[p].to(torch.bfloat16), cpu_b[p].to(torch.bfloat16)]), (name, p)
            assert not fa[slot, 0, rank:].any() and not fb[slot, 0, :, rank:].any()
        untouched = [s for s in range(n_slots) if s not in slots[:len(members)]]
        assert bool((fa[untouched] == 7).all()) and bool((fb[untouched] == 7).all())
