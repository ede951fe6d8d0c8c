"""TRL 1.16's loss options through the real optimizer on the tiny Qwen2 model: the other loss types'
gradients, GSPO's sequence ratio, the entropy output of the log-prob pass and `top_entropy_quantile`,
and the importance-sampling correction against a sampler's log-probs (the generator's reported
`Completion.logprobs`, as the vllm backend sets them; here set by hand, since vLLM needs a GPU).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.test_grpo import (
    TEMPERATURE,
    advantages_by_hand,
    capture_grads,
    make_generator,
    make_grpo,
    reference_logps,
    sample_results,
)
from vrl.config import build
from vrl.errors import UsageError
from vrl.generate import tiny
from vrl.optim import grpo as grpo_mod
from vrl.optim.grpo import GRPO
from vrl.optim.logprobs import completion_logprobs, pack


def capture_loss_kwargs(monkeypatch) -> list[dict]:
    """Record what every grpo_loss call receives (tensors cloned)."""
    seen: list[dict] = []
    original = grpo_mod.grpo_loss

    def spy(logps, old_logps, advantages, mask, **kw):
        rec = {"logps": logps.detach().clone(), "old": old_logps.detach().clone(), "mask": mask.clone()}
        rec.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
        seen.append(rec)
        return original(logps, old_logps, advantages, mask, **kw)

    monkeypatch.setattr(grpo_mod, "grpo_loss", spy)
    return seen


def by_length(results):
    """The row order GRPO.tell packs in (shortest first, stable)."""
    return sorted(range(len(results)), key=lambda i: len(results[i].completion.prompt_token_ids)
                  + len(results[i].completion.token_ids))


def full_entropy(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Entropy of softmax(logits / T) at each completion position, from the full model's logits."""
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


# -- the other loss types, on-policy (ρ = 1 in value, ∇ρ = ∇log π) -----------------------------------
@pytest.mark.parametrize("case", ["bnpo", "cispo", "sapo", "luspo", "vespo", "gspo"])
def test_gradient_equals_hand_computed_loss(monkeypatch, case):
    """Per completion i with token log-probs lp (n_i tokens), A_i, ρ = exp(lp − sg(lp)):
    bnpo   Σ_k (Σ_{i∈k} Σ_t −ρA) / (Σ_{i∈k} n_i) / K over micro-batches k of 5 rows in packing order;
    cispo  Σ_i Σ_t −min(sg ρ, ε_high) A lp / Σ n (ε_high = 5);  sapo  (1/N) Σ_i mean_t −σ(τ(ρ−1)) 4/τ A;
    luspo  (1/N) Σ_i n_i · (−s_i A), s_i = exp(mean_t (lp − sg lp));  vespo  Σ −φ A lp / Σ n with φ(w=1) = 1;
    gspo   (loss_type grpo, sequence level) (1/N) Σ_i −s_i A."""
    gen = make_generator()
    results = sample_results(gen)
    initial = copy.deepcopy(gen.model)
    grads = capture_grads(monkeypatch)
    fields = {"bnpo": {"loss_type": "bnpo"}, "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
              "sapo": {"loss_type": "sapo"}, "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
              "vespo": {"loss_type": "vespo"}, "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"}}
    make_grpo(gen, micro_batch_size=5, logprob_chunk_size=3, max_grad_norm=None, **fields[case]).tell(results)

    adv = advantages_by_hand(results)
    lps = [reference_logps(initial, r.completion.prompt_token_ids, r.completion.token_ids) for r in results]
    rho = [torch.exp(lp - lp.detach()) for lp in lps]
    n = [len(lp) for lp in lps]
    N = len(results)
    if case == "bnpo":
        order = by_length(results)
        chunks = [order[s : s + 5] for s in range(0, N, 5)]
        loss = sum(sum((-(rho[i] * adv[i])).sum() for i in k) / sum(n[i] for i in k) for k in chunks) / len(chunks)
    elif case in ("cispo", "vespo"):  # weight min(1, 5) = 1 and φ(1) = e^(λ + 0 − λ) = 1
        loss = sum((-adv[i] * lps[i]).sum() for i in range(N)) / sum(n)
    elif case == "sapo":
        loss = sum((-(torch.sigmoid(1.0 * (rho[i] - 1)) * 4 / 1.0 if adv[i] > 0 else
                      torch.sigmoid(1.05 * (rho[i] - 1)) * 4 / 1.05) * adv[i]).mean() for i in range(N)) / N
    else:
        s = [torch.exp((lp - lp.detach()).mean()) for lp in lps]
        loss = sum((n[i] if case == "luspo" else 1) * -s[i] * adv[i] for i in range(N)) / N
    want = torch.autograd.grad(loss, list(initial.parameters()))
    assert len(grads) == 1 and any(g.abs().sum() > 0 for g in grads[0])
    for got, ref in zip(grads[0], want):
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-4)


def test_cispo_without_epsilon_high_caps_the_weight_at_epsilon(monkeypatch):
    """As in TRL, cispo's cap is epsilon_high, which defaults to epsilon (0.2): the weight is then 0.2 on-policy."""
    results = sample_results(make_generator())
    grads = capture_grads(monkeypatch)
    make_grpo(make_generator(), loss_type="cispo", max_grad_norm=None).tell(results)
    make_grpo(make_generator(), loss_type="cispo", epsilon_high=1.0, max_grad_norm=None).tell(results)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, 0.2 * b, atol=1e-7, rtol=1e-4)


# -- entropies and top_entropy_quantile ---------------------------------------------------------------
def test_entropy_output_equals_the_full_logits_entropy():
    """completion_logprobs(entropy=True): H = −Σ p log p of softmax(logits / T) per completion token, any chunking;
    the log-probs are the same as without it."""
    model = tiny.build_model()
    prompts, comps = [[5, 6, 7], [9] * 11, [3]], [[1, 2, 3, 4, 5], [8], [40, 41, 42]]
    with torch.no_grad():
        packed = pack(prompts, comps, 0)
        plain = completion_logprobs(model, packed, TEMPERATURE, chunk_size=2)
        logps, ent = completion_logprobs(model, packed, TEMPERATURE, chunk_size=2, entropy=True)
        for i in range(3):
            torch.testing.assert_close(ent[i, : len(comps[i])], full_entropy(model, prompts[i], comps[i]),
                                       atol=1e-5, rtol=1e-5)
    assert torch.equal(plain, logps)
    assert ent[1, 1:].abs().sum() == 0 and ent[0].min() > 0
    _, ent_grad = completion_logprobs(model, packed, TEMPERATURE, chunk_size=2, entropy=True)
    assert not ent_grad.requires_grad  # a statistic: no gradient flows through it


def test_top_entropy_quantile_trains_on_the_high_entropy_tokens(monkeypatch):
    """With top_entropy_quantile = q, each micro-batch keeps, in the policy term, the tokens whose entropy is at
    least the (1 − q) quantile of that micro-batch's entropies; grpo/entropy is the mean entropy of all tokens."""
    gen = make_generator()
    results = sample_results(gen)
    initial = copy.deepcopy(gen.model)
    seen = capture_loss_kwargs(monkeypatch)
    metrics = make_grpo(gen, top_entropy_quantile=0.25, micro_batch_size=6).tell(results)
    order = by_length(results)
    with torch.no_grad():
        ents = [full_entropy(initial, results[i].completion.prompt_token_ids, results[i].completion.token_ids)
                for i in order]
    assert len(seen) == 2
    for k, call in enumerate(seen):
        rows = ents[6 * k : 6 * k + 6]
        flat = torch.cat(rows)
        threshold = torch.quantile(flat, 0.75)
        for row, h in enumerate(rows):
            assert call["entropy_mask"][row, : len(h)].tolist() == (h >= threshold).tolist()
            assert not call["entropy_mask"][row, len(h) :].any()
        assert int(call["entropy_mask"].sum()) == pytest.approx(0.25 * len(flat), abs=1.0)
    assert metrics["grpo/entropy"] == pytest.approx(float(torch.cat(ents).mean()), rel=1e-5)


# -- importance-sampling correction against the sampler's log-probs ----------------------------------
def with_sampler_logprobs(gen, results, shifts: list[float]) -> None:
    """Give each completion sampler log-probs = the trainer's log-probs − shift_i / n_i per token, so that
    Σ_t (trainer − sampler) = shift_i: the completion's sequence ratio π_old/π_sampler is e^shift_i."""
    with torch.no_grad():
        for r, shift in zip(results, shifts):
            c = r.completion
            lp = reference_logps(gen.model, c.prompt_token_ids, c.token_ids)
            c.logprobs = (lp - shift / len(lp)).tolist()


def test_sampling_correction_weights_the_loss_by_the_masked_sequence_ratio(monkeypatch):
    """Default (TRL): π_old is the trainer's log-probs, not the sampler's; each completion's policy loss is
    multiplied by r_i = exp(Σ_t (old − sampler)) if r_i ≤ C_max = 3, else 0 (sequence_mask)."""
    gen = make_generator()
    results = sample_results(gen)
    shifts = [(-0.5, 0.0, 0.3, 1.5)[i % 4] for i in range(len(results))]  # r = 0.61, 1, 1.35, 4.48 (masked)
    with_sampler_logprobs(gen, results, shifts)
    initial = copy.deepcopy(gen.model)
    seen = capture_loss_kwargs(monkeypatch)
    metrics = make_grpo(gen, micro_batch_size=100).tell(results)
    call = seen[0]
    for row, i in enumerate(by_length(results)):
        c = results[i].completion
        with torch.no_grad():
            trainer = reference_logps(initial, c.prompt_token_ids, c.token_ids)
        torch.testing.assert_close(call["old"][row, : len(c.token_ids)], trainer, atol=1e-5, rtol=1e-5)
        want = math.exp(shifts[i]) if math.exp(shifts[i]) <= 3.0 else 0.0
        assert float(call["sampling_weight"][row, 0]) == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert call["sampling_weight"].shape == (len(results), 1)
    assert metrics["grpo/sampling/importance_sampling_ratio/min"] == 0.0
    assert metrics["grpo/sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(0.3), rel=1e-4)
    n = [len(r.completion.token_ids) for r in results]
    want_gap = sum(abs(s) for s in shifts) / sum(n)  # mean |old − sampler| over tokens: Σ_i n_i |shift_i / n_i| / Σ n
    assert metrics["grpo/sampling_logprob_diff_mean"] == pytest.approx(want_gap, rel=1e-3)
    # The mismatch as a KL: mean over tokens of k3 = e^d − d − 1, d = old − sampler = shift_i / n_i.
    want_kl = sum(k * (math.exp(s / k) - s / k - 1) for s, k in zip(shifts, n)) / sum(n)
    assert metrics["grpo/sampling_kl"] == pytest.approx(want_kl, rel=1e-3)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_sampling_correction_token_modes(monkeypatch, mode):
    """Token modes: r_t = exp(old_t − sampler_t), clamped to [C_min, C_max] (truncate) or zeroed outside (mask)."""
    gen = make_generator()
    results = sample_results(gen)
    shifts = [(-2.0, 0.0, 1.0)[i % 3] * len(r.completion.token_ids) for i, r in enumerate(results)]  # per token ∓2, 0, 1
    with_sampler_logprobs(gen, results, shifts)
    seen = capture_loss_kwargs(monkeypatch)
    make_grpo(gen, micro_batch_size=100, vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.5,
              vllm_importance_sampling_clip_max=2.0).tell(results)
    w = seen[0]["sampling_weight"]
    for row, i in enumerate(by_length(results)):
        r = math.exp(shifts[i] / len(results[i].completion.token_ids))  # e^-2, 1, e^1
        want = min(max(r, 0.5), 2.0) if mode == "token_truncate" else (r if 0.5 <= r <= 2.0 else 0.0)
        got = w[row, : len(results[i].completion.token_ids)]
        torch.testing.assert_close(got, torch.full_like(got, want), atol=1e-4, rtol=1e-4)


def test_correction_off_ignores_the_sampler_logprobs(monkeypatch):
    """vllm_importance_sampling_correction=false (TRL): the sampler's log-probs change nothing in the update."""
    base = make_generator()
    results = sample_results(base)
    grads = capture_grads(monkeypatch)
    make_grpo(make_generator(), max_grad_norm=None).tell(results)  # no sampler log-probs
    with_sampler_logprobs(base, results, [1.0] * len(results))
    metrics = make_grpo(make_generator(), max_grad_norm=None, vllm_importance_sampling_correction=False).tell(results)
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert "grpo/sampling/importance_sampling_ratio/mean" not in metrics
    assert metrics["grpo/sampling_logprob_diff_mean"] > 0  # the gap is still reported


def test_vespo_refuses_a_sequence_level_sampling_correction():
    gen = make_generator()
    results = sample_results(gen, n_tasks=1)
    with_sampler_logprobs(gen, results, [0.1] * len(results))
    with pytest.raises(ValueError, match="token_truncate or token_mask"):
        make_grpo(gen, loss_type="vespo").tell(results)
    make_grpo(gen, loss_type="vespo", vllm_importance_sampling_mode="token_mask").tell(results)
    config = build({"optimizer": "grpo", "generator": {"backend": "vllm"}, "grpo": {"loss_type": "vespo"}})
    with pytest.raises(UsageError, match="vllm_importance_sampling_mode"):
        GRPO.check_fits(config, None)
    GRPO.check_fits(build({"optimizer": "grpo", "grpo": {"loss_type": "vespo"}}), None)  # hf: no sampler log-probs


# -- TRL 1.16's other GRPOConfig fields, through the real optimizer -----------------------------------------------
def test_entropy_bonus_gradient_equals_hand_computed_loss(monkeypatch):
    """entropy_coef = c (dapo, micro-batches of 5 in packing order): loss = Σ −ρA / Σ n − c · (1/K) Σ_k mean_{t∈k} H,
    with H the full-logit entropy of softmax(logits / T) and its gradient; grpo/entropy_coef is logged."""
    gen = make_generator()
    results = sample_results(gen)
    initial = copy.deepcopy(gen.model)
    grads = capture_grads(monkeypatch)
    metrics = make_grpo(gen, micro_batch_size=5, max_grad_norm=None, entropy_coef=0.3).tell(results)
    adv = advantages_by_hand(results)
    lps = [reference_logps(initial, r.completion.prompt_token_ids, r.completion.token_ids) for r in results]
    ents = [full_entropy(initial, r.completion.prompt_token_ids, r.completion.token_ids) for r in results]
    order = by_length(results)
    chunks = [order[s : s + 5] for s in range(0, len(order), 5)]
    policy = sum((-(torch.exp(lp - lp.detach())) * a).sum() for lp, a in zip(lps, adv)) / sum(len(lp) for lp in lps)
    bonus = sum(torch.cat([ents[i] for i in k]).mean() for k in chunks) / len(chunks)
    want = torch.autograd.grad(policy - 0.3 * bonus, list(initial.parameters()))
    for got, ref in zip(grads[0], want):
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-4)
    assert metrics["grpo/entropy_coef"] == 0.3


def test_sync_ref_model_mixes_the_policy_into_the_reference_as_trl(monkeypatch):
    """sync_ref_model: after every ref_model_sync_steps-th optimizer step the reference is TRL's
    SyncRefModelCallback's mix of the policy of that step (replayed with TRL's own function)."""
    pytest.importorskip("trl", reason="the comparison runs TRL's callback")
    from trl.trainer.callbacks import SyncRefModelCallback

    policies: list[dict[str, torch.Tensor]] = []
    original = GRPO._apply_step

    def spy(self):
        norm = original(self)
        policies.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return norm

    monkeypatch.setattr(GRPO, "_apply_step", spy)
    gen = make_generator()
    initial = copy.deepcopy(gen.model)
    opt = make_grpo(gen, beta=0.04, sync_ref_model=True, ref_model_mixup_alpha=0.3, ref_model_sync_steps=2,
                    num_iterations=2, learning_rate=1e-3)
    for seed in (1, 2):
        opt.tell(sample_results(gen, seed=seed))
    replay_ref, replay_policy = copy.deepcopy(initial), copy.deepcopy(initial)
    for step, weights in enumerate(policies, start=1):  # on_step_end's rule: global_step % ref_model_sync_steps == 0
        replay_policy.load_state_dict(weights)
        if step % 2 == 0:
            SyncRefModelCallback._sync_target_model(replay_policy, replay_ref, 0.3)
    for (name, ours), theirs in zip(opt.ref_model.named_parameters(), replay_ref.parameters()):
        torch.testing.assert_close(ours, theirs, atol=1e-7, rtol=1e-6, msg=name)
    assert len(policies) == 4 and not torch.equal(next(opt.ref_model.parameters()), next(initial.parameters()))
    with pytest.raises(Exception, match="beta > 0"):
        GRPO(grpo_mod.GRPOConfig(sync_ref_model=True))


def test_cast_lm_head_to_fp32_and_router_aux_loss_refusals():
    """cast_lm_head_to_fp32 on a bf16 model: the head (policy and reference) is float32 and training's log-probs are
    those of a float32 head over the bf16 hidden states; a tied head is refused, as a router_aux_loss_coef on a
    dense model is (as TRL), in one line each."""
    gen = make_generator(dtype=torch.bfloat16)
    results = sample_results(gen, n_tasks=1)
    opt = make_grpo(gen, cast_lm_head_to_fp32=True, beta=0.04)
    assert gen.model.lm_head.weight.dtype == torch.float32 and opt.ref_model.lm_head.weight.dtype == torch.float32
    assert gen.model.model.embed_tokens.weight.dtype == torch.bfloat16
    c = results[0].completion
    packed = pack([c.prompt_token_ids], [c.token_ids], 256)
    with torch.no_grad():
        got = completion_logprobs(gen.model, packed, TEMPERATURE)[0]
        hidden = gen.model.model(input_ids=torch.tensor([c.prompt_token_ids + c.token_ids])).last_hidden_state[0]
        logits = torch.nn.functional.linear(hidden.float(), gen.model.lm_head.weight)[len(c.prompt_token_ids) - 1 : -1]
        want = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    opt.tell(results)  # trains (sampling went through the float32 head too)
    tied = make_generator()
    tied.model.lm_head.weight = tied.model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="not tied"):
        make_grpo(tied, cast_lm_head_to_fp32=True)
    with pytest.raises(ValueError, match="not a Mixture-of-Experts"):
        make_grpo(make_generator(), router_aux_loss_coef=0.01)
    make_grpo(make_generator(), router_aux_loss_coef=0.0)


def test_router_aux_loss_of_an_moe_model_enters_the_loss_as_trl_adds_it(monkeypatch):
    """A tiny Qwen2-MoE model (4 experts, top 2; random weights): with router_aux_loss_coef unset the model config's
    weight c applies, and the gradient is that of dapo's policy loss + c · aux, aux the model's own `aux_loss` on
    TRL's layout (left-padded prompts, right-padded completions, attention mask); 0 turns it off."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from vrl.generate.hf import HFGenerator

    config = Qwen2MoeConfig(vocab_size=257, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                            router_aux_loss_coef=0.5, eos_token_id=256, pad_token_id=256, bos_token_id=256)
    torch.manual_seed(0)
    moe = Qwen2MoeForCausalLM(config).eval()
    moe.generation_config.eos_token_id = moe.generation_config.pad_token_id = 256
    sampling = make_generator().sampling
    gen = HFGenerator(moe, tiny.build_tokenizer(), sampling)
    results = sample_results(gen, n_tasks=2, g=3)
    initial = copy.deepcopy(moe)
    grads = capture_grads(monkeypatch)
    metrics = make_grpo(gen, max_grad_norm=None).tell(results)
    adv = advantages_by_hand(results)
    lps = [reference_logps(initial, r.completion.prompt_token_ids, r.completion.token_ids) for r in results]
    policy = sum((-(torch.exp(lp - lp.detach())) * a).sum() for lp, a in zip(lps, adv)) / sum(len(lp) for lp in lps)
    prompts = [r.completion.prompt_token_ids for r in results]
    comps = [r.completion.token_ids for r in results]
    wp, wc = max(map(len, prompts)), max(map(len, comps))
    ids = torch.tensor([[256] * (wp - len(p)) + p + c + [256] * (wc - len(c)) for p, c in zip(prompts, comps)])
    attention = torch.tensor([[0] * (wp - len(p)) + [1] * (len(p) + len(c)) + [0] * (wc - len(c))
                              for p, c in zip(prompts, comps)])
    aux = initial(input_ids=ids, attention_mask=attention, output_router_logits=True).aux_loss
    want = torch.autograd.grad(policy + 0.5 * aux, list(initial.parameters()), allow_unused=True)
    for got, ref in zip(grads[0], want):
        torch.testing.assert_close(got, torch.zeros_like(got) if ref is None else ref, atol=2e-6, rtol=1e-4)
    assert metrics["grpo/aux_loss"] == pytest.approx(float(aux), rel=1e-5)
    off = make_grpo(HFGenerator(copy.deepcopy(initial), tiny.build_tokenizer(), sampling), router_aux_loss_coef=0.0)
    assert "grpo/aux_loss" not in off.tell(results)


def test_micro_batch_order_shuffle_is_a_seeded_permutation(monkeypatch):
    """micro_batch_order=shuffle deals a permutation seeded by (seed, iteration) instead of shortest first: bnpo's
    loss changes with it, the dapo gradient does not."""
    gen = make_generator()
    results = sample_results(gen)
    seen = capture_loss_kwargs(monkeypatch)
    a = make_grpo(make_generator(), micro_batch_size=4, loss_type="bnpo", micro_batch_order="shuffle")
    order = a._micro_batch_order(results)
    assert sorted(order) == list(range(len(results))) and order != by_length(results)
    assert order == make_grpo(make_generator(), micro_batch_order="shuffle")._micro_batch_order(results)
    a.tell(results)
    lengths = [len(results[i].completion.token_ids) for i in order[:4]]
    assert [int(m.sum()) for m in seen[0]["mask"]] == lengths
    grads = capture_grads(monkeypatch)
    make_grpo(make_generator(), micro_batch_size=4, max_grad_norm=None).tell(results)
    make_grpo(make_generator(), micro_batch_size=4, max_grad_norm=None, micro_batch_order="shuffle").tell(results)
    for x, y in zip(*grads):
        torch.testing.assert_close(x, y, atol=1e-7, rtol=1e-5)
