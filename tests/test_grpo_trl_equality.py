"""vrl's `grpo_loss` against TRL 1.16's own `GRPOTrainer._compute_loss`, on random batches: every loss type,
token and sequence importance sampling, KL with and without the bias correction, delta, the entropy
mask and the vLLM importance-sampling weight, value and gradient.

TRL is not a dependency: the test runs where `trl==1.16.0` is importable (`pip install trl==1.16.0`, or
its wheel on PYTHONPATH) and is skipped otherwise. TRL's method is called unbound on a stand-in trainer
that holds only the attributes the loss reads (one process, no gradient accumulation), with the
log-probs and entropies given instead of a model forward, so the numbers compared are TRL's own code's.
"""

from __future__ import annotations

import functools
import itertools
import types
from collections import defaultdict

import pytest
import torch

from vrl.optim.grpo_loss import grpo_loss, high_entropy_mask, off_policy_mask

trl = pytest.importorskip("trl", reason="the TRL comparison needs trl==1.16.0 (pip install trl==1.16.0)")
if trl.__version__ != "1.16.0":
    pytest.skip(f"compares with TRL 1.16.0's private loss code; trl {trl.__version__} is installed",
                allow_module_level=True)


@functools.cache
def grpo_trainer() -> type:
    """TRL's GRPOTrainer, imported when a test first needs it: the module pulls in TRL's trainer stack (datasets,
    peft, mlflow, wandb: about 2 CPU-seconds), which every pytest-xdist worker would otherwise pay at collection."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    return GRPOTrainer


class _OneProcess:
    num_processes = 1
    sync_gradients = True

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def trl_trainer_stand_in(o, use_vllm=False):
    """The attributes TRL's `_compute_loss` reads, for options `o` (one process, no gradient accumulation)."""
    coef = o.get("entropy_coef", 0.0)
    t = types.SimpleNamespace(
        accelerator=_OneProcess(), top_entropy_quantile=o["q"], off_policy_mask_threshold=o.get("opm"),
        importance_sampling_level=o["level"], beta=o["beta"], loss_type=o["loss"], epsilon_low=0.2,
        epsilon_high=0.2 if o["eps_high"] is None else o["eps_high"], use_vllm=use_vllm,
        vllm_importance_sampling_correction=use_vllm, _entropy_bonus_enabled=coef != 0.0 or o.get("adaptive", False),
        entropy_coef=coef, use_adaptive_entropy=o.get("adaptive", False), _last_world_entropy=float("inf"),
        _entropy_window_stats=None,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=o["L"], aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        get_gamma_weights=grpo_trainer().get_gamma_weights, get_off_policy_mask=grpo_trainer().get_off_policy_mask,
        args=types.SimpleNamespace(use_bias_correction_kl=o["bc"], delta=o["delta"], sapo_temperature_pos=1.0,
                                   sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                                   vespo_k_neg=3.0, vespo_lambda_neg=2.0, steps_per_generation=1,
                                   entropy_target=o.get("target", 0.2), entropy_coef_delta=o.get("delta_coef", 0.005),
                                   entropy_coef_min=0.0, entropy_coef_max=1.0),
    )
    t.get_high_entropy_mask = types.MethodType(grpo_trainer().get_high_entropy_mask, t)
    return t


def trl_loss(logps, old, ref, adv, mask, entropies, is_ratio, o, t=None, sampling=None):
    t = t or trl_trainer_stand_in(o, use_vllm=is_ratio is not None)
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    b, n = logps.shape
    inputs = {"prompt_ids": torch.zeros(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.zeros(b, n, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    if o["beta"]:
        inputs["ref_per_token_logps"] = ref
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    if sampling is not None:
        inputs["sampling_per_token_logps"] = sampling
    return grpo_trainer()._compute_loss(t, None, inputs)


CASES = [
    c for c in itertools.product(
        ["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"], ["token", "sequence"], [0.0, 0.04],
        [False, True], [None, 1.5], [1.0, 0.3], [None, "token", "sequence"], [None, 0.28])
    if not (c[0] == "vespo" and c[6] == "sequence")  # TRL refuses it
    and not (c[4] is not None and c[0] in ("cispo", "sapo", "vespo"))  # delta only acts on the clipped losses
]


def test_loss_and_gradient_equal_trl():
    torch.manual_seed(0)
    b, n, max_len = 6, 9, 12
    worst_value = worst_grad = 0.0
    for loss, level, beta, bc, delta, q, is_kind, eps_high in CASES:
        mask = (torch.arange(n)[None] < torch.randint(1, n + 1, (b, 1))).float()
        base = -torch.rand(b, n) * 3
        old, ref = base + 0.3 * torch.randn(b, n), base + 0.3 * torch.randn(b, n)
        adv, entropies = torch.randn(b), torch.rand(b, n) * 4
        is_ratio = None
        if is_kind == "token":
            is_ratio = torch.where(mask.bool(), torch.exp(0.4 * torch.randn(b, n)), 1.0)
            is_ratio = is_ratio.masked_fill(is_ratio > 1.5, 0.0)  # a token_mask weight
        elif is_kind == "sequence":
            is_ratio = torch.exp(0.5 * torch.randn(b, 1))
        o = {"q": q, "level": level, "beta": beta, "loss": loss, "eps_high": eps_high, "L": max_len, "bc": bc,
             "delta": delta}
        theirs_lp = base.clone().requires_grad_(True)
        theirs = trl_loss(theirs_lp, old, ref, adv, mask, entropies, is_ratio, o)
        theirs.backward()
        ours_lp = base.clone().requires_grad_(True)
        ours, _ = grpo_loss(ours_lp, old, adv, mask, loss_type=loss, epsilon=0.2, epsilon_high=eps_high, beta=beta,
                            ref_logps=ref, use_bias_correction_kl=bc, max_completion_length=max_len,
                            importance_sampling_level=level, delta=delta, sampling_weight=is_ratio,
                            entropy_mask=high_entropy_mask(entropies, mask, q) if q < 1 else None)
        ours.backward()
        value = abs(float(theirs.detach()) - float(ours.detach())) / max(abs(float(theirs.detach())), 1e-6)
        grad = float((theirs_lp.grad - ours_lp.grad).abs().max() / theirs_lp.grad.abs().max().clamp(min=1e-12))
        assert value < 1e-5 and grad < 1e-5, o
        worst_value, worst_grad = max(worst_value, value), max(worst_grad, grad)
    print(f"{len(CASES)} cases: worst relative difference {worst_value:.1e} (loss), {worst_grad:.1e} (gradient)")


# -- off-policy sequence mask and the entropy bonus (static and adaptive) ------------------------------------------
OPTION_CASES = list(itertools.product(["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"],
                                      [None, 0.05], [0.0, 0.1], [1.0, 0.3], [False, True]))


def test_off_policy_mask_and_entropy_bonus_equal_trl():
    """off_policy_mask_threshold (against the sampler's log-probs when reported, else π_old) and entropy_coef (the
    mean entropy of the trained tokens, with its gradient), alone and with the entropy mask: loss and gradients
    (through the log-probs and the entropies) equal TRL's `_compute_loss` to 1e-5."""
    torch.manual_seed(1)
    b, n = 8, 7
    masked = []
    for loss, opm, coef, q, vllm in OPTION_CASES:
        mask = (torch.arange(n)[None] < torch.randint(1, n + 1, (b, 1))).float()
        base = -torch.rand(b, n) * 3
        old = base + 0.3 * torch.randn(b, n)
        sampling = old + 0.2 * torch.randn(b, n) if vllm else None
        adv, ent = torch.randn(b), torch.rand(b, n) * 4
        # a token weight, 1 at padding (as `sampling_correction` makes it)
        is_ratio = torch.where(mask.bool(), torch.exp(0.2 * torch.randn(b, n)), 1.0) if vllm else None
        o = {"q": q, "level": "token", "beta": 0.0, "loss": loss, "eps_high": None, "L": n, "bc": True, "delta": None,
             "opm": opm, "entropy_coef": coef}
        theirs_lp, theirs_h = base.clone().requires_grad_(True), ent.clone().requires_grad_(True)
        theirs = trl_loss(theirs_lp, old, None, adv, mask, theirs_h, is_ratio, o, sampling=sampling)
        theirs.backward()
        ours_lp, ours_h = base.clone().requires_grad_(True), ent.clone().requires_grad_(True)
        seq = off_policy_mask(adv, ours_lp, sampling if vllm else old, mask, opm) if opm is not None else None
        ours, _ = grpo_loss(ours_lp, old, adv, mask, loss_type=loss, epsilon=0.2, max_completion_length=n,
                            sampling_weight=is_ratio, sequence_mask=seq,
                            entropy_mask=high_entropy_mask(ours_h, mask, q) if q < 1 else None,
                            entropies=ours_h if coef else None, entropy_coef=coef)
        ours.backward()
        torch.testing.assert_close(ours.detach(), theirs.detach(), atol=1e-6, rtol=1e-5, msg=o)
        torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, atol=1e-7, rtol=1e-5, msg=o)
        if coef:
            torch.testing.assert_close(ours_h.grad, theirs_h.grad, atol=1e-7, rtol=1e-5, msg=o)
        if opm is not None:
            masked.append(int((seq == 0).sum()))
    assert 0 < sum(masked) < b * len(masked) / 2  # the mask drops some completions, not most


def test_adaptive_entropy_coefficient_follows_trl_over_steps():
    """use_adaptive_entropy through the real optimizer's controller and TRL's, over eight steps whose entropies
    cross the target: the coefficient after each step and the loss of each step are TRL's."""
    from vrl.optim.grpo import GRPO
    from vrl.optim.grpo_loss import GRPOConfig

    cfg = GRPOConfig(entropy_coef=0.05, use_adaptive_entropy=True, entropy_target=1.0, entropy_coef_delta=0.02)
    ours_opt = GRPO(cfg)
    o = {"q": 1.0, "level": "token", "beta": 0.0, "loss": "dapo", "eps_high": None, "L": 5, "bc": True, "delta": None,
         "entropy_coef": 0.05, "adaptive": True, "target": 1.0, "delta_coef": 0.02}
    t = trl_trainer_stand_in(o)
    torch.manual_seed(2)
    coefs = []
    for scale in (0.5, 0.6, 2.0, 0.3, 3.0, 0.2, 0.1, 0.2):
        mask = (torch.arange(5)[None] < torch.randint(1, 6, (4, 1))).float()
        logps, adv, ent = -torch.rand(4, 5), torch.randn(4), torch.rand(4, 5) * scale
        theirs = trl_loss(logps, logps, None, adv, mask, ent, None, o, t=t)
        applied = ours_opt.entropy_coef if ours_opt._last_entropy <= cfg.entropy_target else 0.0
        ours, stats = grpo_loss(logps, logps, adv, mask, loss_type="dapo", epsilon=0.2, entropies=ent,
                                entropy_coef=applied)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
        ours_opt._adapt_entropy(float(stats["bonus_entropy_sum"]), float(stats["bonus_entropy_tokens"]))
        assert ours_opt.entropy_coef == pytest.approx(t.entropy_coef, abs=1e-9)
        assert ours_opt._last_entropy == pytest.approx(t._last_world_entropy, rel=1e-6)
        coefs.append(ours_opt.entropy_coef)
    assert len(set(round(c, 6) for c in coefs)) > 3  # it moved both ways


# -- advantages: unscorable completions and multi_objective_aggregation, through TRL's own trainer ------------------
NAN = float("nan")
# Three reward functions (weights 1, 0.5, -0.3) on three groups of four: NaN where a function returned None. Row 1
# is unscorable (every function None); group 1 has one scorable row only; group 2 is all unscorable.
TABLE = [[1.0, 0.2, NAN], [NAN, NAN, NAN], [0.0, 0.7, 1.0], [0.5, NAN, 0.3],
         [NAN, NAN, NAN], [0.4, 0.1, NAN], [NAN, NAN, NAN], [NAN, NAN, NAN],
         [NAN, NAN, NAN], [NAN, NAN, NAN], [NAN, NAN, NAN], [NAN, NAN, NAN]]
WEIGHTS = [1.0, 0.5, -0.3]


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """TRL 1.16's GRPOTrainer on the tiny model (CPU), its reward computation replaced by a fixed table."""
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig

    from vrl.generate import tiny

    def f(completions, **kwargs):
        return [None] * len(completions)

    args = TRLConfig(output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=12, num_generations=4,
                     max_completion_length=3, report_to=[], use_cpu=True, save_strategy="no", reward_weights=WEIGHTS,
                     bf16=False)
    trainer = grpo_trainer()(model=tiny.build_model(), reward_funcs=[f, f, f], args=args,
                             train_dataset=Dataset.from_list([{"prompt": f"p{i}"} for i in range(3)]),
                             processing_class=tiny.build_tokenizer())
    trainer._calculate_rewards = lambda *a, **k: torch.tensor(TABLE)
    return trainer


@pytest.mark.slow
def test_advantages_equal_trl_with_unscorable_completions(trl_trainer):
    """vrl's advantages (the rewards and reward-function values GRPO.tell reads from the verdicts) equal those of
    TRL's `_generate_and_score_completions` to 1e-5, for both multi_objective_aggregation modes and every
    scale_rewards: unscorable completions are left out of the baselines and get advantage 0."""
    from vrl.optim.grpo import reward_table
    from vrl.optim.grpo_loss import group_advantages
    from vrl.types import Completion, Result, Task, Verdict

    results = []
    for i, row in enumerate(TABLE):
        values = [None if v != v else v for v in row]
        total = sum(w * v for w, v in zip(WEIGHTS, values) if v is not None)
        task = Task(id=f"p{i // 4}", prompt=f"p{i // 4}")
        verdict = Verdict.fail("failed", "table").model_copy(update={"rewards": list(zip(values, WEIGHTS))})
        results.append(Result(task=task, completion=Completion(task_id=task.id, text=""), verdict=verdict,
                              reward=total))
    rewards, parts, weights = reward_table(results)
    assert [r != r for r in rewards] == [all(v != v for v in row) for row in TABLE]
    trl_trainer.model.train()
    for aggregation in ("sum_then_normalize", "normalize_then_sum"):
        for scale in ("group", "batch", "none"):
            trl_trainer.multi_objective_aggregation, trl_trainer.scale_rewards = aggregation, scale
            theirs = trl_trainer._generate_and_score_completions([{"prompt": f"p{i // 4}"} for i in range(12)])
            ours, _ = group_advantages(rewards, [r.task.id for r in results], scale, parts=parts, weights=weights,
                                       aggregation=aggregation)
            torch.testing.assert_close(ours, theirs["advantages"], atol=1e-5, rtol=1e-5, msg=(aggregation, scale))
            assert ours[1] == 0 and ours[8:].abs().sum() == 0 and ours.abs().sum() > 0
