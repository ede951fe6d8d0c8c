"""Low-rank ES members (EGGROLL): replayable factors, an exact update, exact restore, the batched population
forward against materialised weights, and the es.noise / es.rank settings."""

from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch
from pydantic import ValidationError

from vrl.generate import tiny
from vrl.generate.hf_population import population
from vrl.optim.es import ES, Z_DECIMALS, BaseModelRef, ESConfig, ESHistory, IterationRecord, member_seeds, replay
from vrl.weights import noise as nz
from vrl.weights.exact import PRODUCT_MAX, Z_SCALE, check_bound
from vrl.weights.factors import (
    factor_keys,
    factor_keys_many,
    factors,
    factors_int,
    factors_int_many,
    perturbation_scale,
)
from vrl.weights.lowrank import LowRankParams, select_linear
from vrl.weights.lowrank_kernels import product_sum, update_batched, update_reference
from vrl.weights.update import LowRankUpdate

ALL = (["*"], [])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _params(dtype: torch.dtype = torch.float32, rank: int = 4) -> tuple[torch.nn.Module, LowRankParams]:
    model = tiny.build_model().to(dtype)
    return model, LowRankParams.from_model(model, *ALL, rank)


def _masters(p: LowRankParams) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in p.state().items()}


def _model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.named_parameters()}


# -- factors --------------------------------------------------------------------------------------


def test_factors_are_the_noise_of_virtual_tensors_and_a_pure_function_of_their_inputs() -> None:
    name, shape = "model.layers.0.mlp.up_proj.weight", (128, 64)
    a, b = factors_int(7, name, shape, 4)
    assert a.shape == (128, 4) and b.shape == (64, 4) and a.dtype == torch.int32
    # The documented definition: A = ε(seed, name + ":A", (m, r)), B likewise; integer form = ε / C.
    assert torch.equal(a.to(torch.float32) * nz.C, nz.noise(7, name + ":A", (128, 4)))
    assert torch.equal(b.to(torch.float32) * nz.C, nz.noise(7, name + ":B", (64, 4)))
    assert all(torch.equal(x, y) for x, y in zip((a, b), factors_int(7, name, shape, 4)))
    A, B = factors(7, name, shape, 4)
    assert torch.equal(A, a.to(torch.float32) * nz.C) and torch.equal(B, b.to(torch.float32) * nz.C)
    # Every input matters: seed, name, shape, rank; and A and B are not the same stream.
    assert not torch.equal(factors_int(8, name, shape, 4)[0], a)
    assert not torch.equal(factors_int(7, name + "x", shape, 4)[0], a)
    assert not torch.equal(factors_int(7, name, (128, 64), 2)[0][:, :2], a[:, :2])
    assert not torch.equal(a[:64], b)
    assert factors_int(7, name, (130, 64), 4)[0].shape == (130, 4)
    # Several members in one pass: row t is member t's factors.
    seeds = [7, 2**40 + 1, 0]
    many_a, many_b = factors_int_many(seeds, name, shape, 4)
    for t, seed in enumerate(seeds):
        one_a, one_b = factors_int(seed, name, shape, 4)
        assert torch.equal(many_a[t], one_a) and torch.equal(many_b[t], one_b)
    assert torch.equal(many_a[0], nz.noise_int(nz.tensor_keys(7, nz.name_words(name + ":A")), 0, 128 * 4).view(128, 4))


def test_vectorised_keys_equal_the_scalar_keys_for_every_seed_word() -> None:
    """`factor_keys_many` (numpy, what the GPU paths upload) row i·T + j == `factor_keys(seeds[j], names[i])`,
    including seeds whose high or low 32-bit word is 0 or all ones (the mixer's wrap-around)."""
    import random

    rng = random.Random(3)
    seeds = [0, 1, 2**32 - 1, 2**32, 2**40 + 3, 2**64 - 1] + [rng.randrange(2**64) for _ in range(20)]
    names = ["model.layers.0.self_attn.q_proj.weight", "lm_head.weight", "x", "model.layers.27.mlp.down_proj.weight"]
    many = factor_keys_many(seeds, names)
    assert many.dtype == torch.int64 and many.shape == (len(names) * len(seeds), 4)
    expected = [factor_keys(seed, name) for name in names for seed in seeds]
    assert many.tolist() == [list(k) for k in expected]
    with pytest.raises(ValueError, match="seeds must lie in"):
        factor_keys_many([2**64], names)


def test_member_perturbation_has_unit_variance_per_element() -> None:
    """E = A·Bᵀ/√r: mean 0, variance 1 per element (over seeds), like a full-rank ε."""
    r, samples = 8, []
    for seed in range(200):
        A, B = factors(seed, "w", (16, 12), r)
        samples.append((A.double() @ B.double().T / math.sqrt(r)).flatten())
    e = torch.stack(samples)
    assert abs(e.mean().item()) < 0.03
    assert abs(e.var().item() - 1) < 0.05


def test_rank_bounds() -> None:
    with pytest.raises(ValueError, match="rank <= 64"):
        factors_int(0, "w", (4, 4), 65)
    with pytest.raises(ValueError, match="1 <= rank"):
        perturbation_scale(1e-3, 0)


# -- the exact update -------------------------------------------------------------------------------


def _members(seed: int, n: int) -> list[tuple[int, int]]:
    return member_seeds(IterationRecord(seed=seed, z=[0.0] * n), antithetic=True)


def _z(n: int, rng: random.Random) -> list[float]:
    return [round(rng.gauss(0, 1), 4) for _ in range(n)]


def test_update_equals_float64_within_fp32_rounding_and_is_deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(0)
    shape, rank, alpha = (70, 45), 8, 3e-2
    members, z = _members(1000, 12), _z(12, rng)
    upd = LowRankUpdate.from_members(members, z, alpha, rank)
    theta0 = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.02
    m1, w1 = theta0.clone(), torch.empty(shape, dtype=torch.bfloat16)
    update_reference([m1], [w1], ["w"], upd)
    # The definition in float64: θ + α/N·Σ zᵢ·signᵢ·AᵢBᵢᵀ/√r.
    delta = torch.zeros(shape, dtype=torch.float64)
    for (seed, sign), zi in zip(members, z):
        A, B = factors(seed, "w", shape, rank)
        delta += sign * zi * (A.double() @ B.double().T) / math.sqrt(rank)
    ref = theta0.double() + alpha / len(z) * delta
    # Allowed: half an fp32 step of the result (the final add), plus the coefficient's 14-bit rounding
    # and the fp32 rounding of U and of U·c (each ≤ 2⁻¹⁵ or 2⁻²⁴ relative to the step).
    ulp = torch.finfo(torch.float32).eps * ref.abs().clamp(min=2.0**-126)
    err = (m1.double() - ref).abs()
    assert bool((err <= ulp / 2 + (ref - theta0.double()).abs() * 2.0**-13).all())
    assert (ref - theta0.double()).abs().max() > 1e-4  # the update is not negligible: the test has power
    assert _same_bits(w1, m1.to(torch.bfloat16))
    # Deterministic, and independent of how the rows are chunked.
    monkeypatch.setattr("vrl.weights.lowrank_kernels._CHUNK", 7 * 45)
    m2, w2 = theta0.clone(), torch.empty(shape, dtype=torch.bfloat16)
    update_reference([m2], [w2], ["w"], upd)
    assert _same_bits(m1, m2) and _same_bits(w1, w2)


def test_update_merges_antithetic_pairs_into_integer_multipliers() -> None:
    assert Z_SCALE == 10**Z_DECIMALS  # the stored z have exactly this many decimals
    upd = LowRankUpdate.from_members([(5, 1), (5, -1), (6, 1), (6, -1)], [0.25, -0.5, 0.1, 0.1], alpha=1e-3, rank=2)
    assert upd.terms == ((5, 7500),)  # seed 6: +0.1 − 0.1 cancels and is dropped
    assert upd.coeff == nz.round_sig(1e-3 / 4 / 1e4 * nz.C**2 / math.sqrt(2), nz.SCALE_BITS)
    assert not LowRankUpdate.from_members([(5, 1), (6, 1)], [0.0, 0.0], 1e-3, 2)


def _exact_rne(x: int) -> float:
    """x rounded to the nearest fp32 (ties to even), from the integer itself."""
    sign, x = (-1 if x < 0 else 1), abs(x)
    shift = max(0, x.bit_length() - 24)
    q, rem = divmod(x, 1 << shift)
    if shift and (rem > 1 << (shift - 1) or (rem == 1 << (shift - 1) and q & 1)):
        q += 1
    return sign * float(q << shift)


def test_int64_to_fp32_rounds_once_to_nearest_even() -> None:
    """The GPU kernel converts its int64 sum with one round-to-nearest-even (cvt.rn); so must the CPU.
    Double rounding through float64 would differ on these values (a tie after the first rounding)."""
    rng = random.Random(0)
    values = [(1 << k) + (1 << (k - 24)) + 1 for k in range(54, 62)]  # just above a tie: direct rounding goes up
    values += [-v for v in values] + [rng.randrange(-(2**62), 2**62) for _ in range(20000)]
    got = torch.tensor(values, dtype=torch.int64).to(torch.float32).tolist()
    assert got == [_exact_rne(v) for v in values]


def test_product_sum_int64_path_equals_float64_path_and_exact_integers(monkeypatch: pytest.MonkeyPatch) -> None:
    a = torch.stack([factors_int(s, "w", (9, 11), 8)[0] for s in range(3)])
    b = torch.stack([factors_int(s, "w", (9, 11), 8)[1] for s in range(3)])
    small = [12345, -40000, 7]
    fast = product_sum(a, b, small)
    monkeypatch.setattr("vrl.weights.exact.F64_EXACT", 0)
    assert _same_bits(product_sum(a, b, small), fast)
    # Multipliers so large that sums pass 2⁵³ (the int64 path), against Python's exact integers.
    big = [2**33 + 1, -(2**34) - 3, 2**32 + 12345]
    got = product_sum(a, b, big)
    for i, j in [(0, 0), (3, 5), (8, 10)]:
        exact = sum(w * sum(int(a[t, i, k]) * int(b[t, j, k]) for k in range(8)) for t, w in enumerate(big))
        assert got[i, j].item() == _exact_rne(exact)


@pytest.mark.parametrize("big", [False, True])
def test_batched_update_gives_the_reference_bits(big: bool) -> None:
    """`update_batched` (the GPU path: matrices of one shape in one float64 bmm) writes the bits of
    `update_reference`, whether a shape's matrices fit one batch, several, or (too large) go through
    the reference's row blocks; with multipliers past 2⁵³ it takes the int64 path."""
    rng = random.Random(1)
    shapes = [(6, 5), (7, 9), (6, 5), (6, 5), (7, 9), (40, 3), (6, 5)]
    names = [f"layer{i}.w" for i in range(len(shapes))]
    upd = LowRankUpdate.from_members(_members(77, 10), _z(10, rng), 3e-2, 4)
    if big:
        upd = LowRankUpdate(tuple((s, w * 2**20) for s, w in upd.terms), upd.coeff, upd.rank)
        assert sum(abs(w) for _, w in upd.terms) * 4 * PRODUCT_MAX > 2**53
    gen = torch.Generator().manual_seed(2)
    theta0 = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    ref_m, ref_w = [t.clone() for t in theta0], [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    update_reference(ref_m, ref_w, names, upd)
    for max_elements in (1000, 2 * 30, 30):  # one batch per shape; pairs; singles, (40, 3) too large
        m, w = [t.clone() for t in theta0], [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
        update_batched(tuple(m), tuple(w), tuple(names), upd, max_elements=max_elements)  # as LowRankParams passes them
        assert all(_same_bits(x, y) for x, y in zip(m, ref_m)), max_elements
        assert all(_same_bits(x, y) for x, y in zip(w, ref_w)), max_elements
    assert all(not torch.equal(x, y) for x, y in zip(ref_m, theta0))  # every matrix moved


def test_update_refuses_sums_beyond_int64() -> None:
    with pytest.raises(ValueError, match="too large"):
        check_bound([(1, 2**40), (2, -(2**40))], 64)
    check_bound([(1, 10**4 * 1000)], 64)  # 1000 members at |z| = 1: far inside


# -- parameters: perturb, restore, update, replay --------------------------------------------------


def test_select_linear_takes_linear_weights_only() -> None:
    model = tiny.build_model()
    names = [n for n, _ in select_linear(model, *ALL)]
    assert "lm_head.weight" in names and "model.layers.0.self_attn.q_proj.weight" in names
    assert not [n for n in names if "embed" in n or "norm" in n or n.endswith(".bias")]
    assert len(names) == 2 * 7 + 1
    only = select_linear(model, ["*mlp*"], ["*down_proj*"])
    assert sorted(n.split(".")[-2] for n, _ in only) == ["gate_proj", "gate_proj", "up_proj", "up_proj"]
    with pytest.raises(ValueError, match="no linear-layer weight"):
        select_linear(model, ["*norm*"], [])


def test_select_linear_skips_an_output_layer_tied_to_the_embedding() -> None:
    model = tiny.build_model()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as in Qwen2.5-1.5B
    names = [n for n, _ in select_linear(model, *ALL)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" not in names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_perturb_then_restore_gives_the_weights_back_exactly(dtype: torch.dtype) -> None:
    model, params = _params(dtype)
    before = _model_weights(model)
    norm_before = model.model.norm.weight.detach().clone()
    sigma = 0.01
    for seed, sign in [(3, 1), (3, -1), (2**40 + 9, 1)]:
        params.perturb(seed, sign, sigma)
        w = model.model.layers[0].mlp.up_proj.weight.detach()
        name = "model.layers.0.mlp.up_proj.weight"
        A, B = factors(seed, name, w.shape, params.rank)
        step = sign * sigma * (A.double() @ B.double().T) / math.sqrt(params.rank)
        expected = before[name].double() + step
        # Off by at most half a step of the weight dtype, plus the 14-bit rounding of the scale s.
        bound = torch.finfo(dtype).eps / 2 * expected.abs() + step.abs() * 2.0**-13
        assert bool(((w.double() - expected).abs() <= bound).all())
        assert not _same_bits(w, before[name])
        assert _same_bits(model.model.norm.weight.detach(), norm_before)  # vectors are not perturbed
        params.restore()
        after = _model_weights(model)
        assert all(_same_bits(after[n], before[n]) for n in before)


def test_perturbation_materialises_master_plus_scaled_integer_product() -> None:
    """The bits a GPU kernel must reproduce: cast(θ + fp32(s·P)), P = a·bᵀ exact."""
    model, params = _params(torch.bfloat16, rank=8)
    name = "model.layers.1.self_attn.o_proj.weight"
    theta = params.state()[name]
    params.perturb(11, -1, 0.02)
    a, b = factors_int(11, name, theta.shape, 8)
    p = (a.long() @ b.long().T).to(torch.float32)
    s = -perturbation_scale(0.02, 8)
    expected = (theta + p * s).to(torch.bfloat16)
    assert _same_bits(dict(model.named_parameters())[name].detach(), expected)


def _history(rank: int, antithetic: bool = True) -> ESHistory:
    return ESHistory(base=BaseModelRef(model="tiny"), sigma=0.01, alpha=0.05, population_size=6, antithetic=antithetic,
                     normalization="zscore", include=["*"], exclude=[], perturbation="lowrank", rank=rank)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_from_theta0_gives_the_live_weights_bit_for_bit(dtype: torch.dtype) -> None:
    rng = random.Random(3)
    model, live = _params(dtype, rank=4)
    history = _history(4)
    for it in range(4):
        record = IterationRecord(seed=1000 * it + 17, z=_z(6, rng))
        live.perturb(record.seed, 1, history.sigma)  # members run (sequentially here) between updates
        live.restore()
        live.update(LowRankUpdate.from_members(member_seeds(record, True), record.z, history.alpha, live.rank))
        history.iterations.append(record)
    history = ESHistory.model_validate_json(history.to_json())  # through the file format
    fresh_model, fresh = _params(dtype, rank=4)
    assert not all(_same_bits(fresh.state()[n], live.state()[n]) for n in live.names)
    replay(history, fresh, 0, 2)
    replay(history, fresh, 2)
    assert all(_same_bits(fresh.state()[n], live.state()[n]) for n in live.names)
    live_w, fresh_w = _model_weights(model), _model_weights(fresh_model)
    assert all(_same_bits(live_w[n], fresh_w[n]) for n in live_w)


def test_replay_refuses_a_history_of_the_other_mode() -> None:
    _, params = _params(rank=4)
    with pytest.raises(ValueError, match="rank 4"):
        replay(_history(8), params)
    full = _history(4).model_copy(update={"perturbation": "full", "rank": None})
    with pytest.raises(ValueError, match="'full'"):
        replay(full, params)
    with pytest.raises(ValueError, match="low-rank noise"):
        replay(_history(4), params.flat)  # a low-rank history is never replayed as full-rank noise


# -- the population as one batch --------------------------------------------------------------------

MEMBERS = [(101, 1), (101, -1), (2**35 + 5, 1), (77, -1)]
SIGMA, RANK = 0.05, 4
# Both sides compute the same function in fp32 but round differently: the materialised model rounds
# W + s·P to fp32 and then does one matmul; the batched forward does x·W, (x·b)·aᵀ and adds. Each
# differs by a few fp32 steps per layer; through 2 layers to logits of size ~0.6 the gap measured
# 3.3e-6 at most. Members differ from each other and from the base by > 1 (checked > 1e-2), so a
# member mix-up or a missing term fails the test by orders of magnitude.
ATOL = 3e-5


def _materialised(model: torch.nn.Module, seed: int, sign: int) -> torch.nn.Module:
    member = copy.deepcopy(model)
    params = LowRankParams.from_model(member, *ALL, RANK)
    params.perturb(seed, sign, SIGMA)
    return member


def test_population_forward_matches_per_member_materialised_weights() -> None:
    model = tiny.build_model()
    layers = select_linear(model, *ALL)
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    rows = [2, 0, -1, 3, 1, 0, 2]  # members in any order, repeated, and one base row
    ids = tokens.repeat(len(rows), 1)
    with torch.no_grad():
        with population(layers, MEMBERS, SIGMA, RANK, rows):
            batched = model(input_ids=ids).logits
        base = model(input_ids=tokens).logits[0]
        per_member = [_materialised(model, s, g)(input_ids=tokens).logits[0] for s, g in MEMBERS]
    assert torch.allclose(batched[2], base, rtol=0, atol=ATOL)
    for j, i in enumerate(rows):
        expected = base if i < 0 else per_member[i]
        assert (batched[j] - expected).abs().max() < ATOL, f"row {j} (member {i})"
    gaps = [(per_member[i] - per_member[k]).abs().max().item() for i in range(4) for k in range(i)]
    gaps += [(p - base).abs().max().item() for p in per_member]
    assert min(gaps) > 1e-2
    # The hooks are gone after the block.
    with torch.no_grad():
        assert _same_bits(model(input_ids=tokens).logits[0], base)


def test_population_samples_all_members_in_one_generate_call() -> None:
    """Decoding with the KV cache: each step's logits of row j are those of its member's materialised model."""
    model, tok = tiny.build_model(), tiny.build_tokenizer()
    layers = select_linear(model, *ALL)
    prompt = tok(["Say hi:"], return_tensors="pt")["input_ids"]  # one prompt: no padding, plain positions
    rows = [0, 1, 2, 3, 0]
    ids = prompt.repeat(len(rows), 1)
    with torch.no_grad(), population(layers, MEMBERS, SIGMA, RANK, rows):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
    steps = torch.stack(out.logits, dim=1)  # rows × new tokens × vocab
    width = prompt.shape[1]
    with torch.no_grad():
        for j, i in enumerate(rows):
            logits = _materialised(model, *MEMBERS[i])(input_ids=out.sequences[j : j + 1]).logits[0]
            assert (steps[j] - logits[width - 1 : -1]).abs().max() < ATOL, f"row {j}"
    assert len({tuple(s.tolist()) for s in out.sequences[:4]}) > 1  # members really sample differently


def test_population_refuses_bad_rows_and_mismatched_batches() -> None:
    model = tiny.build_model()
    layers = select_linear(model, *ALL)
    with pytest.raises(ValueError, match="row_member"):
        with population(layers, MEMBERS, SIGMA, RANK, [0, 4]):
            pass
    with pytest.raises(RuntimeError, match="batch 3"), torch.no_grad():
        with population(layers, MEMBERS, SIGMA, RANK, [0, 1]):
            model(input_ids=torch.zeros(3, 2, dtype=torch.long))
    assert not any(m._forward_hooks for m in model.modules())


# -- configuration and history -----------------------------------------------------------------------


def test_config_noise_and_rank() -> None:
    assert (ESConfig().noise, ESConfig().rank) == ("full", 8)
    c = ESConfig(noise="lowrank", rank=16)
    assert (c.noise, c.rank) == ("lowrank", 16)
    with pytest.raises(ValidationError, match="rank only applies to low-rank noise"):
        ESConfig(rank=4)
    for bad in (0, 65):
        with pytest.raises(ValidationError, match="rank"):
            ESConfig(noise="lowrank", rank=bad)
    with pytest.raises(ValidationError, match="'full' or 'lowrank'"):
        ESConfig(noise="gaussian")


def test_history_records_the_mode_and_old_histories_load_as_full_rank(tmp_path) -> None:
    old = {"format": "vrl-es-history", "version": 1, "noise": nz.NOISE_VERSION, "base": {"model": "tiny"},
           "sigma": 0.01, "alpha": 0.005, "population_size": 4, "antithetic": False, "normalization": "zscore",
           "include": ["*"], "exclude": [], "iterations": [{"seed": 5, "z": [1.0, -1.0, 0.0, 0.0]}]}
    path = tmp_path / "es_history.json"
    path.write_text(json.dumps(old))
    h = ESHistory.read(path)
    assert (h.perturbation, h.rank) == ("full", None)
    low = _history(8)
    again = ESHistory.model_validate_json(low.to_json())
    assert (again.perturbation, again.rank) == ("lowrank", 8)


def test_resume_refuses_another_noise_mode_or_rank() -> None:
    es = ES(ESConfig())
    full = _history(8).model_copy(update={"perturbation": "full", "rank": None})
    with pytest.raises(ValueError, match="perturbation='lowrank' but this run has 'full'.*es.noise"):
        es._check_compatible(_history(8), full)
    with pytest.raises(ValueError, match="rank=4 but this run has 8.*es.rank"):
        es._check_compatible(_history(4), _history(8))
    es._check_compatible(_history(8), _history(8))
