"""GRPO math on hand-constructed batches, checked against the formulas written out here.

The expected values are computed with plain Python floats and loops, independently of the
tensor code in vrl.optim.grpo, for every loss type, with clipping (epsilon / epsilon_high),
padding masks and the k3 KL penalty.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from vrl.config import ConfigError, build
from vrl.optim.grpo_loss import GRPOConfig, group_advantages, grpo_loss, high_entropy_mask, sampling_correction

# Three sequences, up to four tokens; row 0 has one pad, row 1 two pads.
LOGPS = [[-1.0, -0.5, -2.0, -0.3], [-0.2, -1.5, -0.7, -0.9], [-0.8, -0.1, -1.2, -2.5]]
# Ratios exp(logp - old): row 0 = [e^0.5, 1, e^-0.4, .], row 1 = [e^-0.5, e^0.1, ., .], row 2 = [1, e^0.3, e^-0.05, e^0.2]
OLD = [[-1.5, -0.5, -1.6, -0.3], [0.3, -1.6, -0.7, -0.9], [-0.8, -0.4, -1.15, -2.7]]
REF = [[-1.2, -0.4, -2.5, -1.0], [-0.1, -1.0, -0.2, -0.1], [-0.9, -0.3, -1.0, -2.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
ADV = [1.5, -0.7, 0.3]


def token_loss(lp: float, old: float, ref: float, adv: float, eps: float, eps_high: float, beta: float) -> float:
    """ℓ = −min(ρA, clip(ρ, 1−ε, 1+ε_high)·A) + β·(e^(ref−lp) − (ref−lp) − 1), ρ = e^(lp−old)."""
    rho = math.exp(lp - old)
    clipped = min(max(rho, 1 - eps), 1 + eps_high)
    out = -min(rho * adv, clipped * adv)
    if beta:
        d = ref - lp
        out += beta * (math.exp(d) - d - 1)
    return out


def expected_loss(loss_type: str, eps: float, eps_high: float, beta: float, max_len: int = 6) -> float:
    per_row_sums, per_row_tokens = [], []
    for i in range(3):
        s = sum(token_loss(LOGPS[i][t], OLD[i][t], REF[i][t], ADV[i], eps, eps_high, beta) for t in range(4) if MASK[i][t])
        per_row_sums.append(s)
        per_row_tokens.append(sum(MASK[i]))
    if loss_type == "grpo":  # mean over sequences of each sequence's token mean
        return sum(s / n for s, n in zip(per_row_sums, per_row_tokens)) / 3
    if loss_type == "dapo":  # one mean over every completion token of the batch
        return sum(per_row_sums) / sum(per_row_tokens)
    return sum(per_row_sums) / (3 * max_len)  # dr_grpo: a constant, sequences × max completion length


def tensors():
    logps = torch.tensor(LOGPS, requires_grad=True)
    return logps, torch.tensor(OLD), torch.tensor(REF), torch.tensor(MASK, dtype=torch.float32), torch.tensor(ADV)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("eps_high", [None, 0.28])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_value_matches_formula(loss_type, eps_high, beta):
    logps, old, ref, mask, adv = tensors()
    loss, stats = grpo_loss(logps, old, adv, mask, loss_type=loss_type, epsilon=0.2, epsilon_high=eps_high,
                            beta=beta, ref_logps=ref, max_completion_length=6)
    want = expected_loss(loss_type, 0.2, 0.2 if eps_high is None else eps_high, beta)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5, abs=1e-7)
    if beta:
        kl = sum(math.exp(REF[i][t] - LOGPS[i][t]) - (REF[i][t] - LOGPS[i][t]) - 1
                 for i in range(3) for t in range(4) if MASK[i][t])
        assert float(stats["kl_sum"]) == pytest.approx(kl, rel=1e-5)


def test_clipping_regions_and_gradients():
    """A token whose ratio left the trust region on the side its advantage pushes gets no gradient."""
    logps, old, _ref, mask, adv = tensors()
    eps, eps_high = 0.2, 0.28
    loss, stats = grpo_loss(logps, old, adv, mask, loss_type="dapo", epsilon=eps, epsilon_high=eps_high)
    loss.backward()
    n_tokens = sum(map(sum, MASK))
    low = high = 0
    for i in range(3):
        for t in range(4):
            rho = math.exp(LOGPS[i][t] - OLD[i][t])
            if not MASK[i][t]:
                want = 0.0
            elif (ADV[i] > 0 and rho > 1 + eps_high) or (ADV[i] < 0 and rho < 1 - eps):
                want = 0.0  # clipped: the clipped term is the minimum and is constant in θ
                low += ADV[i] < 0
                high += ADV[i] > 0
            else:
                want = -ADV[i] * rho / n_tokens  # d(−ρA)/d logp = −ρA
            assert float(logps.grad[i, t]) == pytest.approx(want, abs=1e-6), (i, t)
    # High: row 0 token 0 (ρ = e^0.5) and row 2 token 1 (ρ = e^0.3 ≈ 1.35 > 1.28), both with A > 0.
    # Low: row 1 token 0 (ρ = e^-0.5 ≈ 0.61 < 0.8) with A < 0.
    assert (low, high) == (1, 2)
    assert float(stats["clip_low_sum"]) == low and float(stats["clip_high_sum"]) == high


def test_epsilon_high_widens_only_the_upper_bound():
    logps, old, _, mask, adv = tensors()
    # Row 2 token 1: ρ = e^0.3 ≈ 1.35 with A > 0: clipped at ε_high = 0.28, not at 0.4.
    narrow, s1 = grpo_loss(logps, old, adv, mask, loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
    wide, s2 = grpo_loss(logps, old, adv, mask, loss_type="dapo", epsilon=0.2, epsilon_high=0.4)
    assert float(s1["clip_high_sum"]) == 2 and float(s2["clip_high_sum"]) == 1
    assert float(s1["clip_low_sum"]) == float(s2["clip_low_sum"]) == 1
    assert float(wide.detach()) < float(narrow.detach())


def test_kl_gradient_is_the_k3_derivative():
    """With A = 0 only the KL term remains: d/dlogp β(e^(ref−lp) − (ref−lp) − 1) = β(1 − e^(ref−lp))."""
    logps, old, ref, mask, _ = tensors()
    loss, _ = grpo_loss(logps, old, torch.zeros(3), mask, loss_type="grpo", epsilon=0.2, beta=0.1, ref_logps=ref)
    loss.backward()
    for i in range(3):
        for t in range(4):
            want = 0.1 * (1 - math.exp(REF[i][t] - LOGPS[i][t])) / sum(MASK[i]) / 3 if MASK[i][t] else 0.0
            assert float(logps.grad[i, t]) == pytest.approx(want, abs=1e-7)


def corrected_token_loss(lp: float, old: float, ref: float, adv: float, eps: float, beta: float) -> float:
    """use_bias_correction_kl: ℓ = −min(ρA, clip(ρ, 1−ε, 1+ε)·A) + β·ρ·(e^(ref−lp) − (ref−lp) − 1)."""
    rho = math.exp(lp - old)
    d = ref - lp
    return -min(rho * adv, min(max(rho, 1 - eps), 1 + eps) * adv) + beta * rho * (math.exp(d) - d - 1)


def corrected_token_grad(lp: float, old: float, ref: float, adv: float, eps: float, beta: float) -> float:
    """dℓ/dlp written out: surrogate −ρA (0 where clipped) plus β·d(ρ·k3)/dlp = β·ρ·(lp − ref)."""
    rho = math.exp(lp - old)
    clipped = (adv > 0 and rho > 1 + eps) or (adv < 0 and rho < 1 - eps)
    return (0.0 if clipped else -rho * adv) + beta * rho * (lp - ref)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_bias_corrected_kl_matches_the_written_out_formula(loss_type):
    """Value and gradient of the loss with the KL term weighted by ρ = π_θ/π_old, off-policy (old ≠ logp)."""
    logps, old, ref, mask, adv = tensors()
    beta, eps = 1.0, 0.2
    loss, stats = grpo_loss(logps, old, adv, mask, loss_type=loss_type, epsilon=eps, beta=beta, ref_logps=ref,
                            use_bias_correction_kl=True, max_completion_length=6)
    loss.backward()
    n_tokens = sum(map(sum, MASK))
    cells = [(i, t) for i in range(3) for t in range(4)]
    args = {c: (LOGPS[c[0]][c[1]], OLD[c[0]][c[1]], REF[c[0]][c[1]], ADV[c[0]], eps, beta) for c in cells}

    def norm(i: int) -> float:  # what each token's loss is divided by
        return {"grpo": sum(MASK[i]) * 3, "dapo": n_tokens, "dr_grpo": 3 * 6}[loss_type]

    want = sum(corrected_token_loss(*args[(i, t)]) / norm(i) for i, t in cells if MASK[i][t])
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    for i, t in cells:
        g = corrected_token_grad(*args[(i, t)]) / norm(i) if MASK[i][t] else 0.0
        assert float(logps.grad[i, t]) == pytest.approx(g, abs=1e-6), (i, t)
    kl = sum(math.exp(LOGPS[i][t] - OLD[i][t]) * (math.exp(REF[i][t] - LOGPS[i][t]) - (REF[i][t] - LOGPS[i][t]) - 1)
             for i, t in cells if MASK[i][t])
    assert float(stats["kl_sum"]) == pytest.approx(kl, rel=1e-5)  # the KL that enters the loss (as TRL logs it)
    # The correction changes this batch's loss: the test could not pass with the flag ignored.
    plain, _ = grpo_loss(logps, old, adv, mask, loss_type=loss_type, epsilon=eps, beta=beta, ref_logps=ref,
                         max_completion_length=6)
    assert abs(float(plain.detach()) - want) > 1e-3


def test_bias_corrected_kl_on_policy_same_value_other_gradient():
    """On-policy (π_old = π_θ, ρ ≡ 1 in value) the loss value is the same, but the KL gradient changes from
    β(1 − e^(ref−lp)) (plain k3) to β(lp − ref): the exact gradient of KL(π_θ ‖ π_ref) for the sampled token."""
    grads, values = {}, {}
    for corrected in (False, True):
        logps, _, ref, mask, _ = tensors()
        loss, _ = grpo_loss(logps, logps.detach(), torch.zeros(3), mask, loss_type="dapo", epsilon=0.2, beta=0.5,
                            ref_logps=ref, use_bias_correction_kl=corrected)
        loss.backward()
        values[corrected], grads[corrected] = float(loss.detach()), logps.grad.clone()
    assert values[True] == pytest.approx(values[False], rel=1e-6)
    n_tokens = sum(map(sum, MASK))
    for i in range(3):
        for t in range(4):
            lp, r = LOGPS[i][t], REF[i][t]
            plain = 0.5 * (1 - math.exp(r - lp)) / n_tokens if MASK[i][t] else 0.0
            exact = 0.5 * (lp - r) / n_tokens if MASK[i][t] else 0.0
            assert float(grads[False][i, t]) == pytest.approx(plain, abs=1e-7)
            assert float(grads[True][i, t]) == pytest.approx(exact, abs=1e-7)
    assert not torch.allclose(grads[True], grads[False])


def test_padding_and_masked_rows_do_not_contribute():
    logps, old, _ref, mask, adv = tensors()
    garbage = logps.detach().clone()
    garbage[mask == 0] = 123.0  # whatever sits under the mask is ignored
    a, _ = grpo_loss(logps, old, adv, mask, loss_type="grpo", epsilon=0.2)
    b, _ = grpo_loss(garbage, old, adv, mask, loss_type="grpo", epsilon=0.2)
    assert float(a.detach()) == pytest.approx(float(b.detach()))
    # A fully masked row (a truncated completion) still counts as a sequence for grpo and dr_grpo.
    masked = mask.clone()
    masked[2] = 0
    g, _ = grpo_loss(logps, old, adv, masked, loss_type="grpo", epsilon=0.2)
    rows = [sum(token_loss(LOGPS[i][t], OLD[i][t], 0, ADV[i], 0.2, 0.2, 0) for t in range(4) if MASK[i][t]) / sum(MASK[i])
            for i in range(2)]
    assert float(g.detach()) == pytest.approx(sum(rows) / 3, rel=1e-5)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_sum_to_the_batch_loss(loss_type):
    """Gradient accumulation: micro-batch losses with whole-batch normalisers add up to the batch loss."""
    logps, old, ref, mask, adv = tensors()
    kw = {"loss_type": loss_type, "epsilon": 0.2, "beta": 0.04, "max_completion_length": 6}
    whole, _ = grpo_loss(logps, old, adv, mask, ref_logps=ref, **kw)
    parts = sum(
        float(grpo_loss(logps[s], old[s], adv[s], mask[s], ref_logps=ref[s], num_sequences=3,
                        num_tokens=float(mask.sum()), **kw)[0].detach())
        for s in (slice(0, 1), slice(1, 3))
    )
    assert parts == pytest.approx(float(whole.detach()), rel=1e-6)


def test_group_advantages_match_formulas():
    rewards = [1.0, 0.0, 0.2, 0.5, 1.0, 0.5, 0.9, 0.0, 0.1]
    groups = ["a", "a", "c", "b", "a", "b", "c", "a", "c"]  # groups need not be contiguous
    by_group: dict[str, list[float]] = {}
    for r, g in zip(rewards, groups):
        by_group.setdefault(g, []).append(r)
    mean = {g: statistics.fmean(v) for g, v in by_group.items()}
    std = {g: statistics.stdev(v) for g, v in by_group.items()}  # unbiased (n − 1), as torch.std
    batch_std = statistics.stdev(rewards)

    adv, zero = group_advantages(rewards, groups, "group")
    assert adv.tolist() == pytest.approx([(r - mean[g]) / (std[g] + 1e-4) for r, g in zip(rewards, groups)], rel=1e-5)
    assert zero.tolist() == [g == "b" for g in groups]  # group b has equal rewards
    adv, _ = group_advantages(rewards, groups, "batch")
    assert adv.tolist() == pytest.approx([(r - mean[g]) / (batch_std + 1e-4) for r, g in zip(rewards, groups)], rel=1e-5)
    adv, _ = group_advantages(rewards, groups, "none")
    assert adv.tolist() == pytest.approx([r - mean[g] for r, g in zip(rewards, groups)], abs=1e-6)


def test_group_of_one_gets_zero_advantage():
    adv, zero = group_advantages([0.3, 1.0, 0.0], ["x", "y", "y"], "group")
    assert float(adv[0]) == 0.0 and bool(zero[0])


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="grpo.loss_type"):
        build({"grpo": {"loss_type": "ppo"}})
    with pytest.raises(ConfigError, match="grpo.scale_rewards"):
        build({"grpo": {"scale_rewards": "std"}})
    with pytest.raises(ConfigError, match="use_peft"):
        build({"grpo": {"lora_r": 8}})
    assert build({"grpo": {"use_peft": True, "lora_r": 8}}).grpo.lora_r == 8
    # A recorded config (every field written out, as in a run directory) loads back for resume.
    assert build(build({"optimizer": "grpo"}).model_dump(mode="json")).grpo == GRPOConfig()
    assert GRPOConfig().loss_type == "dapo" and GRPOConfig().beta == 0.0  # TRL's current defaults
    assert GRPOConfig().use_bias_correction_kl is True  # TRL 1.16's default (docs/grpo.md says why)


# -- TRL 1.16's loss family -------------------------------------------------------------------------
def cells():
    return [(i, t) for i in range(3) for t in range(4) if MASK[i][t]]


def n_tokens() -> int:
    return sum(map(sum, MASK))


def test_bnpo_averages_the_token_mean_of_each_micro_batch():
    """bnpo: loss = (1/K) Σ_k Σ_{i∈k,t} m ℓ / Σ_{i∈k,t} m over the K micro-batches (TRL: normalised by the
    local batch's tokens, then by the accumulation steps), so unlike dapo it depends on how rows are split."""
    logps, old, _ref, mask, adv = tensors()
    parts = [slice(0, 1), slice(1, 3)]
    got = sum(float(grpo_loss(logps[s], old[s], adv[s], mask[s], loss_type="bnpo", epsilon=0.2,
                              num_micro_batches=2)[0].detach()) for s in parts)
    sums = [sum(token_loss(LOGPS[i][t], OLD[i][t], 0, ADV[i], 0.2, 0.2, 0) for t in range(4) if MASK[i][t]) for i in range(3)]
    want = 0.5 * (sums[0] / sum(MASK[0]) + (sums[1] + sums[2]) / (sum(MASK[1]) + sum(MASK[2])))
    assert got == pytest.approx(want, rel=1e-6)
    assert got != pytest.approx(sum(sums) / n_tokens(), rel=1e-3)  # not dapo's single token mean
    whole, _ = grpo_loss(logps, old, adv, mask, loss_type="bnpo", epsilon=0.2)  # one micro-batch: = dapo
    assert float(whole.detach()) == pytest.approx(sum(sums) / n_tokens(), rel=1e-6)


def test_cispo_clips_the_detached_weight_not_the_objective():
    """cispo: ℓ = −sg(min(ρ, ε_high)) · A · log π_θ, mean over the batch's tokens; dℓ/dlogp = −min(ρ, ε_high) · A
    (every token keeps a gradient). `cispo_clip_sum` counts tokens with ρ > ε_high and A > 0."""
    logps, old, _ref, mask, adv = tensors()
    cap = 1.2
    loss, stats = grpo_loss(logps, old, adv, mask, loss_type="cispo", epsilon=0.2, epsilon_high=cap)
    loss.backward()
    want, clipped = 0.0, 0
    for i, t in cells():
        w = min(math.exp(LOGPS[i][t] - OLD[i][t]), cap)
        want += -w * ADV[i] * LOGPS[i][t] / n_tokens()
        clipped += math.exp(LOGPS[i][t] - OLD[i][t]) > cap and ADV[i] > 0
        assert float(logps.grad[i, t]) == pytest.approx(-w * ADV[i] / n_tokens(), abs=1e-7), (i, t)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)
    assert float(stats["cispo_clip_sum"]) == clipped == 3  # ρ = e^0.5, e^0.3, e^0.2 with A > 0


def test_sapo_soft_gate_value_and_gradient():
    """sapo: ℓ = −σ(τ(ρ − 1)) · 4/τ · A with τ = τ_pos if A > 0 else τ_neg, aggregated as 'grpo';
    dℓ/dlogp = −4 σ (1 − σ) ρ A (equal to the plain −A at ρ = 1)."""
    logps, old, _ref, mask, adv = tensors()
    tp, tn = 1.0, 1.05
    loss, stats = grpo_loss(logps, old, adv, mask, loss_type="sapo", epsilon=0.2,
                            sapo_temperature_pos=tp, sapo_temperature_neg=tn)
    loss.backward()
    want = 0.0
    for i, t in cells():
        rho, tau = math.exp(LOGPS[i][t] - OLD[i][t]), tp if ADV[i] > 0 else tn
        sig = 1 / (1 + math.exp(-tau * (rho - 1)))
        want += -sig * 4 / tau * ADV[i] / sum(MASK[i]) / 3
        g = -4 * sig * (1 - sig) * rho * ADV[i] / sum(MASK[i]) / 3
        assert float(logps.grad[i, t]) == pytest.approx(g, abs=1e-7), (i, t)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)
    assert "clip_low_sum" not in stats  # nothing is hard-clipped


def seq_ratio(i: int) -> float:
    """GSPO's sequence ratio: exp of the mean token log-ratio over the completion's tokens."""
    d = [LOGPS[i][t] - OLD[i][t] for t in range(4) if MASK[i][t]]
    return math.exp(sum(d) / len(d))


def test_gspo_sequence_level_ratio_value_gradient_and_clip_counts():
    """importance_sampling_level='sequence' (GSPO), loss_type='grpo', with the bias-corrected KL:
    s_i = exp(mean_t (logp − old)); ℓ_it = −min(s_i A_i, clip(s_i, 1−ε, 1+ε) A_i) + β s_i k3_it;
    loss = mean_i mean_t ℓ_it. Policy gradient per token: −A_i s_i / n_i / N where unclipped, else 0.
    Clip statistics count completions (TRL logs them per sequence at this level)."""
    logps, old, ref, mask, adv = tensors()
    eps, beta = 0.15, 0.1  # row 1: s = e^-0.2 ≈ 0.819 < 0.85 with A < 0: clipped
    loss, stats = grpo_loss(logps, old, adv, mask, loss_type="grpo", epsilon=eps, beta=beta, ref_logps=ref,
                            use_bias_correction_kl=True, importance_sampling_level="sequence")
    want = 0.0
    for i in range(3):
        s = seq_ratio(i)
        pol = -min(s * ADV[i], min(max(s, 1 - eps), 1 + eps) * ADV[i])
        kl = [s * (math.exp(REF[i][t] - LOGPS[i][t]) - (REF[i][t] - LOGPS[i][t]) - 1) for t in range(4) if MASK[i][t]]
        want += (pol + beta * sum(kl) / len(kl)) / 3
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)
    assert (float(stats["clip_low_sum"]), float(stats["clip_high_sum"]), float(stats["clip_units"])) == (1, 0, 3)
    # The policy term alone: its gradient flows through the shared sequence ratio.
    logps, old, _ref, mask, adv = tensors()
    loss, _ = grpo_loss(logps, old, adv, mask, loss_type="grpo", epsilon=eps, importance_sampling_level="sequence")
    loss.backward()
    for i, t in cells():
        s = seq_ratio(i)
        clipped = (ADV[i] > 0 and s > 1 + eps) or (ADV[i] < 0 and s < 1 - eps)
        g = 0.0 if clipped else -ADV[i] * s / sum(MASK[i]) / 3
        assert float(logps.grad[i, t]) == pytest.approx(g, abs=1e-7), (i, t)


def test_luspo_scales_each_sequence_loss_by_its_length():
    """luspo (with the sequence ratio, as the paper): loss = (1/N) Σ_i n_i · ℓ_i, ℓ_i = −min(s_i A_i, clip(s_i) A_i)."""
    logps, old, _ref, mask, adv = tensors()
    loss, _ = grpo_loss(logps, old, adv, mask, loss_type="luspo", epsilon=0.2, importance_sampling_level="sequence")
    want = 0.0
    for i in range(3):
        s = seq_ratio(i)
        want += sum(MASK[i]) * -min(s * ADV[i], min(max(s, 0.8), 1.2) * ADV[i]) / 3
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)


def test_vespo_gamma_weight_value_and_gradient():
    """vespo: w_i = exp(L_i), L_i = clamp(Σ_t m (logp − old) + Σ_t m log c_t, log 1e-8, 20) (c: token sampling
    correction, here given); φ_i = exp(λ + k L_i − λ w_i) with (k, λ) = (k_pos, λ_pos) if A_i ≥ 0 else the _neg pair;
    ℓ_it = −φ_i A_i logp_it, mean over the batch's tokens; φ is detached, so dℓ/dlogp = −φ_i A_i / N_tokens."""
    logps, old, _ref, mask, adv = tensors()
    corr = [[1.0, 0.5, 2.0, 1.0], [1.5, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.25]]  # 0: a masked-out token
    params = (2.0, 3.0, 3.0, 2.0)
    loss, stats = grpo_loss(logps, old, adv, mask, loss_type="vespo", epsilon=0.2, vespo_params=params,
                            sampling_weight=torch.tensor(corr))
    loss.backward()
    want, phis = 0.0, []
    for i in range(3):
        L = sum(LOGPS[i][t] - OLD[i][t] + max(math.log(corr[i][t]) if corr[i][t] else -1e30, math.log(1e-8))
                for t in range(4) if MASK[i][t])
        L = min(max(L, math.log(1e-8)), 20.0)
        k, lam = (params[0], params[1]) if ADV[i] >= 0 else (params[2], params[3])
        phis.append(math.exp(lam + k * L - lam * math.exp(L)))
    for i, t in cells():
        want += -phis[i] * ADV[i] * LOGPS[i][t] / n_tokens()
        assert float(logps.grad[i, t]) == pytest.approx(-phis[i] * ADV[i] / n_tokens(), abs=1e-7), (i, t)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    assert float(stats["vespo_phi_sum"]) == pytest.approx(sum(phis), rel=1e-5)
    assert phis[1] < 1e-6 < phis[0]  # row 1's masked token (c = 0) drives its weight to ~0


def test_delta_caps_the_ratio_of_negative_advantage_tokens():
    """delta (two-sided clipping): ℓ = −min(min(ρ, δ) A, clip(ρ, 1−ε, 1+ε) A). With A > 0 the clipped term
    already bounds it; with A < 0 and ρ > δ the loss is −δA (not −ρA) and its gradient is 0."""
    logps, old, _ref, mask, _ = tensors()
    adv = torch.tensor([-1.5, -0.7, 0.3])
    advs, delta = [-1.5, -0.7, 0.3], 1.3
    loss, _ = grpo_loss(logps, old, adv, mask, loss_type="dapo", epsilon=0.2, delta=delta)
    loss.backward()
    want = 0.0
    for i, t in cells():
        rho = math.exp(LOGPS[i][t] - OLD[i][t])
        a, b = min(rho, delta) * advs[i], min(max(rho, 0.8), 1.2) * advs[i]
        want += -min(a, b) / n_tokens()
        g = -advs[i] * rho / n_tokens() if a <= b and rho < delta else 0.0
        assert float(logps.grad[i, t]) == pytest.approx(g, abs=1e-7), (i, t)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)
    plain, _ = grpo_loss(logps, old, adv, mask, loss_type="dapo", epsilon=0.2)
    # Row 0 token 0: ρ = e^0.5 ≈ 1.65 > δ with A = −1.5: its loss drops from 1.5·1.65 to 1.5·1.3.
    assert float(plain.detach()) - want == pytest.approx(1.5 * (math.exp(0.5) - 1.3) / n_tokens(), rel=1e-5)


ENTROPY = [[2.0, 0.5, 1.0, 9.0], [3.0, 0.1, 7.0, 7.0], [0.7, 1.5, 0.2, 2.5]]  # 9.0 and 7.0s sit under the mask


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 1.0])
def test_high_entropy_mask_keeps_the_top_quantile(quantile):
    """Keep masked tokens with H ≥ the (1 − q) quantile of the masked tokens' entropies (linear interpolation)."""
    vals = sorted(ENTROPY[i][t] for i, t in cells())  # 0.1 0.2 0.5 0.7 1.0 1.5 2.0 2.5 3.0
    pos = (1 - quantile) * (len(vals) - 1)
    lo = math.floor(pos)
    threshold = vals[lo] + (vals[min(lo + 1, len(vals) - 1)] - vals[lo]) * (pos - lo)
    got = high_entropy_mask(torch.tensor(ENTROPY), torch.tensor(MASK, dtype=torch.float32), quantile)
    want = [[bool(MASK[i][t]) and ENTROPY[i][t] >= threshold for t in range(4)] for i in range(3)]
    assert got.tolist() == want
    n = {0.0: 1, 0.2: 2, 0.5: 5, 1.0: 9}[quantile]  # 0: the single highest; 1: every token
    assert int(got.sum()) == n
    assert float(threshold) == pytest.approx(float(torch.quantile(torch.tensor(vals), 1 - quantile)))


def test_entropy_mask_removes_policy_terms_but_not_kl_or_the_normaliser():
    """With top_entropy_quantile: ℓ = e_t · policy_t + β k3_t (e_t ∈ {0, 1}); dapo still divides by every token."""
    logps, old, ref, mask, adv = tensors()
    keep = high_entropy_mask(torch.tensor(ENTROPY), mask, 0.5)
    loss, _ = grpo_loss(logps, old, adv, mask, loss_type="dapo", epsilon=0.2, beta=0.04, ref_logps=ref,
                        entropy_mask=keep)
    want = 0.0
    for i, t in cells():
        kl = 0.04 * (math.exp(REF[i][t] - LOGPS[i][t]) - (REF[i][t] - LOGPS[i][t]) - 1)
        pol = token_loss(LOGPS[i][t], OLD[i][t], 0, ADV[i], 0.2, 0.2, 0) if keep[i, t] else 0.0
        want += (pol + kl) / n_tokens()
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)


SAMPLER = [[-1.2, -1.0, -1.5, 0.0], [0.9, -1.0, 0.0, 0.0], [-0.8, -0.4, -1.0, -3.4]]


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_sampling_correction_modes(mode):
    """vLLM importance-sampling correction (TRL): r = π_old/π_sampler, per token r_t = exp(old_t − s_t) or per
    sequence r_i = exp(Σ_t m (old_t − s_t)); *_truncate: clamp(r, C_min, C_max); *_mask: r if C_min ≤ r ≤ C_max
    else 0. Here C_min = 0.6, C_max = 1.5."""
    mask = torch.tensor(MASK, dtype=torch.float32)
    got = sampling_correction(torch.tensor(OLD), torch.tensor(SAMPLER), mask, mode, 0.6, 1.5)

    def bound(r: float) -> float:
        if mode.endswith("truncate"):
            return min(max(r, 0.6), 1.5)
        return r if 0.6 <= r <= 1.5 else 0.0

    if mode.startswith("token"):
        want = [[bound(math.exp(OLD[i][t] - SAMPLER[i][t])) if MASK[i][t] else bound(1.0) for t in range(4)]
                for i in range(3)]
    else:
        want = [[bound(math.exp(sum(OLD[i][t] - SAMPLER[i][t] for t in range(4) if MASK[i][t])))] for i in range(3)]
    assert got.flatten().tolist() == pytest.approx([w for row in want for w in row], rel=1e-6)
    assert not got.requires_grad
    # Every branch is exercised: ratios below C_min (row 1) and above C_max (row 2; row 0 token 1) occur.
    assert set(got.flatten().tolist()) & ({0.0} if mode.endswith("mask") else {0.6, 1.5})


def test_sampling_weight_multiplies_the_policy_term_only():
    """ℓ_t = w · policy_t + β k3_t, as TRL applies the correction before adding the KL; here with w per sequence."""
    logps, old, ref, mask, adv = tensors()
    w = [0.5, 0.0, 2.0]
    loss, _ = grpo_loss(logps, old, adv, mask, loss_type="grpo", epsilon=0.2, beta=0.04, ref_logps=ref,
                        sampling_weight=torch.tensor(w).unsqueeze(1))
    want = sum(sum(w[i] * token_loss(LOGPS[i][t], OLD[i][t], 0, ADV[i], 0.2, 0.2, 0)
                   + token_loss(LOGPS[i][t], LOGPS[i][t], REF[i][t], 0.0, 0.2, 0.2, 0.04) for t in range(4) if MASK[i][t])
               / sum(MASK[i]) for i in range(3)) / 3
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)


def test_trl_option_spellings_and_checks():
    assert build({"grpo": {"scale_rewards": True}}).grpo.scale_rewards == "group"  # TRL's booleans
    assert build({"grpo": {"scale_rewards": False}}).grpo.scale_rewards == "none"
    with pytest.raises(ConfigError, match="vllm_importance_sampling_clip_min"):
        build({"grpo": {"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.5}})
    with pytest.raises(ConfigError, match="token_truncate"):
        build({"grpo": {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None}})
    with pytest.raises(ConfigError, match="grpo.delta"):
        build({"grpo": {"delta": 0.9}})
    with pytest.raises(ConfigError, match="grpo.importance_sampling_level"):
        build({"grpo": {"importance_sampling_level": "batch"}})
    cfg = GRPOConfig()  # TRL 1.16's defaults
    assert (cfg.importance_sampling_level, cfg.delta, cfg.top_entropy_quantile) == ("token", None, 1.0)
    assert (cfg.vllm_importance_sampling_correction, cfg.vllm_importance_sampling_mode) == (True, "sequence_mask")
    assert (cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max) == (None, 3.0)
    assert (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg) == (1.0, 1.05)
    assert (cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg) == (2.0, 3.0, 3.0, 2.0)
