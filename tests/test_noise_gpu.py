"""The fused Triton kernels equal the pure-torch reference bit for bit, on GPU and against the CPU."""

from __future__ import annotations

import pytest
import torch

from vrl.weights.flat import FlatParams
from vrl.weights.update import FullRankUpdate

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the device machine)", allow_module_level=True)
pytest.importorskip("triton", reason="the fused ES kernels need triton")

# Shapes of one Qwen2.5-1.5B decoder layer plus odd sizes (tensor ends inside a block, tiny tensors).
SHAPES = {
    "model.layers.0.self_attn.q_proj.weight": (1536, 1536),
    "model.layers.0.self_attn.q_proj.bias": (1536,),
    "model.layers.0.self_attn.k_proj.weight": (256, 1536),
    "model.layers.0.mlp.up_proj.weight": (8960, 384),  # a slice: the CPU reference is slow
    "model.layers.0.input_layernorm.weight": (1536,),
    "odd.weight": (7, 13),
    "one": (1,),
}
TERMS = FullRankUpdate(((2**33 + 5, 3.0517578125e-05), (17, -1.52587890625e-05), (2**31 + 1, 7.62939453125e-06),
                        (99, 1.1920928955078125e-07)))
SEEDS = [(0, 1), (123456789, -1), (2**40 + 3, 1)]


def _build(dtype: torch.dtype, device: str, use_triton: bool) -> FlatParams:
    g = torch.Generator().manual_seed(0)
    named = [(n, torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(dtype).to(device))) for n, s in SHAPES.items()]
    flat = FlatParams(named)
    flat.use_triton = use_triton
    return flat


def _weights(flat: FlatParams) -> list[torch.Tensor]:
    return [w.cpu() for g in flat.groups for w in g.weight_views]


def _master(flat: FlatParams) -> list[torch.Tensor]:
    return [m.cpu() for g in flat.groups for m in g.master_views]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    # Compare bit patterns (torch.equal would call -0.0 == 0.0 and NaN != NaN).
    return all(torch.equal(x.view(torch.int16 if x.element_size() == 2 else torch.int32),
                           y.view(torch.int16 if y.element_size() == 2 else torch.int32)) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_perturb_and_update_match_reference(dtype: torch.dtype) -> None:
    fast, ref_gpu, ref_cpu = _build(dtype, "cuda", True), _build(dtype, "cuda", False), _build(dtype, "cpu", False)
    assert FlatParams([("p", torch.nn.Parameter(torch.zeros(3, device="cuda")))]).use_triton  # the default on CUDA
    before = _weights(fast)
    for seed, sign in SEEDS:
        for sigma in (1e-3, 1e-2):
            for f in (fast, ref_gpu, ref_cpu):
                f.perturb(seed, sign, sigma)
            torch.cuda.synchronize()
            assert _equal(_weights(fast), _weights(ref_gpu)), f"GPU kernel != GPU reference (seed {seed}, σ {sigma})"
            assert _equal(_weights(fast), _weights(ref_cpu)), f"GPU kernel != CPU reference (seed {seed}, σ {sigma})"
            assert not _equal(_weights(fast), before)
            for f in (fast, ref_gpu, ref_cpu):
                f.restore()
            assert _equal(_weights(fast), before)
    for _ in range(3):
        for f in (fast, ref_gpu, ref_cpu):
            f.update(TERMS)
    torch.cuda.synchronize()
    assert _equal(_master(fast), _master(ref_cpu)) and _equal(_master(fast), _master(ref_gpu))
    assert _equal(_weights(fast), _weights(ref_cpu))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_writes_weights_in_place_through_the_address_table(dtype: torch.dtype) -> None:
    """`FlatParams.over` (the vLLM engine's case): the kernels write each tensor where it lives, rows
    inside larger tensors, exactly as the reference does, and never touch the rows around them."""
    g = torch.Generator().manual_seed(0)  # the weights `_build` makes
    hosts, views = {}, {}
    for name, shape in SHAPES.items():
        host = torch.full((shape[0] + 5, *shape[1:]), 7.0, dtype=dtype)
        host[2 : 2 + shape[0]] = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        hosts[name] = host.cuda()
        views[name] = hosts[name][2 : 2 + shape[0]]
    fast = FlatParams.over(views)
    assert fast.use_triton
    ref = _build(dtype, "cpu", False)
    start = [v.cpu() for v in views.values()]
    assert _equal(start, _weights(ref))  # same initial weights as the reference
    for seed, sign in SEEDS:
        fast.perturb(seed, sign, 1e-2)
        ref.perturb(seed, sign, 1e-2)
        torch.cuda.synchronize()
        assert _equal([v.cpu() for v in views.values()], _weights(ref)), f"seed {seed}"
        fast.restore()
        ref.restore()
        assert _equal([v.cpu() for v in views.values()], start)
    fast.update(TERMS)
    ref.update(TERMS)
    torch.cuda.synchronize()
    assert _equal([v.cpu() for v in views.values()], _weights(ref)) and _equal(_master(fast), _master(ref))
    for host in hosts.values():  # the rows before and after each view still hold 7.0
        assert bool((host[:2] == 7).all()) and bool((host[-3:] == 7).all())
