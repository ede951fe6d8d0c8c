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
from vrl.optim.grpo_loss import GRPOConfig, group_advantages, grpo_loss

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
        build({"grpo": {"loss_type": "bnpo"}})
    with pytest.raises(ConfigError, match="grpo.scale_rewards"):
        build({"grpo": {"scale_rewards": True}})
    with pytest.raises(ConfigError, match="use_peft"):
        build({"grpo": {"lora_r": 8}})
    assert build({"grpo": {"use_peft": True, "lora_r": 8}}).grpo.lora_r == 8
    # A recorded config (every field written out, as in a run directory) loads back for resume.
    assert build(build({"optimizer": "grpo"}).model_dump(mode="json")).grpo == GRPOConfig()
    assert GRPOConfig().loss_type == "dapo" and GRPOConfig().beta == 0.0  # TRL's current defaults
    assert GRPOConfig().use_bias_correction_kl is True  # TRL 1.16's default (docs/grpo.md says why)
