"""GRPO's settings and math: `GRPOConfig` (TRL's names and defaults), group-relative advantages and the loss.

Kept apart from the optimizer (`vrl.optim.grpo`) so the formulas can be read, tested and extended
on their own; docs/grpo.md writes each one out.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# torch is imported in the functions that use it: `vrl.config` imports this module for `GRPOConfig`,
# and `import vrl` or `vrl --help` must not load torch.
if TYPE_CHECKING:
    import torch

LossType = Literal["grpo", "dapo", "dr_grpo"]
ScaleRewards = Literal["group", "batch", "none"]
LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")


class GRPOConfig(BaseModel):
    """Group Relative Policy Optimization settings (names and defaults as in TRL's GRPOConfig)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    num_generations: int = Field(8, ge=2, description="Samples per task (the group size G).")
    loss_type: LossType = Field(
        "dapo",
        description="How token losses are averaged: 'grpo' (per-sequence mean, then mean over sequences), "
        "'dapo' (mean over all completion tokens of the batch), 'dr_grpo' (sum / (sequences × max_new_tokens)).",
    )
    scale_rewards: ScaleRewards = Field(
        "group",
        description="Advantage scaling: 'group' divides by each task group's reward std, 'batch' by the batch's, "
        "'none' only subtracts the group mean (Dr. GRPO).",
    )
    epsilon: float = Field(0.2, ge=0.0, lt=1.0, description="Lower clipping bound: ratios below 1 − ε are clipped.")
    epsilon_high: float | None = Field(
        None, ge=0.0, description="Upper clipping bound 1 + ε_high; default: epsilon (DAPO recommends 0.28)."
    )
    beta: float = Field(
        0.0, ge=0.0, description="KL coefficient to the frozen initial policy (k3 estimator); 0 loads no reference."
    )
    use_bias_correction_kl: bool = Field(
        True,
        description="With beta > 0, weight each token's k3 KL by the importance ratio π_θ/π_old (differentiable), "
        "so its gradient is exactly that of KL(π_θ ‖ π_ref), on- or off-policy (DeepSeek-V3.2; the default "
        "in TRL 1.16). False: the plain k3 term, whose on-policy gradient is that of KL(π_ref ‖ π_θ).",
    )
    num_iterations: int = Field(
        1, ge=1, description="Optimizer steps per batch (μ); steps after the first use importance ratios."
    )
    mask_truncated_completions: bool = Field(
        False, description="Drop completions that hit max_new_tokens (finish_reason 'length') from the loss."
    )
    learning_rate: float = Field(1e-6, gt=0.0, description="Peak AdamW learning rate.")
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = Field(
        "linear", description="Learning-rate schedule after warmup: constant, linear decay to 0, or cosine to 0."
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup from 0 to learning_rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW β1.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW β2.")
    adam_epsilon: float = Field(1e-8, gt=0.0, description="AdamW ε.")
    max_grad_norm: float | None = Field(
        1.0, gt=0.0, description="Clip the global gradient norm to this value; null disables clipping."
    )
    micro_batch_size: int = Field(
        8, ge=1, description="Sequences per forward/backward pass; gradients accumulate over the whole batch."
    )
    logprob_chunk_size: int = Field(
        2048, ge=1, description="Completion tokens per output-head chunk when computing log-probs (bounds memory)."
    )
    save_every: int = Field(
        1, ge=1,
        description="Write a checkpoint every k iterations and after the last one (a full 1.5B checkpoint is "
        "~21 GB and takes tens of seconds); a resume redoes the iterations since the last checkpoint.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward: less memory, about a third more compute."
    )
    use_peft: bool = Field(False, description="Train LoRA adapters (needs `pip install 'vrl-core[lora]'`) instead of all weights.")
    lora_r: int = Field(16, ge=1, description="LoRA rank (with use_peft).")
    lora_alpha: int = Field(32, ge=1, description="LoRA scaling α; the update is scaled by α / r (with use_peft).")
    lora_dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA input (with use_peft).")
    lora_target_modules: list[str] | None = Field(
        None,
        description="Module names to adapt, e.g. [q_proj, v_proj] or [all-linear]; null: peft's default for the "
        "architecture (with use_peft).",
    )

    @model_validator(mode="after")
    def _lora_needs_peft(self) -> GRPOConfig:
        # Compared with the defaults, not `model_fields_set`: a recorded config lists every field.
        stray = sorted(f for f in LORA_FIELDS if getattr(self, f) != type(self).model_fields[f].default)
        if stray and not self.use_peft:
            raise ValueError(f"{', '.join(stray)} only apply to LoRA training; set grpo.use_peft=true or remove them")
        return self


# -- the math: advantages and loss ------------------------------------------------------------------
def group_advantages(
    rewards: Sequence[float], groups: Sequence[Hashable], scale_rewards: ScaleRewards = "group"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages and, per sample, whether its scaling std was zero.

    A_i = r_i − mean of i's group; unless scale_rewards='none' it is divided by (std + 1e-4), the
    unbiased std of i's group ('group') or of the whole batch ('batch'). A group of one has std 0.
    """
    import torch

    r = torch.tensor(list(rewards), dtype=torch.float32)
    if r.numel() != len(groups) or r.numel() == 0:
        raise ValueError(f"need one group key per reward (got {r.numel()} rewards and {len(groups)} keys)")
    index: dict[Hashable, list[int]] = {}
    for i, key in enumerate(groups):
        index.setdefault(key, []).append(i)
    mean, std = torch.zeros_like(r), torch.zeros_like(r)
    for members in index.values():
        sel = torch.tensor(members)
        mean[sel] = r[sel].mean()
        std[sel] = r[sel].std() if len(members) > 1 else 0.0
    if scale_rewards == "batch":
        std = torch.full_like(r, float(r.std()) if r.numel() > 1 else 0.0)
    advantages = r - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return advantages, torch.isclose(std, torch.zeros_like(std))


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: LossType,
    epsilon: float,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    use_bias_correction_kl: bool = False,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_completion_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of a (micro-)batch and detached statistics for logging.

    `logps`, `old_logps`, `ref_logps`, `mask` are [B, T]; `advantages` is [B]. `num_sequences` and
    `num_tokens` are the counts of the *whole* batch when this is one micro-batch of it, so that
    summing micro-batch losses gives the batch loss; they default to this batch's own counts.
    `use_bias_correction_kl` multiplies the KL term by ρ (not detached); this function's default is
    the plain k3 term, the optimizer passes `GRPOConfig.use_bias_correction_kl` (default on).
    """
    import torch

    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv)
    per_token = -surrogate
    stats: dict[str, torch.Tensor] = {}
    if beta:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, non-negative estimate of KL(π_θ ‖ π_ref)
        if use_bias_correction_kl:
            # Tokens were sampled from π_old: the ratio makes the estimate (and its gradient, through ρ)
            # that of KL(π_θ ‖ π_ref) under π_θ. Its value is 1 on-policy, its gradient is not.
            kl = kl * ratio
        per_token = per_token + beta * kl
        stats["kl_sum"] = torch.where(mask.bool(), kl, 0.0).sum().detach()
    # where, not multiply: a non-finite value under the mask (inf · 0 = nan) must not leak in.
    masked = torch.where(mask.bool(), per_token, 0.0) * mask
    n = logps.shape[0] if num_sequences is None else num_sequences
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / n
    elif loss_type == "dapo":
        tokens = float(mask.sum()) if num_tokens is None else float(num_tokens)
        loss = masked.sum() / max(tokens, 1.0)
    elif loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (sampling.max_new_tokens)")
        loss = masked.sum() / (n * max_completion_length)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose grpo, dapo or dr_grpo")
    with torch.no_grad():
        low = ((ratio < 1 - epsilon) & (adv < 0)).float() * mask
        high = ((ratio > 1 + eps_high) & (adv > 0)).float() * mask
        stats.update(clip_low_sum=low.sum(), clip_high_sum=high.sum(), tokens=mask.sum())
    return loss, stats
