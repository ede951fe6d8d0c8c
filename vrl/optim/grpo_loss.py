"""GRPO's settings and math: `GRPOConfig` (TRL's names and defaults), group-relative advantages and the loss.

Kept apart from the optimizer (`vrl.optim.grpo`) so the formulas can be read, tested and extended
on their own; docs/grpo.md writes each one out.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# torch is imported in the functions that use it: `vrl.config` imports this module for `GRPOConfig`,
# and `import vrl` or `vrl --help` must not load torch.
if TYPE_CHECKING:
    import torch

LossType = Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
ScaleRewards = Literal["group", "batch", "none"]
ImportanceSamplingLevel = Literal["token", "sequence"]
MultiObjectiveAggregation = Literal["sum_then_normalize", "normalize_then_sum"]
SamplingCorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
FilterMetric = Literal["passed", "score", "reward"]
FILTER_FIELDS = ("filter_groups_metric", "gen_batch_multiplier", "max_num_gen_batches", "filter_groups_exhausted")


class GRPOConfig(BaseModel):
    """Group Relative Policy Optimization settings (names and defaults as in TRL's GRPOConfig)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    # TRL's names for what vrl names otherwise (docs/grpo.md's table): an unknown-field error names vrl's.
    other_names: ClassVar[dict[str, str]] = {
        "save_total_limit": "grpo.keep_checkpoints", "save_steps": "grpo.save_every",
        "per_device_train_batch_size": "grpo.micro_batch_size", "torch_compile": "grpo.compile",
        "torch_compile_backend": "grpo.compile_backend",
        "max_completion_length": "sampling.max_new_tokens", "temperature": "sampling.temperature",
        "vllm_importance_sampling_cap": "grpo.vllm_importance_sampling_clip_max",
        "top_p": "sampling.top_p", "top_k": "sampling.top_k", "min_p": "sampling.min_p",
        "repetition_penalty": "sampling.repetition_penalty", "generation_kwargs": "sampling.generation_kwargs",
    }

    num_generations: int = Field(8, ge=2, description="Samples per task (the group size G).")
    loss_type: LossType = Field(
        "dapo",
        description="The loss (TRL's loss_type; docs/grpo.md writes each out): 'grpo' (per-sequence mean, then mean "
        "over sequences), 'dapo' (mean over all completion tokens of the batch), 'dr_grpo' (sum / (sequences × "
        "max_new_tokens)), 'bnpo' (token mean per micro-batch, averaged over micro-batches), 'cispo' (clipped, "
        "detached IS weight × A × log π), 'sapo' (sigmoid-gated ratio), 'luspo' (per-sequence token sum, mean over "
        "sequences; for importance_sampling_level='sequence'), 'vespo' (Gamma-weighted sequence ratio).",
    )
    scale_rewards: ScaleRewards = Field(
        "group",
        description="Advantage scaling: 'group' divides by each task group's reward std, 'batch' by the batch's, "
        "'none' only subtracts the group mean (Dr. GRPO). As in TRL, true means 'group' and false 'none'.",
    )
    multi_objective_aggregation: MultiObjectiveAggregation = Field(
        "sum_then_normalize",
        description="With several reward functions: 'sum_then_normalize' takes advantages of their weighted sum "
        "(scale_rewards applies); 'normalize_then_sum' (GDPO) normalises each function's values within each group, "
        "sums them with their weights, and normalises the sums over the batch. Environments without reward "
        "functions have one reward: it is then normalised per group, then over the batch.",
    )
    epsilon: float = Field(0.2, ge=0.0, lt=1.0, description="Lower clipping bound: ratios below 1 − ε are clipped.")
    epsilon_high: float | None = Field(
        None, ge=0.0, description="Upper clipping bound 1 + ε_high; default: epsilon (DAPO recommends 0.28). With "
        "loss_type='cispo' it is the cap on the ratio itself (ScaleRL recommends 5.0).",
    )
    delta: float | None = Field(
        None, gt=1.0, description="Two-sided clipping (INTELLECT-2): the ratio in the unclipped term is capped at "
        "delta, which bounds the loss of negative-advantage tokens; null: off. Recommended > 1 + epsilon.",
    )
    importance_sampling_level: ImportanceSamplingLevel = Field(
        "token", description="'token': one ratio π_θ/π_old per token; 'sequence' (GSPO): one per completion, "
        "exp of the mean token log-ratio, shared by its tokens.",
    )
    sapo_temperature_pos: float = Field(
        1.0, gt=0.0, description="SAPO gate temperature τ for tokens with positive advantage (loss_type='sapo')."
    )
    sapo_temperature_neg: float = Field(
        1.05, gt=0.0, description="SAPO gate temperature τ for tokens with advantage ≤ 0 (loss_type='sapo')."
    )
    vespo_k_pos: float = Field(2.0, description="VESPO power k for advantages ≥ 0 (loss_type='vespo').")
    vespo_lambda_pos: float = Field(3.0, description="VESPO decay λ for advantages ≥ 0 (loss_type='vespo').")
    vespo_k_neg: float = Field(3.0, description="VESPO power k for negative advantages (loss_type='vespo').")
    vespo_lambda_neg: float = Field(2.0, description="VESPO decay λ for negative advantages (loss_type='vespo').")
    top_entropy_quantile: float = Field(
        1.0, ge=0.0, le=1.0, description="Train the policy term only on the tokens whose entropy is in this top "
        "quantile of each micro-batch (Beyond the 80/20 Rule recommends 0.2); 1.0 keeps every token, 0.0 only the "
        "highest-entropy one.",
    )
    entropy_coef: float = Field(
        0.0, description="Entropy bonus: subtract entropy_coef × the mean token entropy of each micro-batch (over the "
        "tokens the policy term trains on), averaged over micro-batches, from the loss (TRL's entropy_coef); the same "
        "meaning for every loss_type. 0: off. With use_adaptive_entropy, the starting coefficient.",
    )
    use_adaptive_entropy: bool = Field(
        False, description="Adaptive entropy control (Skywork-OR1): after each optimizer step the coefficient moves "
        "up by entropy_coef_delta when the step's mean token entropy is at or below entropy_target, else down, "
        "within [entropy_coef_min, entropy_coef_max]; the bonus applies only while the last step's entropy is at or "
        "below the target.",
    )
    entropy_coef_min: float = Field(0.0, description="Lower bound of the adaptive entropy coefficient.")
    entropy_coef_max: float = Field(1.0, description="Upper bound of the adaptive entropy coefficient.")
    entropy_coef_delta: float = Field(0.005, ge=0.0, description="Step of the adaptive entropy coefficient.")
    entropy_target: float = Field(
        0.2, description="Target mean token entropy (nats) of adaptive entropy control; set it near the entropy "
        "logged early in training (grpo/entropy): language models are usually at 2-10 nats.",
    )
    off_policy_mask_threshold: float | None = Field(
        None, gt=0.0, description="Off-policy sequence masking (DeepSeek-V3.2, TRL's off_policy_mask_threshold): "
        "drop from the policy term each completion with a negative advantage whose mean token KL(π_sampler ‖ π_θ) "
        "estimate, log π_sampler − log π_θ, exceeds this (π_sampler: the generator's log-probs when it reports them, "
        "else π_old). null: off; e.g. 0.5.",
    )
    vllm_importance_sampling_correction: bool = Field(
        True, description="When the generator reports sampling log-probs (vllm), multiply each token's policy loss "
        "by the truncated or masked ratio π_old/π_sampler (trainer's over sampler's log-probs; TRL's default). "
        "False: the sampler's log-probs only feed the logged gap.",
    )
    vllm_importance_sampling_mode: SamplingCorrectionMode = Field(
        "sequence_mask", description="How that ratio is taken: per 'token' or per 'sequence' (product over the "
        "completion's tokens), and 'truncate' (clamped to [clip_min, clip_max]) or 'mask' (0 outside them).",
    )
    vllm_importance_sampling_clip_max: float | None = Field(
        3.0, gt=0.0, description="Upper bound C_max of the sampling correction ratio (TRL's former "
        "vllm_importance_sampling_cap); null: none.",
    )
    vllm_importance_sampling_clip_min: float | None = Field(
        None, ge=0.0, description="Lower bound C_min of the sampling correction ratio; null: none."
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
    max_staleness: int = Field(
        0, ge=0, description="Asynchronous rollouts: sample and verify iteration k+s while training on k, for s up "
        "to this bound (each batch is trained exactly s updates after the weights that sampled it, the first s "
        "batches fewer), corrected by the sampling log-probs (vllm_importance_sampling_*). 0: the synchronous loop. "
        "Helps when verification or generation takes as long as the update (docs/grpo.md).",
    )
    sync_ref_model: bool = Field(
        False, description="With beta > 0: every ref_model_sync_steps optimizer steps, move the reference model "
        "toward the policy, π_ref ← α·π_θ + (1 − α)·π_ref (TR-DPO; TRL's sync_ref_model). Not with use_peft (the "
        "reference is the adapter-free model).",
    )
    ref_model_mixup_alpha: float = Field(
        0.6, ge=0.0, le=1.0, description="α of sync_ref_model: the policy's share in the new reference."
    )
    ref_model_sync_steps: int = Field(512, ge=1, description="Optimizer steps between syncs of sync_ref_model.")
    cast_lm_head_to_fp32: bool = Field(
        False, description="Keep the output head (of the policy and the reference) in float32 and feed it float32 "
        "hidden states, for sampling and training (ScaleRL; TRL's cast_lm_head_to_fp32). Needs an output head not "
        "tied to the input embeddings, and no LoRA on it.",
    )
    router_aux_loss_coef: float | None = Field(
        None, ge=0.0, description="Weight of a Mixture-of-Experts model's load-balancing loss, added to the loss "
        "(each micro-batch's, averaged over micro-batches; TRL's router_aux_loss_coef); null: the model config's "
        "router_aux_loss_coef; 0: off. A non-zero value on a dense model is refused.",
    )
    micro_batch_order: Literal["length", "shuffle"] = Field(
        "length", description="How the batch's samples are dealt into micro-batches: 'length' (shortest first: "
        "less padding, faster) or 'shuffle' (a random permutation per iteration, seeded, as TRL shuffles its "
        "generation batch). Only loss_type='bnpo', top_entropy_quantile < 1 and the entropy bonus depend on it.",
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
    padding_free: bool = Field(
        False,
        description="Pack each micro-batch's samples into one row without padding, position ids restarting per "
        "sample (TRL's padding_free): same log-probs, no compute on pad tokens with flash_attention_2; under "
        "sdpa/eager the block-diagonal mask spans the whole row, so it is off by default.",
    )
    save_every: int = Field(
        0, ge=0,
        description="Also write a checkpoint every k iterations (0: by time only, see save_interval_s). One is "
        "always written when the run stops, and after the last iteration as save_last says; a resume redoes the "
        "iterations since the last checkpoint.",
    )
    save_interval_s: float = Field(
        600.0, ge=0.0,
        description="Write a checkpoint once this many seconds have passed since the last (0: off). A full 1.5B "
        "checkpoint is ~21 GB; written in the background it blocks the loop for the copy to host memory only.",
    )
    save_last: Literal["auto", "full", "policy"] = Field(
        "auto",
        description="After the run's last iteration (unless save_every or save_interval_s make it due anyway): "
        "'full' writes a whole checkpoint (policy, masters, AdamW state: resumable), 'policy' the trained "
        "policy alone (grpo/policy-NNNNNN, a Hugging Face folder, what vrl export reads; ~1/7 of a full "
        "fine-tune's state); 'auto' the whole state when it is at most 2 GB (LoRA, small models), else the policy. "
        "A resume of a run that ends on a policy alone redoes the iterations since its last whole checkpoint.",
    )
    keep_checkpoints: int = Field(2, ge=1, description="How many complete checkpoints to keep (the newest).")
    async_save: bool = Field(
        True, description="Copy the checkpoint to host memory and write its files in the background (false: "
        "the loop waits for the write)."
    )
    on_disk_full: Literal["stop", "continue"] = Field(
        "stop",
        description="When a checkpoint would not fit on the disk (checked before writing; the last good one is "
        "kept): 'stop' the run after recording the iteration, or 'continue' without that checkpoint.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward: less memory, about a third more compute."
    )
    fsdp_reshard_after_forward: bool = Field(
        True,
        description="Under torchrun (FSDP2): free each decoder layer's gathered weights after its forward and gather "
        "them again for its backward. false keeps them from forward to backward: one all-gather per layer and "
        "micro-batch instead of two, for the whole model's weights in the compute dtype held during a micro-batch.",
    )
    ddp_timeout: int = Field(
        1800,
        ge=1,
        description="Under torchrun: seconds a collective (the step's, the weights' gather, a checkpoint's) may wait "
        "for the other ranks before the run fails, as TRL's ddp_timeout. The other ranks' wait for rank 0's next "
        "command (while it samples and verifies) has no bound: if rank 0 dies, torchrun ends them.",
    )
    sample_on_every_rank: bool = Field(
        False,
        description="Under torchrun: every rank samples its share of the batch's tasks on its own engine (its GPU), "
        "seeded as one engine is, and verifies it there (rank 0 receives the verdicts); every rank's engine then "
        "takes the trained weights. Off: rank 0 alone samples while the other ranks wait. Synchronous rollouts only "
        "(max_staleness=0).",
    )
    profile_dir: str | None = Field(
        None,
        description="Profile one update (torch.profiler, CPU and CUDA): write update-NNNNNN-rankR.txt (the top "
        "operations) and .json (time by kind: GEMMs, attention, NCCL collectives, other kernels, wall) here, one "
        "pair per rank. Off by default.",
    )
    profile_iteration: int = Field(
        1, ge=0, description="The iteration (0-based) whose update profile_dir profiles; 1 skips the first, warm-up one.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer of the trained model (inductor; fuses norms, rotary, "
        "activations), used by training's forward and backward only (sampling stays eager). The first steps pay "
        "the compile time (tens of seconds); shapes are dynamic (batch size and sequence length symbolic), so "
        "new lengths do not recompile, only a first one-row micro-batch or padding-free row does.",
    )
    compile_backend: str = Field(
        "inductor",
        min_length=1,
        description="The torch.compile backend of compile: inductor (fused kernels: Triton on a GPU, C++ on CPU); "
        "aot_eager captures the same graphs (dynamo, AOTAutograd's forward/backward split) and runs them "
        "unfused, which tells a problem of inductor's from one of graph capture; or any name that torch._dynamo."
        "list_backends(exclude_tags=()) gives.",
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
    # Dynamic sampling (DAPO; verl's names): `vrl.filtering` decides, `vrl.schedule` draws; docs/grpo.md.
    filter_groups: bool = Field(
        False, description="Dynamic sampling (DAPO, verl's algorithm.filter_groups): train only on groups whose raw "
        "outcome (filter_groups_metric) differs between samples; draw further generation batches until "
        "tasks_per_iteration such groups are found.",
    )
    filter_groups_metric: FilterMetric = Field(
        "passed", description="What must differ within a group (with filter_groups): 'passed' (the verdict's raw "
        "outcome), 'score' (the verifier's score, compared with a float64 tolerance), or 'reward' (the shaped reward: "
        "unsafe, a format or length bonus lets all-wrong groups through).",
    )
    gen_batch_multiplier: float = Field(
        1.0, ge=1.0, description="Tasks drawn per generation batch, as a multiple of tasks_per_iteration (rounded up; "
        "verl's data.gen_batch_size / train_batch_size), with filter_groups.",
    )
    max_num_gen_batches: int = Field(
        4, ge=1, description="Generation batches an iteration may draw before the bound is hit (with filter_groups; "
        "verl's 0 = unbounded is refused).",
    )
    filter_groups_exhausted: Literal["stop", "train"] = Field(
        "stop", description="At the bound with fewer informative groups than tasks_per_iteration (with "
        "filter_groups): 'stop' the run before the update, with an error that names the data as too hard or too "
        "easy; or 'train' on the groups found (at least one; none stops as 'stop' does).",
    )

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_rewards_bool(cls, value: object) -> object:
        # TRL's boolean spelling: True is 'group', False is 'none'.
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _sampling_correction_bounds(self) -> GRPOConfig:
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"vllm_importance_sampling_clip_min ({lo}) must be below vllm_importance_sampling_clip_max ({hi})")
        if self.vllm_importance_sampling_mode.endswith("_truncate") and lo is None and hi is None:
            raise ValueError(f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} needs "
                             "vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max")
        return self

    @model_validator(mode="after")
    def _checked_options(self) -> GRPOConfig:
        if self.sync_ref_model and self.beta == 0:
            raise ValueError("sync_ref_model=true needs beta > 0 (with beta = 0 there is no reference model to sync)")
        if self.sync_ref_model and self.use_peft:
            raise ValueError("sync_ref_model=true does not work with use_peft (the reference is the base model without "
                             "the adapter); use full fine-tuning or sync_ref_model=false")
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(f"entropy_coef_min ({self.entropy_coef_min}) must not exceed entropy_coef_max "
                             f"({self.entropy_coef_max})")
        if self.compile:  # a typo'd backend is refused before anything loads (torch is imported only here)
            from vrl.optim.compile import check_backend

            check_backend(self.compile_backend)
        return self

    @model_validator(mode="after")
    def _filter_fields_need_filter_groups(self) -> GRPOConfig:
        stray = sorted(f for f in FILTER_FIELDS if getattr(self, f) != type(self).model_fields[f].default)
        if stray and not self.filter_groups:
            raise ValueError(f"{', '.join(stray)} only apply to dynamic sampling; set grpo.filter_groups=true or "
                             "remove them")
        return self

    @model_validator(mode="after")
    def _lora_needs_peft(self) -> GRPOConfig:
        # Compared with the defaults, not `model_fields_set`: a recorded config lists every field.
        stray = sorted(f for f in LORA_FIELDS if getattr(self, f) != type(self).model_fields[f].default)
        if stray and not self.use_peft:
            raise ValueError(f"{', '.join(stray)} only apply to LoRA training; set grpo.use_peft=true or remove them")
        return self


# -- the math: advantages and loss ------------------------------------------------------------------
def group_advantages(
    rewards: Sequence[float], groups: Sequence[Hashable], scale_rewards: ScaleRewards = "group", *,
    parts: Sequence[Sequence[float]] | None = None, weights: Sequence[float] | None = None,
    aggregation: MultiObjectiveAggregation = "sum_then_normalize",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages and, per sample, whether its scaling std was zero (TRL 1.16's rules).

    A reward of NaN marks an unscorable completion (every reward function returned None): it is left out
    of its group's mean and std, and its advantage is 0. Means and stds skip NaNs; a std over fewer
    than two values is NaN, so the advantages it scales are 0.

    'sum_then_normalize' (default): A_i = r_i − mean of i's group; unless scale_rewards='none' it is
    divided by (std + 1e-4), the unbiased std of i's group ('group') or of the whole batch ('batch').
    'normalize_then_sum' (GDPO): each reward function's values `parts` ([N, K], NaN where it did not
    apply) are normalised within each group, (x − mean) / (std + 1e-4), summed with `weights`, and the
    sums normalised over the batch; `scale_rewards` plays no part.
    """
    import torch

    r = torch.tensor(list(rewards), dtype=torch.float32)
    if r.numel() != len(groups) or r.numel() == 0:
        raise ValueError(f"need one group key per reward (got {r.numel()} rewards and {len(groups)} keys)")
    index: dict[Hashable, list[int]] = {}
    for i, key in enumerate(groups):
        index.setdefault(key, []).append(i)
    members = [torch.tensor(m) for m in index.values()]
    unscorable = torch.isnan(r)
    if aggregation == "normalize_then_sum":
        x = r.unsqueeze(1) if parts is None else torch.tensor([list(p) for p in parts], dtype=torch.float32)
        w = torch.ones(x.shape[1]) if weights is None else torch.tensor(list(weights), dtype=torch.float32)
        normalised = torch.full_like(x, float("nan"))
        for sel in members:
            mean, std = _nanmean(x[sel], 0), _nanstd(x[sel], 0)
            normalised[sel] = (x[sel] - mean) / (std + 1e-4)
        summed = (normalised * w).nansum(dim=1)
        summed[unscorable] = float("nan")
        std = _nanstd(summed, 0).expand_as(summed) if summed.numel() > 1 else torch.zeros_like(summed)
        advantages = (summed - _nanmean(summed, 0)) / (std + 1e-4)
    elif aggregation == "sum_then_normalize":
        mean, std = torch.zeros_like(r), torch.zeros_like(r)
        for sel in members:
            mean[sel] = _nanmean(r[sel], 0)
            std[sel] = _nanstd(r[sel], 0) if len(sel) > 1 else 0.0
        if scale_rewards == "batch":
            std = _nanstd(r, 0).expand_as(r) if r.numel() > 1 else torch.zeros_like(r)
        advantages = r - mean
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    else:
        raise ValueError(f"unknown multi_objective_aggregation {aggregation!r}; choose sum_then_normalize or "
                         "normalize_then_sum")
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def _nanmean(x: torch.Tensor, dim: int) -> torch.Tensor:
    import torch

    return torch.nanmean(x, dim=dim)


def _nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The unbiased std over the values that are not NaN; NaN where fewer than two are."""
    import torch

    count = (~torch.isnan(x)).sum(dim)
    var = torch.nanmean((x - torch.nanmean(x, dim=dim, keepdim=True)) ** 2, dim=dim)
    var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), torch.full_like(var, float("nan")))
    return var.sqrt()


def sampling_correction(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: SamplingCorrectionMode = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """TRL's vLLM importance-sampling correction: the detached weight π_old/π_sampler per token [B, T] or,
    in the `sequence_*` modes, per completion [B, 1] (the product of its tokens' ratios).

    `*_truncate` clamps the weight to [clip_min, clip_max]; `*_mask` sets it to 0 outside them. Padding
    (mask 0) and tokens whose sampler log-prob is NaN (not reported) count as ratio 1, as in TRL.
    """
    import torch

    diff = torch.nan_to_num(torch.where(mask.bool(), old_logps - sampling_logps, 0.0), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    weight = torch.exp(diff)
    if mode.endswith("_truncate"):
        weight = torch.clamp(weight, min=clip_min, max=clip_max)
    elif mode.endswith("_mask"):
        lo = -math.inf if clip_min is None else clip_min
        hi = math.inf if clip_max is None else clip_max
        weight = weight.masked_fill((weight < lo) | (weight > hi), 0.0)
    else:
        raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}; choose token_truncate, token_mask, "
                         "sequence_truncate or sequence_mask")
    return weight.detach()


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The tokens (under `mask`) whose entropy is at or above the (1 − quantile) quantile of the masked
    tokens' entropies (linear interpolation, as `torch.quantile`): the top `quantile` of them."""
    import torch

    keep = mask.bool()
    values = entropies[keep].detach().float().sort().values
    if values.numel() == 0:
        return torch.zeros_like(keep)
    # torch.quantile refuses inputs above 2^24 elements; its linear interpolation written out has no limit.
    pos = (1.0 - quantile) * (values.numel() - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    threshold = values[lo] + (values[hi] - values[lo]) * (pos - lo)
    return (entropies >= threshold) & keep


def vespo_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    sampling_weight: torch.Tensor | None = None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """VESPO's per-completion weight φ(w) = e^λ · w^k · e^(−λw) (φ(1) = 1), detached, [B, 1].

    w = exp(Σ_t log ρ_t) is the sequence ratio π_θ/π_old (times the token-level sampling correction
    when given); log-ratios are clamped to [−20, 20] and log w to [log 1e-8, 20]; (k, λ) are the `_pos`
    pair for advantages ≥ 0, the `_neg` pair otherwise.
    """
    import torch

    floor = math.log(1e-8)
    with torch.no_grad():
        keep = mask.bool()
        log_w = torch.where(keep, log_ratio.clamp(-20.0, 20.0), 0.0).sum(-1, keepdim=True)
        if sampling_weight is not None:
            log_w = log_w + torch.where(keep, torch.log(sampling_weight).clamp(floor, 20.0), 0.0).sum(-1, keepdim=True)
        log_w = log_w.clamp(floor, 20.0)
        adv = advantages.reshape(-1, 1)
        k = torch.where(adv >= 0, k_pos, k_neg)
        lam = torch.where(adv >= 0, lambda_pos, lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_mask(advantages: torch.Tensor, logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask, [B, 1]: 0 for a completion with a negative advantage whose mean
    token log π_sampler − log π_θ (NaN counted 0) exceeds `threshold`, else 1."""
    import torch

    kl = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
    mean = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages.reshape(-1, 1) >= 0) | (mean <= threshold)).to(mask.dtype)


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, entropy_mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean token entropy over the tokens the policy term trains on (`mask`, narrowed by `entropy_mask`), with its
    gradient, and that set's entropy sum and token count (detached, for adaptive control)."""
    effective = mask if entropy_mask is None else mask * entropy_mask
    total = (entropies * effective).sum()
    count = effective.sum()
    return total / count.clamp(min=1.0), total.detach(), count.detach()


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
    num_micro_batches: int = 1,
    importance_sampling_level: ImportanceSamplingLevel = "token",
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_params: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
    sampling_weight: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
    sequence_mask: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of a (micro-)batch and detached statistics for logging.

    `logps`, `old_logps`, `ref_logps`, `mask` are [B, T]; `advantages` is [B]. `num_sequences` and
    `num_tokens` are the counts of the *whole* batch when this is one micro-batch of it, so that
    summing micro-batch losses gives the batch loss; they default to this batch's own counts
    (`num_micro_batches` is what 'bnpo' averages over). `use_bias_correction_kl` multiplies the KL
    term by ρ (not detached); this function's default is the plain k3 term, the optimizer passes
    `GRPOConfig.use_bias_correction_kl` (default on). `vespo_params` is (k_pos, λ_pos, k_neg, λ_neg).
    `sampling_weight` ([B, T] or [B, 1], from `sampling_correction`) and `entropy_mask` (from
    `high_entropy_mask`) multiply the policy term, not the KL term, as in TRL; so does `sequence_mask` ([B, 1],
    from `off_policy_mask`). `entropies` (with their gradient) and `entropy_coef`: the entropy bonus, this
    micro-batch's mean entropy over the trained tokens divided by `num_micro_batches`, times the coefficient,
    subtracted from the loss (whatever loss_type); its sums are in the statistics.
    """
    import torch

    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(1)
    keep = mask.bool()
    log_ratio = logps - old_logps
    if importance_sampling_level == "sequence":  # GSPO: one ratio per completion, exp of the mean log-ratio
        log_ratio_seq = torch.where(keep, log_ratio, 0.0).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        ratio = torch.exp(log_ratio_seq)
    elif importance_sampling_level == "token":
        ratio = torch.exp(log_ratio)
    else:
        raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}; choose token or sequence")
    stats: dict[str, torch.Tensor] = {}
    clip_ratio = ratio  # the ratio the clipping statistics look at
    if loss_type == "cispo":
        # The weight, not the objective, is clipped: every token keeps a gradient, scaled by min(ρ, ε_high).
        per_token = -torch.clamp(ratio, max=eps_high).detach() * adv * logps
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    elif loss_type == "vespo":
        phi = vespo_weights(adv, log_ratio, mask, sampling_weight, *vespo_params)
        per_token = -phi * adv * logps
    elif loss_type in ("grpo", "dapo", "dr_grpo", "bnpo", "luspo"):
        if delta is not None:
            clip_ratio = torch.clamp(ratio, max=delta)
        surrogate = torch.minimum(clip_ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv)
        per_token = -surrogate
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose grpo, dapo, dr_grpo, bnpo, cispo, sapo, luspo or vespo")
    if sequence_mask is not None:
        per_token = per_token * sequence_mask
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if sampling_weight is not None and loss_type != "vespo":  # VESPO folds it into φ
        per_token = per_token * sampling_weight
    if beta:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        delta_ref = ref_logps - logps
        kl = torch.exp(delta_ref) - delta_ref - 1  # k3: unbiased, non-negative estimate of KL(π_θ ‖ π_ref)
        if use_bias_correction_kl:
            # Tokens were sampled from π_old: the ratio makes the estimate (and its gradient, through ρ)
            # that of KL(π_θ ‖ π_ref) under π_θ. Its value is 1 on-policy, its gradient is not.
            kl = kl * ratio
        per_token = per_token + beta * kl
        stats["kl_sum"] = torch.where(keep, kl, 0.0).sum().detach()
    # where, not multiply: a non-finite value under the mask (inf · 0 = nan) must not leak in.
    masked = torch.where(keep, per_token, 0.0) * mask
    n = logps.shape[0] if num_sequences is None else num_sequences
    if loss_type in ("grpo", "sapo"):
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / n
    elif loss_type in ("dapo", "cispo", "vespo"):
        tokens = float(mask.sum()) if num_tokens is None else float(num_tokens)
        loss = masked.sum() / max(tokens, 1.0)
    elif loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (sampling.max_new_tokens)")
        loss = masked.sum() / (n * max_completion_length)
    elif loss_type == "bnpo":  # this micro-batch's own token mean, averaged over the micro-batches
        loss = masked.sum() / mask.sum().clamp(min=1.0) / num_micro_batches
    else:  # luspo: each completion's token sum (its loss scaled by its length), mean over completions
        loss = masked.sum() / n
    if entropies is not None:
        mean_entropy, entropy_total, entropy_count = entropy_bonus(entropies, mask, entropy_mask)
        loss = loss - entropy_coef * mean_entropy / num_micro_batches
        stats.update(bonus_entropy_sum=entropy_total, bonus_entropy_tokens=entropy_count)
    with torch.no_grad():
        # Token level: counted over masked tokens; sequence level: over completions, as TRL logs them.
        weight = mask if clip_ratio.shape[-1] > 1 or mask.shape[-1] == 1 else torch.ones_like(clip_ratio)
        stats.update(tokens=mask.sum(), clip_units=weight.sum())
        if loss_type == "cispo":
            stats["cispo_clip_sum"] = (((ratio > eps_high) & (adv > 0)).float() * weight).sum()
        elif loss_type == "vespo":
            stats.update(vespo_phi_sum=phi.sum(), sequences=torch.tensor(float(phi.shape[0])))
        elif loss_type != "sapo":
            low = ((clip_ratio < 1 - epsilon) & (adv < 0)).float() * weight
            high = ((clip_ratio > 1 + eps_high) & (adv > 0)).float() * weight
            stats.update(clip_low_sum=low.sum(), clip_high_sum=high.sum())
    return loss, stats
