"""Low-rank ES on the vllm backend: members served from the engine's LoRA slots (run on the device: `pytest -m gpu`).

A small Qwen2 model (untied lm_head) with random weights and the byte tokenizer of `vrl.generate.tiny`;
one bfloat16 engine, eager, with 4 LoRA slots of rank 8 serving members of rank 4 (so the slots' unused
rank is exercised too).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from vrl.config import SamplingConfig, build
from vrl.generate.hf import load_model_and_tokenizer
from vrl.generate.hf_population import population
from vrl.generate.vllm_lora import lora_factors
from vrl.policy import HostNeeds, PerturbationSpec, Unsupported, Variant
from vrl.types import Task
from vrl.weights import noise as nz
from vrl.weights.factors import factors_int_many
from vrl.weights.lowrank import LowRankParams, select_linear
from vrl.weights.update import LowRankUpdate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'vrl-core[vllm]')"),
]

PROMPTS = ["Hello there", "2 + 2 =", "def f(x):", "The quick brown fox", "Lean 4 theorem", "abc"]
RANK, SIGMA = 4, 0.05
SPEC = PerturbationSpec(("*",), ("lm_head*",), SIGMA, noise="lowrank", rank=RANK)
SPEC_MLP = PerturbationSpec(("*.mlp.*",), (), SIGMA, noise="lowrank", rank=RANK)
MEMBERS = [(1234, 1), (1234, -1), (99, 1), (7, -1)]
NAMES = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
         "model.layers.0.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight",
         "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"]


@pytest.fixture(scope="module")
def model_dir(small_qwen2_dir):
    return small_qwen2_dir


def tasks() -> list[Task]:
    return [Task(id=f"t{i}", prompt=p) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def gen(model_dir):
    from vrl.generate import make_generator

    cfg = build({"model": model_dir, "optimizer": "es", "seed": 3,
                 "es": {"noise": "lowrank", "rank": RANK, "population_size": len(MEMBERS)},
                 "sampling": {"temperature": 0.0, "max_new_tokens": 16, "batch_size": 3},
                 "generator": {"backend": "vllm", "dtype": "bfloat16", "vllm": {
                     "enforce_eager": True, "gpu_memory_utilization": 0.2, "max_model_len": 256}}})
    g = make_generator(cfg, HostNeeds("perturbations", SPEC, variants=len(MEMBERS)))
    yield g
    g.close()


def test_lm_head_is_refused_with_the_fix_and_the_engine_stays_usable(gen):
    with pytest.raises(Unsupported, match=r"lm_head.*es\.exclude"):
        gen.perturbations(PerturbationSpec(("*",), (), SIGMA, noise="lowrank", rank=RANK))
    assert gen._params is None


def test_slots_hold_the_reference_factors_and_the_update_is_exact(gen, model_dir):
    """Each member's LoRA slot holds cast(lora_factors) bit for bit (zeros beyond rank 4), its product
    is σ·sign·A·Bᵀ/√r within the bf16 rounding of the two factors, and the update written into the base
    weights equals the CPU reference (`LowRankParams` on an hf copy) bit for bit, also after
    load_state(θ₀) and a replay."""
    info = gen.perturbations(SPEC)
    assert info.dtype == "bfloat16" and gen._params.lora_dtype == "bfloat16"
    gen._params.load(MEMBERS)
    for name in NAMES:
        shape = gen._params.hf_shapes[name]
        ref_a, ref_b = lora_factors(MEMBERS, name, shape, RANK, SIGMA)
        a_int, b_int = factors_int_many([s for s, _ in MEMBERS], name, shape, RANK)
        for p, (_, sign) in enumerate(MEMBERS):
            slot_a, slot_b = gen._params.slot(name, p)
            assert slot_a.shape[0] == 8 and slot_b.shape[1] == 8  # max_lora_rank 8 serves rank 4
            assert torch.equal(slot_a[:RANK], ref_a[p].to(torch.bfloat16)), name
            assert torch.equal(slot_b[:, :RANK], ref_b[p].to(torch.bfloat16)), name
            assert not slot_a[RANK:].any() and not slot_b[:, RANK:].any()
            served = slot_b[:, :RANK].double() @ slot_a[:RANK].double()
            exact = sign * SIGMA * (a_int[p].double() * nz.C) @ (b_int[p].double() * nz.C).T / RANK**0.5
            bound = (2**-7 + 2**-14) * (slot_b[:, :RANK].double().abs() @ slot_a[:RANK].double().abs())
            assert ((served - exact).abs() <= bound).all(), name
            assert (served - exact).abs().max() < 0.01 * exact.abs().max()

    hf, _ = load_model_and_tokenizer(model_dir, "cpu", "bfloat16")
    reference = LowRankParams.from_model(hf, ["*"], ["lm_head*"], RANK)
    assert reference.names == list(gen._params.hf_shapes)
    theta0 = gen.state()
    update = LowRankUpdate.from_members(MEMBERS, [0.8, -1.3, 0.25, 2.0], alpha=0.03, rank=RANK)
    gen.update(update)
    reference.update(update)
    hf_params = dict(hf.named_parameters())
    engine = gen._params.engine_weights(NAMES)
    moved = 0
    for name in NAMES:
        assert torch.equal(engine[name], hf_params[name].detach()), name
        moved += int((engine[name] != theta0[name].to(torch.bfloat16)).sum())
    assert moved > 0
    state = gen.state()
    assert all(torch.equal(state[n], reference.state()[n]) for n in NAMES)
    gen.load_state(theta0)
    assert not torch.equal(gen._params.engine_weights(NAMES[:1])[NAMES[0]], engine[NAMES[0]])
    gen.update(update)  # replay from θ₀: the same bits
    again = gen._params.engine_weights(NAMES)
    assert all(torch.equal(again[n], engine[n]) for n in NAMES)
    gen.load_state(theta0)


def _teacher_forced_logprobs(model, layers, prompt_ids, completion_ids, member, members) -> torch.Tensor:
    """Log-probs of `completion_ids` after `prompt_ids` under `member` (index into members; −1: θ)."""
    ids = torch.tensor([prompt_ids + completion_ids], device=model.device)
    with torch.no_grad(), population(layers, members, SIGMA, RANK, [member]):
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(completion_ids, device=model.device)[:, None])[:, 0]


def test_engine_members_agree_with_the_hf_population(gen, model_dir):
    """One generation pass serves all 4 members; each member's greedy tokens have, under the hf
    backend's population of the same member (fp32 factors, a forward hook), the log-probs the engine
    reported, far closer than under another member or under θ: the slot a request used held its
    member's perturbation. Tolerance: the bf16 engine against an fp32 reference (bf16 weights)."""
    _members_agree_with_the_hf_population(gen, model_dir, SPEC)


def test_an_mlp_only_selection_puts_lora_layers_on_the_mlp_alone(model_dir):
    """With es.include on the MLP, the engine gets LoRA layers there alone (vLLM's
    lora_target_modules), so the attention runs no LoRA kernels: a selection with attention weights
    is refused as unserved on this engine (it would be served with LoRA on every module), and the
    MLP-only members agree with the hf population of the same selection."""
    from vrl.generate import make_generator

    cfg = build({"model": model_dir, "optimizer": "es", "seed": 3,
                 "es": {"noise": "lowrank", "rank": RANK, "population_size": len(MEMBERS), "include": list(SPEC_MLP.include)},
                 "sampling": {"temperature": 0.0, "max_new_tokens": 16, "batch_size": 3},
                 "generator": {"backend": "vllm", "dtype": "bfloat16", "vllm": {
                     "enforce_eager": True, "gpu_memory_utilization": 0.2, "max_model_len": 256}}})
    g = make_generator(cfg, HostNeeds("perturbations", SPEC_MLP, variants=len(MEMBERS)))
    try:
        with pytest.raises(Unsupported, match=r"does not serve .*self_attn"):
            g.perturbations(SPEC)
        info = g.perturbations(SPEC_MLP)
        assert info.names and all(".mlp." in n for n in info.names)
        _members_agree_with_the_hf_population(g, model_dir, SPEC_MLP)
    finally:
        g.close()


def _members_agree_with_the_hf_population(gen, model_dir, spec: PerturbationSpec) -> None:
    gen.perturbations(spec)
    gen.sampling = SamplingConfig(temperature=0.0, max_new_tokens=16, batch_size=3)
    gen.logprobs = True  # the engine reports each sampled token's log-prob
    variants = [Variant(index=i, seed=s, sign=g) for i, (s, g) in enumerate(MEMBERS)]
    out = [c for batch in gen.sample(tasks(), variants, seed=5) for c in batch]
    gen.logprobs = False
    assert sorted((c.variant, c.task_id) for c in out) == sorted((v, t.id) for v in range(4) for t in tasks())
    by_member = {v: {c.task_id: c.token_ids for c in out if c.variant == v} for v in range(4)}
    assert by_member[0] != by_member[1] != by_member[2]  # members differ from each other

    hf, _ = load_model_and_tokenizer(model_dir, "cuda", "float32")
    layers = select_linear(hf, list(spec.include), list(spec.exclude))
    right, wrong, base = [], [], []
    for c in out:
        engine_lp = torch.tensor(c.logprobs, device=hf.device)
        p = c.variant
        lp = {m: _teacher_forced_logprobs(hf, layers, c.prompt_token_ids, c.token_ids, m, MEMBERS) for m in (p, (p + 2) % 4, -1)}
        right.append((engine_lp - lp[p]).abs().mean())
        wrong.append((engine_lp - lp[(p + 2) % 4]).abs().mean())
        base.append((engine_lp - lp[-1]).abs().mean())
    right, wrong, base = (torch.stack(x).mean().item() for x in (right, wrong, base))
    print(f"{spec.include}: mean |Δ log-prob|: same member {right:.4f}, other member {wrong:.4f}, θ {base:.4f}")
    assert right < 0.1
    assert right < 0.25 * min(wrong, base)


def test_sampled_members_are_seeded_per_task_as_in_sequence(gen):
    """Seeded sampling: a member's completions in a population pass are the same whichever members
    share the pass (seeds follow the task position, as `stream` seeds them)."""
    gen.perturbations(SPEC)
    gen.sampling = SamplingConfig(temperature=1.0, max_new_tokens=16, batch_size=3)
    variants = [Variant(index=i, seed=s, sign=g) for i, (s, g) in enumerate(MEMBERS)]
    together = {(c.variant, c.task_id): c.token_ids for b in gen.sample(tasks(), variants, seed=11) for c in b}
    alone = {(c.variant, c.task_id): c.token_ids for b in gen.sample(tasks(), variants[2:3], seed=11) for c in b}
    # The lone member sits in slot 0 now, with member 2's factors: its samples are member 2's. (vLLM is
    # not batch-invariant: a bf16 near-tie may flip with the batch's shape, so most, not all.)
    same = sum(together[2, t] == alone[2, t] for (_, t) in alone)
    assert same >= len(alone) - 1
    assert sum(together[2, t] == together[3, t] for (_, t) in alone) < same  # another member samples otherwise
