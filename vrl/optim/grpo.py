"""GRPO: group-relative policy optimisation, with the semantics of TRL's `GRPOTrainer`.

One iteration: G samples per task from the current policy; rewards become advantages relative to
their task's group; the policy takes `num_iterations` AdamW steps on the clipped token-level
surrogate (plus a k3 KL penalty to a frozen reference when `beta` > 0). Field names and formulas
follow TRL's `GRPOConfig`; docs/grpo.md writes each formula out and maps every field to TRL.

    A_i      = (r_i − mean(r_group)) / (std(r_group) + 1e-4)        scale_rewards='group'
    ρ_i,t    = exp(log π_θ(o_i,t) − log π_old(o_i,t))
    ℓ_i,t    = −min(ρ A_i, clip(ρ, 1 − ε, 1 + ε_high) A_i) + β w (e^{ref − logπ} − (ref − logπ) − 1)
               w = ρ with use_bias_correction_kl (the default, as in TRL 1.16), else 1
    loss     = grpo: mean_i (Σ_t m ℓ / Σ_t m) · dapo: Σ m ℓ / Σ m · dr_grpo: Σ m ℓ / (N · max_new_tokens)

Every normaliser is taken over the whole batch of the iteration, so the gradient does not depend
on `micro_batch_size` (gradient accumulation only bounds memory; TRL's 'bnpo' and the entropy
quantile are per micro-batch by definition). The rest of TRL 1.16's family (bnpo, cispo, sapo,
luspo, vespo, GSPO's sequence ratio, delta, top_entropy_quantile, and the correction by
π_old/π_sampler when the generator reports its log-probs) is in `vrl.optim.grpo_loss`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from vrl import distributed
from vrl.errors import UsageError
from vrl.fileio import TMP_SUFFIX
from vrl.optim.base import Optimizer
from vrl.optim.checkpoints import BackgroundWriter, Cadence, CheckpointRefused, check_room, complete, finish
from vrl.optim.grpo_loss import (
    LORA_FIELDS,
    GRPOConfig,
    group_advantages,
    grpo_loss,
    high_entropy_mask,
    off_policy_mask,
    sampling_correction,
)
from vrl.policy import HostNeeds, PolicyHost, Variant
from vrl.reward import judged
from vrl.types import Result

# torch (and `vrl.optim.logprobs`, which needs it) is imported in the functions that use it:
# `vrl.config` imports this module for `GRPOConfig`, and `import vrl` or `vrl --help` must not load torch.
if TYPE_CHECKING:
    import torch

    from vrl.optim.logprobs import Packed
    from vrl.weights.export import ModelLoader

log = logging.getLogger(__name__)

AUTO_FULL_BYTES = 2 * 10**9  # save_last=auto: the last iteration writes the whole state up to this size
POLICY_PREFIX = "policy-"  # grpo/policy-NNNNNN/: the policy alone, written after the last iteration


def vespo_mode_error(config: GRPOConfig) -> str | None:
    """What is wrong when loss_type=vespo would correct by the sampler's log-probs per sequence; else None.

    Callers ask only where that correction applies (the generator reports its log-probs)."""
    if config.loss_type == "vespo" and config.vllm_importance_sampling_correction \
            and not config.vllm_importance_sampling_mode.startswith("token"):
        return ("grpo.loss_type=vespo folds the sampling correction into its sequence weight token by token, but "
                f"grpo.vllm_importance_sampling_mode is {config.vllm_importance_sampling_mode!r}; set it to "
                "token_truncate or token_mask (as TRL requires)")
    return None


def reward_table(results: list[Result]) -> tuple[list[float], list[list[float]] | None, list[float] | None]:
    """Each result's reward (NaN when it is unscorable: its verdict's reward functions all returned None, or the
    verifier failed to judge it, `vrl.reward.judged`) and, when every judged verdict carries its reward functions'
    values, those values ([N, K], NaN where a function did not apply, a row of NaN where the verifier failed) and
    their weights; else None, None (one reward per result)."""
    nan = float("nan")
    tables = [r.verdict.rewards if judged(r.verdict) else False for r in results]
    rewards = [nan if t is False or (t is not None and all(v is None for v, _ in t)) else r.reward
               for r, t in zip(results, tables)]
    known = [t for t in tables if t is not False]
    if not known or any(t is None for t in known) or len({len(t) for t in known}) != 1:
        return rewards, None, None
    width = len(known[0])
    return (rewards, [[nan] * width if t is False else [nan if v is None else v for v, _ in t] for t in tables],
            [w for _, w in known[0]])


# -- one micro-batch --------------------------------------------------------------------------------
class SamplingGap(NamedTuple):
    """|log π_θ − the sampler's log-prob| over a micro-batch's completion tokens, at its first step."""

    total: torch.Tensor  # summed over the tokens
    max: torch.Tensor
    tokens: torch.Tensor  # how many tokens
    kl: torch.Tensor  # Σ k3 estimate of KL(π_sampler ‖ π_old) over the tokens (they were drawn from π_sampler)


@dataclass
class MicroBatch:
    """Up to `micro_batch_size` samples of a batch, packed, with everything the loss needs of them.

    Tensors are [B, C] (completion tokens) unless noted, on the training device.
    """

    packed: Packed  # prompt + completion token ids, padded as generation laid them out
    mask: torch.Tensor  # completion tokens that enter the loss (truncated ones dropped with mask_truncated_completions)
    advantages: torch.Tensor  # [B]
    old_logps: torch.Tensor | None  # π_old, the trainer's (None: the current policy's, detached, so ρ = 1)
    from_sampler: bool  # the generator reported its own sampling log-probs (`sampling_logps`)
    ref_logps: torch.Tensor | None = None  # under the frozen reference (beta > 0)
    sampling_gap: SamplingGap | None = None  # set at the first step when `from_sampler`
    sampling_logps: torch.Tensor | None = None  # the generator's log-probs of the sampled tokens (vllm)
    sampling_weight: torch.Tensor | None = None  # π_old/π_sampler, truncated or masked ([B, C] or [B, 1]), first step
    filler: bool = False  # no weight in the loss: keeps FSDP2's collectives even when a rank has no rows left
    model_mask: torch.Tensor | None = None  # episodes: the tokens the model sampled (None: every completion token)


# -- the optimizer ----------------------------------------------------------------------------------
class GRPO(Optimizer):
    """GRPO on the host's trainable in-process model; trained weights are published to the host."""

    name = "grpo"
    Config = GRPOConfig
    moves = "trained"
    staleness = "max_staleness"  # grpo.max_staleness > 0: asynchronous rollouts (`vrl.rollouts`)
    group_relative = True  # grpo.filter_groups: dynamic sampling (`vrl.filtering`, `vrl.schedule`)
    ranks = True  # FSDP2 (or data-parallel LoRA) across a torchrun launch's ranks (`vrl.optim.grpo_dist`)
    fixed_on_resume = ("use_peft",) + LORA_FIELDS

    def __init__(self, config: GRPOConfig, seed: int = 0, total_iterations: int | None = None):
        self.config, self.seed, self.total_iterations = config, seed, total_iterations
        self._iteration = 0  # finished tell() calls
        self.step = 0  # optimizer steps taken
        # The entropy bonus's coefficient (moved by adaptive control after each step) and the last step's
        # mean entropy over the tokens the bonus acts on (inf before the first step, as in TRL).
        self.entropy_coef, self._last_entropy = config.entropy_coef, math.inf
        self._entropy_bonus = config.entropy_coef != 0.0 or config.use_adaptive_entropy
        self.group = None  # set by `setup` under torchrun; `close` may come first (a run whose host failed to start)
        self._verification: Any = None  # a rank > 0 that samples: its verification pool (`follow`)

    @classmethod
    def from_config(cls, config: Any) -> GRPO:
        return cls(config.grpo, seed=config.seed, total_iterations=config.iterations)

    @classmethod
    def check_fits(cls, config: Any, model: Callable[[], Any] | None) -> None:
        if config.sampling.effective()["temperature"] <= 0:
            raise UsageError(f"optimizer=grpo needs sampling.temperature > 0 (got {config.sampling.effective()['temperature']}): "
                             "greedy decoding gives the group's samples identical and their advantages zero; "
                             "set e.g. --set sampling.temperature=1.0")
        g, backend = config.grpo, getattr(config.generator, config.generator.backend, None)
        # The sampler's log-probs come with a vLLM backend that reports them, and with any decoupled host.
        if (getattr(backend, "sampling_logprobs", False) or g.max_staleness > 0) and (why := vespo_mode_error(g)):
            raise UsageError(why)
        if getattr(backend, "sync_every", 1) > 1 and not g.vllm_importance_sampling_correction:
            log.warning("generator.%s.sync_every=%d samples with stale weights, and "
                        "grpo.vllm_importance_sampling_correction=false leaves that uncorrected",
                        config.generator.backend, backend.sync_every)

    @property
    def iteration(self) -> int:
        return self._iteration

    def samples_per_task(self) -> int:
        return self.config.num_generations

    # setup ---------------------------------------------------------------------------------------
    def setup(self, host: PolicyHost) -> None:
        """Take the host's trainable model: LoRA, checkpointing, reference model, AdamW, schedule."""
        import torch

        super().setup(host)
        cfg = self.config
        trainable = host.trainable()
        model, tokenizer, sampling = trainable.model, trainable.tokenizer, trainable.sampling
        values = sampling.effective() if hasattr(sampling, "effective") else {"temperature": sampling.temperature}
        if values["temperature"] <= 0:
            raise ValueError("GRPO needs sampling.temperature > 0: greedy decoding gives G identical samples per task")
        if cfg.lr_scheduler_type != "constant" and self.total_iterations is None:
            raise ValueError(
                f"grpo.lr_scheduler_type={cfg.lr_scheduler_type!r} needs the run length; build GRPO with "
                "make_optimizer(config) or pass total_iterations (or use lr_scheduler_type=constant)"
            )
        self._sampling = sampling
        # The sampler's processed distribution, as far as the log-probs model it: the temperature and the
        # repetition penalty (the truncations top-k, top-p, min-p are not modelled, as in TRL; docs/grpo.md).
        self.temperature = float(values["temperature"])
        self.repetition_penalty = float(values.get("repetition_penalty", 1.0))
        self.max_completion_length = int(sampling.max_new_tokens)
        self.model, self.tokenizer = model, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.device = next(model.parameters()).device
        self.host_model = model  # the host samples from it; on one process it is also the module trained
        self.group = None  # the ranks of a torchrun launch (vrl.optim.grpo_dist), None on one process
        if distributed.world_size() > 1:
            from vrl.optim.grpo_dist import Group

            self.group = Group(self.device, cfg.ddp_timeout)
        # This process's host samples (one process; rank 0; every rank with sample_on_every_rank), so it
        # takes the trained weights after each step.
        self._samples = self.group is None or self.group.leader or cfg.sample_on_every_rank
        if cfg.padding_free:
            from vrl.optim.logprobs import packing_problem

            problem = packing_problem(model)
            if problem is not None:
                raise ValueError(problem)
        self.router_aux_loss_coef = router_aux_loss_coef(model, cfg.router_aux_loss_coef)
        if cfg.cast_lm_head_to_fp32:  # before the reference is copied from it: both heads in float32, as TRL
            cast_head_to_fp32(model)
        self.ref_model = None
        if cfg.beta > 0 and not cfg.use_peft:
            # The frozen reference is the policy as loaded (TRL's default); with LoRA it is the
            # same module with its adapters disabled, so it costs no memory.
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
            if self.group is not None:
                from vrl.optim.grpo_dist import shard

                self.ref_model = shard(self.ref_model, self.group, next(model.parameters()).dtype, trainable=False,
                                       in_place=True)
        self.peft_model = self._apply_lora(model) if cfg.use_peft else None
        if cfg.cast_lm_head_to_fp32 and hasattr(model.get_output_embeddings(), "lora_A"):
            raise ValueError("grpo.cast_lm_head_to_fp32=true does not work with a LoRA adapter on the output head; "
                             "leave lm_head out of grpo.lora_target_modules or set cast_lm_head_to_fp32=false")
        # New modules (LoRA dropout) start in training mode; sampling must never run dropout.
        model.eval()
        if cfg.gradient_checkpointing:
            # transformers 5.2x renamed gradient_checkpointing_enable to activation_checkpointing_enable
            # (the old name stays as a deprecated alias); older releases only have the old name.
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.compile:  # each decoder layer, in place, before FSDP2 shards (a copy of) them
            from vrl.optim.compile import compile_layers

            compile_layers(model, cfg.compile_backend)
        if self.group is not None and self.peft_model is not None:
            # LoRA trains data-parallel: every rank trains the whole (small) adapter on its whole frozen
            # base, from rank 0's bits; the adapter's gradients are summed over the ranks (vrl.optim.grpo_dist).
            from vrl.optim.grpo_dist import replicate

            replicate(model)
        elif self.group is not None:
            # FSDP2 trains a sharded copy in fp32 (its shards are the masters); after each step the whole
            # weights are gathered bucket by bucket and streamed to rank 0's host (`_publish`).
            from vrl.optim.grpo_dist import persistent_buffers, shard

            host = self.host_model
            self._host_dtypes = {name: p.dtype for name, p in host.named_parameters()}
            # The policy folder's buffers (they do not train), kept apart from a copy that is dropped.
            self._policy_buffers = ({n: b.detach().to("cpu", copy=True) for n, b in persistent_buffers(host).items()}
                                    if self.group.leader else {})
            # A rank keeps a whole copy only to sample from it in-process (hf): an engine takes the gathered
            # buckets as they come, and a rank that does not sample needs none. Without one, the model
            # itself is sharded: no whole copy beside it while it is converted to fp32 and sharded.
            whole = not trainable.separate and self._samples
            self.model = model = shard(model, self.group, next(model.parameters()).dtype,
                                       reshard_after_forward=cfg.fsdp_reshard_after_forward, in_place=not whole)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.param_names = [name for name, p in model.named_parameters() if p.requires_grad]  # checkpoint keys
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        # bf16 cannot hold a 1e-6-sized step on most weights: keep fp32 master copies for AdamW.
        self.master = (
            self.params
            if all(p.dtype == torch.float32 for p in self.params)
            else [p.detach().float().clone().requires_grad_(True) for p in self.params]
        )
        if self.master is not self.params:
            # Each bf16 gradient moves into its fp32 master the moment backward has accumulated it,
            # so a micro-batch never holds the whole model's bf16 gradients (≈ 2 bytes per parameter).
            # A later GRPO on the same model replaces the hook (else the old one would take the gradient).
            for p, m in zip(self.params, self.master):
                old = getattr(p, "_vrl_grad_hook", None)
                if old is not None:
                    old.remove()
                p._vrl_grad_hook = p.register_post_accumulate_grad_hook(_into_master(m))
        self.optim = torch.optim.AdamW(
            self.master,
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_epsilon,
            weight_decay=cfg.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optim, self.lr_factor)
        self._cadence = Cadence(cfg.save_every, cfg.save_interval_s, self.total_iterations)
        self._writer = BackgroundWriter()
        self._saved = self._refused = None  # the iteration of the last whole checkpoint written / refused
        self._writing: Path | None = None  # the temporary folder of the last checkpoint handed to the writer
        self._written: int | None = None  # ... and its iteration

    def _apply_lora(self, model):
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as exc:
            raise ImportError("grpo.use_peft=true needs peft: pip install 'vrl-core[lora]'") from exc
        import torch

        cfg = self.config
        targets = cfg.lora_target_modules
        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=targets[0] if targets == ["all-linear"] else targets,
            task_type="CAUSAL_LM",
        )
        # peft injects the adapters into `model` in place, so the generator samples with them.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.seed)
            return get_peft_model(model, lora)

    def lr_factor(self, step: int) -> float:
        """Learning-rate multiplier at optimizer step `step` (0-based), as in transformers' schedules."""
        cfg = self.config
        if step < cfg.warmup_steps:
            return step / cfg.warmup_steps
        if cfg.lr_scheduler_type == "constant":
            return 1.0
        total = self.total_iterations * cfg.num_iterations
        progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        if cfg.lr_scheduler_type == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))

    # ask / tell ----------------------------------------------------------------------------------
    def ask(self) -> list[Variant]:
        return [Variant(index=0, samples_per_task=self.config.num_generations)]

    def tell(self, results: list[Result]) -> dict[str, float]:
        """Advantages from the results' rewards, then `num_iterations` AdamW steps on the GRPO loss (under
        torch.profiler for the iteration `profile_iteration`, when `profile_dir` is set)."""
        cfg = self.config
        if cfg.profile_dir is None or self._iteration != cfg.profile_iteration:
            return self._tell(results)
        from vrl.optim.profile import profiled

        rank = 0 if self.group is None else self.group.rank
        with profiled(Path(cfg.profile_dir), f"update-{self._iteration:06d}-rank{rank}"):
            return self._tell(results)

    def _tell(self, results: list[Result]) -> dict[str, float]:
        import torch

        cfg = self.config
        if self.group is not None and self.group.leader:
            self.group.send("tell", results)  # every rank sees the whole batch (see vrl.optim.grpo_dist)
        if not results:
            raise ValueError("GRPO.tell got no results")
        for r in results:
            c = r.completion
            if c.token_ids is None or c.prompt_token_ids is None:
                raise ValueError(
                    f"completion for task {c.task_id!r} carries no token ids; GRPO trains on the sampled ids "
                    "(Completion.prompt_token_ids and token_ids), which the generator must keep"
                )
            if c.logprobs is not None and len(c.logprobs) != len(c.token_ids):
                raise ValueError(
                    f"completion for task {c.task_id!r} has {len(c.logprobs)} log-probs for {len(c.token_ids)} tokens"
                )
        rewards, parts, weights = reward_table(results)
        advantages, zero_std = group_advantages(rewards, [r.task.id for r in results], cfg.scale_rewards,
                                                parts=parts, weights=weights,
                                                aggregation=cfg.multi_objective_aggregation)
        truncated = [r.completion.finish_reason == "length" for r in results]
        order = self._micro_batch_order(results)
        batches = [self._micro_batch(results, order[s : s + cfg.micro_batch_size], advantages, truncated)
                   for s in range(0, len(order), cfg.micro_batch_size)] if self.group is None \
            else self._rank_batches(results, order, advantages, truncated)
        num_sequences = len(results)
        num_tokens = float(sum(b.mask.sum() for b in batches))
        if self.group is not None:
            num_tokens = self.group.sum({"tokens": num_tokens})["tokens"]

        self._fill_reference_and_old(batches, results)
        if batches[0].from_sampler and (why := vespo_mode_error(cfg)):
            raise ValueError(why)
        totals: dict[str, float] = {"loss": 0.0, "grad_norm": 0.0, "kl_sum": 0.0, "tokens": 0.0}
        lr = 0.0
        for _ in range(cfg.num_iterations):
            lr = self.optim.param_groups[0]["lr"]
            loss, stats = self._accumulate(batches, num_sequences, num_tokens)
            if self.group is not None:  # each rank summed its own micro-batches: the batch's sums are over ranks
                stats = self.group.sum({**stats, "_loss": loss})
                loss = stats.pop("_loss")
                if self.peft_model is not None:  # LoRA trains data-parallel: the adapter's gradients add up
                    self.group.add_grads(self.master)
            totals["loss"] += loss / cfg.num_iterations
            totals["grad_norm"] += self._apply_step() / cfg.num_iterations
            if cfg.use_adaptive_entropy:
                self._adapt_entropy(stats["bonus_entropy_sum"], stats["bonus_entropy_tokens"])
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
        self._iteration += 1
        publish_error = None
        try:
            self._publish()
        except Exception as exc:
            if self.group is None:
                raise
            # The host failed to take the push (its stream was drawn to the end, so the gathers stayed in
            # step): the other ranks still run this step's metric collectives below, so raise after them.
            publish_error = exc

        scored = torch.tensor([x for x in rewards if not math.isnan(x)])
        tokens = max(totals["tokens"], 1.0)
        units = max(totals.get("clip_units", 0.0), 1.0)  # tokens, or completions at importance_sampling_level=sequence
        clip = {}
        if "clip_low_sum" in totals:  # the losses that clip the ratio (not cispo, sapo, vespo)
            clip = {"grpo/clip_ratio/low_mean": totals["clip_low_sum"] / units,
                    "grpo/clip_ratio/high_mean": totals["clip_high_sum"] / units,
                    "grpo/clip_ratio/region_mean": (totals["clip_low_sum"] + totals["clip_high_sum"]) / units}
        metrics = {
            "grpo/loss": totals["loss"],
            "grpo/grad_norm": totals["grad_norm"],
            "grpo/learning_rate": lr,
            "grpo/reward_std": float(scored.std()) if len(scored) > 1 else 0.0,
            "grpo/unscorable": float(len(rewards) - len(scored)),
            "grpo/frac_reward_zero_std": float(zero_std.float().mean()),
            "grpo/advantage_abs_mean": float(advantages.abs().mean()),
            **clip,
            "grpo/completions/clipped_ratio": sum(truncated) / len(truncated),
            # the model's tokens (an episode's environment tokens are not its length, as in TRL)
            "grpo/completions/mean_length": sum(r.completion.completion_tokens or len(r.completion.token_ids)
                                                for r in results) / len(results),
            "grpo/trained_tokens": num_tokens,
            # The share of the padded micro-batches' positions that are padding: what padding_free removes.
            "grpo/pad_fraction": self._pad_fraction(batches),
        }
        if "cispo_clip_sum" in totals:
            metrics["grpo/cispo_clip_ratio"] = totals["cispo_clip_sum"] / units
        if "vespo_phi_sum" in totals:
            metrics["grpo/vespo/phi_seq_mean"] = totals["vespo_phi_sum"] / max(totals["sequences"], 1.0)
        if "entropy_sum" in totals:  # computed with top_entropy_quantile < 1
            metrics["grpo/entropy"] = totals["entropy_sum"] / tokens
        if cfg.beta > 0:
            metrics["grpo/kl"] = totals["kl_sum"] / tokens
        if self._entropy_bonus:
            metrics["grpo/entropy_coef"] = self.entropy_coef
        if "aux_loss_sum" in totals:  # mean over the micro-batches of every step
            steps = cfg.num_iterations * len(batches) * (self.group.world if self.group else 1)
            metrics["grpo/aux_loss"] = totals["aux_loss_sum"] / steps
        if "off_policy_masked" in totals:
            metrics["grpo/off_policy_masked"] = totals["off_policy_masked"] / cfg.num_iterations
        gaps = [b.sampling_gap for b in batches if b.sampling_gap is not None]
        if gaps:  # the generator reported sampling log-probs (vllm): how far they are from training's
            metrics["grpo/sampling_logprob_diff_mean"] = float(sum(g.total for g in gaps) / max(float(sum(g.tokens for g in gaps)), 1.0))
            metrics["grpo/sampling_logprob_diff_max"] = float(max(g.max for g in gaps))
            metrics["grpo/sampling_kl"] = float(sum(g.kl for g in gaps) / max(float(sum(g.tokens for g in gaps)), 1.0))
        weights = [b.sampling_weight[b.mask.bool()] if b.sampling_weight.shape[-1] > 1 or b.mask.shape[-1] == 1
                   else b.sampling_weight.flatten() for b in batches if b.sampling_weight is not None]
        weights = torch.cat(weights) if weights else torch.zeros(0)
        if weights.numel():  # the sampling correction's weights (TRL: sampling/importance_sampling_ratio/*)
            metrics["grpo/sampling/importance_sampling_ratio/min"] = float(weights.min())
            metrics["grpo/sampling/importance_sampling_ratio/mean"] = float(weights.mean())
            metrics["grpo/sampling/importance_sampling_ratio/max"] = float(weights.max())
        if self.group is not None:
            metrics.update(self._sampling_metrics_over_ranks(batches))
        if publish_error is not None:
            raise publish_error
        return metrics

    def _micro_batch_order(self, results: list[Result]) -> list[int]:
        """The order samples are dealt into micro-batches (`micro_batch_order`): shortest first, so micro-batches of
        similar lengths waste less compute on padding; or a permutation seeded by (seed, iteration), as TRL
        shuffles its generation batch. Only per-micro-batch quantities depend on it (docs/grpo.md)."""
        if self.config.micro_batch_order == "shuffle":
            import torch

            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self._iteration) % (2**63))
            return torch.randperm(len(results), generator=gen).tolist()
        return sorted(range(len(results)), key=lambda i: len(results[i].completion.prompt_token_ids)
                      + len(results[i].completion.token_ids))

    # several ranks (torchrun, FSDP2; vrl.optim.grpo_dist) --------------------------------------------
    def _rank_batches(self, results: list[Result], order: list[int], advantages: torch.Tensor,
                      truncated: list[bool]) -> list[MicroBatch]:
        """This rank's micro-batches: as many on every rank; a rank left without rows trains a filler."""
        from vrl.optim.grpo_dist import share_rows

        batches = []
        for rows in share_rows(order, self.group.world, self.config.micro_batch_size, self.group.rank):
            b = self._micro_batch(results, rows or order[:1], advantages, truncated)
            if not rows:
                b.mask, b.advantages, b.filler = b.mask * 0, b.advantages * 0, True
            batches.append(b)
        return batches

    def _sampling_metrics_over_ranks(self, batches: list[MicroBatch]) -> dict[str, float]:
        """The sampler-gap and correction-weight metrics of the whole batch (each rank saw its share)."""
        import torch

        out: dict[str, float] = {}
        real = [b for b in batches if not b.filler]
        if any(b.sampling_gap is not None for b in batches):  # the same on every rank: it follows the results
            gaps = [b.sampling_gap for b in real if b.sampling_gap is not None]
            s = self.group.sum({"total": float(sum(g.total for g in gaps)), "tokens": float(sum(g.tokens for g in gaps)),
                                "kl": float(sum(g.kl for g in gaps))})
            out["grpo/sampling_logprob_diff_mean"] = s["total"] / max(s["tokens"], 1.0)
            out["grpo/sampling_logprob_diff_max"] = self.group.max(max((float(g.max) for g in gaps), default=0.0))
            out["grpo/sampling_kl"] = s["kl"] / max(s["tokens"], 1.0)
        if any(b.sampling_weight is not None for b in batches):
            w = [b.sampling_weight[b.mask.bool()] if b.sampling_weight.shape[-1] > 1 or b.mask.shape[-1] == 1
                 else b.sampling_weight.flatten() for b in real if b.sampling_weight is not None]
            w = torch.cat(w) if w else torch.zeros(0)
            s = self.group.sum({"sum": float(w.sum()), "n": float(w.numel())})
            if s["n"]:
                inf = float("inf")
                out["grpo/sampling/importance_sampling_ratio/min"] = self.group.min(float(w.min()) if w.numel() else inf)
                out["grpo/sampling/importance_sampling_ratio/mean"] = s["sum"] / s["n"]
                out["grpo/sampling/importance_sampling_ratio/max"] = self.group.max(float(w.max()) if w.numel() else -inf)
        return out

    @classmethod
    def check_launch(cls, config: Any) -> None:
        if config.grpo.sample_on_every_rank and config.grpo.max_staleness > 0:
            raise UsageError("grpo.sample_on_every_rank samples on every rank between training steps; it cannot run "
                             "with asynchronous rollouts: set grpo.max_staleness=0 or grpo.sample_on_every_rank=false")

    def samples_on_every_rank(self) -> bool:
        return self.config.sample_on_every_rank

    def needs(self) -> HostNeeds:
        """Trained weights; with `use_peft`, the adapter's rank (a vLLM engine can then serve the adapter
        and take only its weights at each push)."""
        return HostNeeds(self.moves, adapter_rank=self.config.lora_r if self.config.use_peft else 0)

    def _publish(self) -> None:
        """Hand the trained weights to the host. On several ranks (FSDP2) every rank gathers them bucket by
        bucket and rank 0's host takes the stream (every rank's, with `sample_on_every_rank`); what a
        host leaves undrawn (a push it skips, or fails in) is still gathered, so every rank draws the
        same collectives. With LoRA each rank trains its host's own model, pushed as on one process."""
        group = self.group
        if group is not None and self.peft_model is None:
            from vrl.optim.grpo_dist import gathered
            from vrl.policy import WeightStream

            stream = WeightStream(gathered(self.model, self._host_dtypes))
            try:
                if self._samples:
                    self.host.publish(stream)
            finally:
                stream.drain()
            return
        if self._samples:
            self.host.publish(self.host_model)

    def sampler(self, host: PolicyHost) -> PolicyHost:
        """Under torchrun with `sample_on_every_rank`: rank 0's host and every other rank's, as one host
        (`grpo_dist.RankHosts`); otherwise `host`."""
        if self.group is None or not self.config.sample_on_every_rank:
            return host
        from vrl.optim.grpo_dist import RankHosts

        return RankHosts(host, self.group, granule=getattr(self._sampling, "batch_size", 1))

    def sample_share(self, work: list[Any]) -> None:
        """A rank > 0: sample this rank's calls of `work` (`RankHosts.sample`) on its host, verify them here
        (where `follow` was given a verification pool), and hand them (or why it could not) to rank 0."""
        from vrl.optim.grpo_dist import sample_calls, send_share

        send_share(self.group, sample_calls(self.host, work[self.group.rank], self._verification))

    def follow(self, verification: Any = None) -> None:
        """A rank > 0: do what rank 0's GRPO does (tell, save, load, sample and verify its share) until it
        closes the run."""
        if self.group is None:
            raise RuntimeError("GRPO.follow runs on ranks > 0 of a torchrun launch")
        self._verification = verification

        def run(command: str, *args: Any) -> None:
            try:
                getattr(self, command)(*args)
            except CheckpointRefused:
                pass  # rank 0 says so (one line) and stops or goes on; it leads what happens next

        self.group.serve(run)

    def stop_followers(self) -> None:
        """Rank 0: end the other ranks' `follow` (once; nothing on one process)."""
        if self.group is not None:
            self.group.stop()

    def close(self) -> None:
        """The run is over, on every rank: finish the checkpoint being written, release the other ranks
        (rank 0), then the process group."""
        writer = getattr(self, "_writer", None)
        try:
            if writer is not None:
                writer.close()
        finally:
            if self.group is not None:
                self.stop_followers()
                group, self.group = self.group, None
                group.close()

    def _pad_fraction(self, batches: list[MicroBatch]) -> float:
        """Padding's share of the padded layout of this batch's micro-batches (over every rank)."""
        real = [b for b in batches if not b.filler]
        s = {"slots": float(sum(b.packed.slots for b in real)), "tokens": float(sum(b.packed.tokens for b in real))}
        if self.group is not None:
            s = self.group.sum(s)
        return 1.0 - s["tokens"] / s["slots"] if s["slots"] else 0.0

    def _micro_batch(self, results: list[Result], rows: list[int], advantages: torch.Tensor,
                     truncated: list[bool]) -> MicroBatch:
        import torch

        from vrl.optim.logprobs import pack

        comps = [results[i].completion for i in rows]
        packed = pack([c.prompt_token_ids for c in comps], [c.token_ids for c in comps], self.pad_id, self.device,
                      padding_free=self.config.padding_free)
        mask = packed.completion_mask.clone()
        if any(c.token_mask is not None for c in comps):
            # Episodes: the environment's tokens (feedback, tool results) leave the loss, the KL, the entropy
            # mask and every loss_type's token count, as TRL multiplies its completion mask by the tool mask.
            mask = mask * _token_masks(comps, mask)
        model_mask = mask.clone() if any(c.token_mask is not None for c in comps) else None
        if self.config.mask_truncated_completions:
            keep = torch.tensor([not truncated[i] for i in rows], dtype=mask.dtype, device=mask.device)
            mask = mask * keep.unsqueeze(1)
        sampled = None
        if all(c.logprobs is not None for c in comps):
            sampled = torch.zeros_like(mask)
            for row, c in enumerate(comps):
                sampled[row, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
        return MicroBatch(packed=packed, mask=mask, advantages=advantages[rows].to(self.device),
                          old_logps=None, from_sampler=sampled is not None, sampling_logps=sampled,
                          model_mask=model_mask)

    def _logprobs_no_grad(self, model, packed: Packed) -> torch.Tensor:
        import torch

        from vrl.optim.logprobs import completion_logprobs

        with torch.no_grad():
            return completion_logprobs(model, packed, self.temperature, self.config.logprob_chunk_size,
                                       repetition_penalty=self.repetition_penalty)

    def _fill_reference_and_old(self, batches: list[MicroBatch], results: list[Result]) -> None:
        """Reference log-probs (beta > 0) and sampling-policy log-probs (num_iterations > 1), once per batch."""
        cfg = self.config
        if any(b.from_sampler for b in batches) and not all(b.from_sampler for b in batches):
            log.warning("only some completions carry sampling log-probs; ignoring them (no sampling correction this batch)")
            for b in batches:
                b.sampling_logps, b.from_sampler = None, False
        self.model.eval()
        for b in batches:
            if cfg.beta > 0:
                if self.peft_model is not None:
                    with self.peft_model.disable_adapter():
                        b.ref_logps = self._logprobs_no_grad(self.model, b.packed)
                else:
                    b.ref_logps = self._logprobs_no_grad(self.ref_model, b.packed)
            # With one step per batch the policy *is* the sampling policy, so ρ = 1 exactly
            # (old = current log-probs, detached); later steps need the stored values.
            if b.old_logps is None and cfg.num_iterations > 1:
                b.old_logps = self._logprobs_no_grad(self.model, b.packed)

    def _accumulate(self, batches: list[MicroBatch], num_sequences: int, num_tokens: float
                    ) -> tuple[float, dict[str, float]]:
        """Forward and backward every micro-batch; gradients sum to those of the whole-batch loss."""
        import torch

        from vrl.optim.logprobs import completion_logprobs

        cfg = self.config
        total_loss = torch.zeros((), device=self.device)
        stats_sum: dict[str, torch.Tensor] = {}
        # The coefficient is fixed for the step; adaptive control applies it only while the last step's
        # entropy was at or below the target (TRL's gating), and moves it after the step (`_adapt_entropy`).
        entropy_coef = self.entropy_coef
        if cfg.use_adaptive_entropy and self._last_entropy > cfg.entropy_target:
            entropy_coef = 0.0
        num_micro_batches = len(batches) * (self.group.world if self.group else 1)
        compiled = cfg.compile and cfg.compile_backend  # the head's chunks through torch.compile, or not
        self.model.train()
        cuda = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=cuda):
                # Dropout (LoRA) masks are a pure function of (seed, step): resume replays them.
                torch.manual_seed((self.seed * 1_000_003 + self.step) % (2**63))
                for b in batches:
                    entropies = entropy_mask = None
                    router: list[torch.Tensor] | None = [] if self.router_aux_loss_coef else None
                    if cfg.top_entropy_quantile < 1.0 or self._entropy_bonus:
                        logps, entropies = completion_logprobs(self.model, b.packed, self.temperature,
                                                               cfg.logprob_chunk_size, entropy=True,
                                                               compiled=compiled,
                                                               repetition_penalty=self.repetition_penalty,
                                                               entropy_grad=self._entropy_bonus, router_loss=router)
                        if cfg.top_entropy_quantile < 1.0:
                            entropy_mask = high_entropy_mask(entropies, b.mask, cfg.top_entropy_quantile)
                    else:
                        logps = completion_logprobs(self.model, b.packed, self.temperature, cfg.logprob_chunk_size,
                                                    compiled=compiled, repetition_penalty=self.repetition_penalty,
                                                    router_loss=router)
                    old = logps.detach() if b.old_logps is None else b.old_logps
                    if b.from_sampler and b.sampling_gap is None:
                        # First step: π_old is the trainer's view of the policy that sampled, so any gap
                        # is the sampler's numerics (or weights it had not been synced to yet).
                        completion = b.packed.completion_mask if b.model_mask is None else b.model_mask
                        d = torch.where(completion.bool(), old - b.sampling_logps, 0.0)
                        b.sampling_gap = SamplingGap(d.abs().sum(), d.abs().max(), completion.sum(),
                                                     (torch.exp(d) - d - 1).sum())
                        if cfg.vllm_importance_sampling_correction:
                            b.sampling_weight = sampling_correction(
                                old, b.sampling_logps, b.mask, cfg.vllm_importance_sampling_mode,
                                cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max)
                    sequence_mask = None
                    if cfg.off_policy_mask_threshold is not None:  # against the sampler's log-probs where reported
                        sequence_mask = off_policy_mask(b.advantages, logps, b.sampling_logps if b.from_sampler
                                                        else old, b.mask, cfg.off_policy_mask_threshold)
                    loss, stats = grpo_loss(
                        logps, old, b.advantages, b.mask,
                        loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                        beta=cfg.beta, ref_logps=b.ref_logps, use_bias_correction_kl=cfg.use_bias_correction_kl,
                        num_sequences=num_sequences, num_tokens=num_tokens,
                        max_completion_length=self.max_completion_length, num_micro_batches=num_micro_batches,
                        importance_sampling_level=cfg.importance_sampling_level, delta=cfg.delta,
                        sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
                        vespo_params=(cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg),
                        sampling_weight=b.sampling_weight, entropy_mask=entropy_mask, sequence_mask=sequence_mask,
                        entropies=entropies if self._entropy_bonus else None, entropy_coef=entropy_coef,
                    )
                    if entropies is not None:
                        stats["entropy_sum"] = torch.where(b.mask.bool(), entropies, 0.0).sum().detach()
                    if sequence_mask is not None:
                        stats["off_policy_masked"] = (1 - sequence_mask).sum().detach()
                    if router:  # the MoE load-balancing loss: its micro-batch mean, over micro-batches (TRL's)
                        loss = loss + self.router_aux_loss_coef * router[0] / num_micro_batches
                        stats["aux_loss_sum"] = router[0].detach()
                    loss.backward()
                    self._move_grads_to_master()
                    # Summed on the device: one host sync per step, not per micro-batch.
                    total_loss += loss.detach()
                    for key, value in stats.items():
                        stats_sum[key] = stats_sum[key] + value if key in stats_sum else value
        finally:
            self.model.eval()
        return float(total_loss), {key: float(value) for key, value in stats_sum.items()}

    def _adapt_entropy(self, entropy_sum: float, tokens: float) -> None:
        """Adaptive entropy control after a step (TRL's): the step's mean entropy over the bonus's tokens (all
        ranks) moves the coefficient up by entropy_coef_delta when at or below entropy_target, else down."""
        cfg = self.config
        entropy = entropy_sum / max(tokens, 1.0)  # `stats` were summed over the ranks already
        if entropy <= cfg.entropy_target:
            self.entropy_coef = min(self.entropy_coef + cfg.entropy_coef_delta, cfg.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - cfg.entropy_coef_delta, cfg.entropy_coef_min)
        self._last_entropy = entropy

    def _move_grads_to_master(self) -> None:
        """Gradients the hooks did not move (none, normally: a safety net for exotic autograd paths)."""
        if self.master is self.params:
            return
        for p, m in zip(self.params, self.master):
            if p.grad is not None:
                _into_master(m)(p)

    def _apply_step(self) -> float:
        """Clip, step AdamW and the schedule, write fp32 masters back to the model; returns the gradient norm."""
        import torch

        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.master, max_norm)
        if self.group is not None:
            from vrl.optim.grpo_dist import full

            norm = full(norm)  # the global norm over every rank's shards
        norm = float(norm)
        self.optim.step()
        self.scheduler.step()
        self.optim.zero_grad(set_to_none=True)
        if self.master is not self.params:
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)
        self.step += 1
        if self.config.sync_ref_model and self.ref_model is not None and self.step % self.config.ref_model_sync_steps == 0:
            alpha = self.config.ref_model_mixup_alpha
            with torch.no_grad():  # π_ref ← α·π_θ + (1 − α)·π_ref, parameter by parameter (TRL's SyncRefModelCallback)
                for ref, p in zip(self.ref_model.parameters(), self.model.parameters(), strict=True):
                    ref.mul_(1.0 - alpha).add_(p.detach().to(ref.dtype), alpha=alpha)
        return norm

    # checkpoints ---------------------------------------------------------------------------------
    def _checkpoint_dir(self, run_dir: Path, iteration: int) -> Path:
        return Path(run_dir) / "grpo" / f"iter-{iteration:06d}"

    @staticmethod
    def _checkpoints(run_dir: Path) -> list[Path]:
        """The run's complete checkpoints, oldest first (`iter-NNNNNN`; a `.tmp` one is still being written)."""
        return complete(Path(run_dir) / "grpo")

    @classmethod
    def _newest_policy(cls, run_dir: Path, finished: int) -> tuple[int, Path] | None:
        """The newest policy folder at or before iteration `finished` (what `export` reads): a whole
        checkpoint's `policy/`, or a policy written alone after the last iteration (`save_last`)."""
        found = [(int(p.name.removeprefix("iter-")), p / "policy") for p in cls._checkpoints(run_dir)]
        found += [(int(p.name.removeprefix(POLICY_PREFIX)), p) for p in complete(Path(run_dir) / "grpo", POLICY_PREFIX)]
        found = [f for f in found if f[0] <= finished]
        return max(found, key=lambda f: f[0]) if found else None

    @classmethod
    def _newest_checkpoint(cls, run_dir: Path, finished: int) -> Path | None:
        """The newest checkpoint at or before iteration `finished` (what a resume loads), or None."""
        usable = [p for p in cls._checkpoints(run_dir) if int(p.name.removeprefix("iter-")) <= finished]
        return usable[-1] if usable else None

    def save(self, run_dir: Path, final: bool = False) -> None:
        """Write grpo/iter-NNNNNN/ when one is due: the policy (a Hugging Face folder), `train/` (fp32 masters
        and AdamW state, a `torch.distributed.checkpoint` folder any number of ranks loads) and `state.pt`
        (step, schedule, RNG, config).

        Due every `save_every` iterations, once `save_interval_s` have passed since the last, on `final`
        (the run stops here), and after the run's last iteration, where `save_last` may write the policy
        alone (grpo/policy-NNNNNN/) instead. The loop waits only for the state to be copied to host
        memory; the files are written in the background (`async_save`) under a temporary name and renamed
        when complete, and `keep_checkpoints` are kept, so a crash at any point leaves the newest complete
        checkpoint. A checkpoint the disk cannot hold is refused (`CheckpointRefused`, or a warning with
        `on_disk_full=continue`), keeping the last good one.
        """
        import torch

        from vrl.optim import checkpoints as ckpts

        cfg, group = self.config, self.group
        if group is not None and group.leader:
            group.send("save", run_dir, final)
        due = self._saved != self.iteration and (final or self._cadence.due(self.iteration))
        if final and self._refused == self.iteration:
            due = False  # refused already, with its line
        if group is not None:
            due = group.share(due)  # rank 0's clock decides
        if not due:
            return  # `load` falls back to the last checkpoint and the trainer redoes the rest
        leader = group is None or group.leader
        failed = self._finish_previous()  # one checkpoint in flight: host memory holds at most one snapshot
        if failed is not None:
            if leader and self._writing is not None:  # what the failed write left
                shutil.rmtree(self._writing, ignore_errors=True)
            kept = self._checkpoints(run_dir)
            line = (f"writing the checkpoint of iteration {self._written} failed ({failed}); "
                    f"{f'the last good one, {kept[-1].name}, is kept' if kept else 'there is no earlier checkpoint'}")
            if cfg.on_disk_full == "stop":
                self._refused = self.iteration
                raise CheckpointRefused(f"{line}; the run stops (grpo.on_disk_full=stop)")
            if leader:
                log.warning("%s; the run goes on (grpo.on_disk_full=continue)", line)
        train = self._train_state()
        needed = _bytes(t for d in (train["model"], *train["optim"].values()) for t in d.values())
        if group is not None and self.peft_model is None:  # (a LoRA adapter is whole on every rank)
            needed = int(group.sum({"bytes": float(needed)})["bytes"])
        whole = final or self._cadence.regular(self.iteration) or cfg.save_last == "full" or (
            cfg.save_last == "auto" and needed <= AUTO_FULL_BYTES)
        if group is not None:
            whole = group.share(whole)
        if not whole:
            self._save_policy(run_dir, leader)
            return
        target = self._checkpoint_dir(run_dir, self.iteration)
        tmp = target.with_name(target.name + TMP_SUFFIX)
        reason = None
        if leader:
            needed += self._policy_bytes()
            reason = check_room(target.parent, needed, cfg.keep_checkpoints, probe=ckpts.free_bytes)
            if reason is None:
                tmp.mkdir(parents=True)
        if group is not None:
            reason = group.share(reason)
        if reason is not None:
            self._refuse(reason, leader)
            return
        import torch.distributed.checkpoint as dcp

        # Copied to host memory now (DCP's default stager); written by DCP's own thread.
        with _one_process_dcp(group is None):
            upload = dcp.async_save(train, checkpoint_id=str(tmp / "train"), no_dist=group is None,
                                    process_group=None if group is None else group.checkpoints)
        upload = getattr(upload, "upload_completion", upload)
        write_policy = self._snapshot_policy(tmp / "policy", leader)
        state = {
            "iteration": self.iteration,
            "step": self.step,
            "world_size": 1 if group is None else group.world,
            "config": cfg.model_dump(mode="json"),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optim.param_groups],
            "optimizer_fields": sorted({k for st in train["optim"].values() for k in st}),
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "entropy_coef": self.entropy_coef,
            "last_entropy": self._last_entropy,
        }
        keep = cfg.keep_checkpoints

        def write() -> None:
            upload.result()  # on rank 0: every rank's shards and the metadata are written
            if leader:
                write_policy()
                torch.save(state, tmp / "state.pt")
                finish(tmp, target, keep)

        self._write(write, tmp, background=cfg.async_save and not final)
        self._saved = self.iteration
        self._cadence.done()

    def _save_policy(self, run_dir: Path, leader: bool) -> None:
        """The run's last iteration under `save_last`: write grpo/policy-NNNNNN/ (the policy's Hugging Face
        folder, or the LoRA adapter's) from rank 0, in the background; the newest one is kept."""
        from vrl.optim import checkpoints as ckpts

        target = Path(run_dir) / "grpo" / f"{POLICY_PREFIX}{self.iteration:06d}"
        tmp = target.with_name(target.name + TMP_SUFFIX)
        reason = None
        if leader:
            reason = check_room(target.parent, self._policy_bytes(), 1, probe=ckpts.free_bytes,
                                prefix=POLICY_PREFIX)
        if self.group is not None:
            reason = self.group.share(reason)
        if reason is not None:
            self._refuse(reason, leader)
            return
        write_policy = self._snapshot_policy(tmp, leader)  # every rank: the weights are gathered from the shards
        if not leader:
            return

        def write() -> None:
            write_policy()
            finish(tmp, target, 1, prefix=POLICY_PREFIX)

        self._write(write, tmp, background=self.config.async_save)

    def _write(self, write: Callable[[], None], tmp: Path, background: bool) -> None:
        self._writing, self._written = tmp, self.iteration
        if background:
            self._writer.submit(write)
        else:
            write()

    def _refuse(self, reason: str, leader: bool) -> None:
        """The checkpoint of this iteration does not fit: stop the run, or warn once (rank 0) and go on."""
        self._refused = self.iteration
        if self.config.on_disk_full == "stop":
            raise CheckpointRefused(f"{reason}; the run stops (grpo.on_disk_full=stop)")
        if leader:  # one line, from rank 0
            log.warning("%s; the run goes on (grpo.on_disk_full=continue)", reason)

    def _finish_previous(self) -> str | None:
        """Wait for the checkpoint being written; None when it (on every rank) completed, else why not."""
        try:
            self._writer.wait()
            error = None
        except Exception as exc:  # the disk filled after the check, a file system went away, ...
            error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        if self.group is not None and self.group.sum({"failed": float(error is not None)})["failed"]:
            error = error or "another rank could not write its shard"
        return error

    def _train_state(self) -> dict[str, Any]:
        """The fp32 masters and AdamW state by parameter name (DTensor shards on several ranks)."""
        optim = {}
        for name, m in zip(self.param_names, self.master):
            st = self.optim.state.get(m)
            if st:
                optim[name] = dict(st)
        state = {"model": dict(zip(self.param_names, self.master)), "optim": optim}
        if self.config.sync_ref_model and self.ref_model is not None:  # the reference moves: it is state too
            state["ref"] = dict(self.ref_model.named_parameters())
        return state

    def _policy_bytes(self) -> int:
        """Bytes of the policy folder's tensors: the adapter (LoRA) or the whole model, each tensor once
        (tied weights once; on several ranks from the shards' whole shapes)."""
        if self.peft_model is not None:
            return _bytes(self.params)
        if self.group is not None:  # from the shards' whole shapes, in the sampling copy's dtypes
            return (sum(p.numel() * self._host_dtypes[n].itemsize for n, p in self.model.named_parameters())
                    + sum(b.numel() * b.element_size() for b in self._policy_buffers.values()))
        from vrl.optim.grpo_dist import persistent_buffers

        model = self.host_model
        return sum(t.numel() * t.element_size() for t in [*model.parameters(), *persistent_buffers(model).values()])

    def _snapshot_policy(self, folder: Path, leader: bool = True) -> Callable[[], None] | None:
        """Copy the policy to host memory now; return the function that writes its folder later (rank 0;
        None elsewhere). On several ranks every rank takes part: the whole weights are gathered bucket
        by bucket from the shards, and rank 0 keeps a host copy of each.

        LoRA adapters are megabytes: peft writes them now. A whole model is copied (tied tensors once)
        and written as one safetensors file with its config and tokenizer, as `save_pretrained` lays it out.
        """
        model = self.host_model
        if leader:
            folder.mkdir(parents=True)
            with _quiet_transformers():
                self.tokenizer.save_pretrained(folder)
                if self.peft_model is not None:
                    self.peft_model.save_pretrained(folder)
                    return lambda: None
                model.config.save_pretrained(folder)
                if getattr(model, "generation_config", None) is not None and model.can_generate():
                    model.generation_config.save_pretrained(folder)
        snapshot = {}
        if self.group is not None and self.peft_model is None:
            from vrl.optim.grpo_dist import gathered

            for bucket in gathered(self.model, self._host_dtypes):
                if leader:
                    snapshot.update((name, t.to("cpu", copy=True).contiguous()) for name, t in bucket)
            snapshot.update(self._policy_buffers)
        elif leader:
            copies: dict[int, torch.Tensor] = {}
            for name, t in model.state_dict().items():
                if t.data_ptr() in copies:
                    continue  # a tied weight (e.g. lm_head = embeddings): loaders re-tie it
                copies[t.data_ptr()] = snapshot[name] = t.detach().to("cpu", copy=True).contiguous()
        if not leader:
            return None

        def write() -> None:
            from safetensors.torch import save_file

            save_file(snapshot, str(folder / "model.safetensors"), metadata={"format": "pt"})

        return write

    def load(self, run_dir: Path, completed: int) -> None:
        """Resume from the newest checkpoint at or before the run's last finished iteration (`completed`).

        With `save_every` > 1 that may be older than the run, and a run that ended on its policy alone
        (`save_last`) may have none (then nothing loads: iteration 0). `self.iteration` says where the
        weights are, and the trainer redoes the iterations after it. A checkpoint written by any number
        of ranks loads on any number of ranks (one process included).
        """
        group = self.group
        if group is not None and group.leader:
            group.send("load", run_dir, completed)
        ckpt = self._newest_checkpoint(run_dir, completed)
        # The run ended on its policy alone (save_last) with no whole checkpoint before it: start over from
        # the state a new run starts with; the trainer redoes every iteration, seeded as the first time.
        over = ckpt is None and self._newest_policy(run_dir, completed) is not None
        if group is not None:
            ckpt, over = group.share((ckpt, over))  # the file system may lag on other nodes: rank 0's choice
        if over:
            return
        if ckpt is None:
            found = [p.name for p in self._checkpoints(run_dir)]
            raise FileNotFoundError(
                f"no GRPO checkpoint at or before iteration {completed} in {Path(run_dir) / 'grpo'} "
                f"(found: {found or 'none'}); the run directory is incomplete, start a new run"
            )
        import torch

        state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)
        saved = state["config"]
        # Checkpoints from before grpo.use_bias_correction_kl existed trained with the plain k3 term.
        saved.setdefault("use_bias_correction_kl", False)
        keys = ("use_peft",) + LORA_FIELDS + (("use_bias_correction_kl",) if self.config.beta > 0 else ())
        for key in keys:
            if saved.get(key) != getattr(self.config, key):
                raise ValueError(f"checkpoint {ckpt} was trained with grpo.{key}={saved.get(key)!r}, "
                                 f"the config says {getattr(self.config, key)!r}; resume with the recorded config")
        if (ckpt / "train").is_dir():
            self._load_train_state(ckpt / "train", state)
        else:  # written before sharded checkpoints (one process): masters and AdamW state in state.pt
            if group is not None:
                raise ValueError(f"checkpoint {ckpt} predates sharded checkpoints; resume it on one process")
            self._load_policy(ckpt / "policy")
            if state["master"] is not None:
                with torch.no_grad():
                    for m, saved_m in zip(self.master, state["master"]):
                        m.copy_(saved_m)
            self.optim.load_state_dict(state["optimizer"])
        if self.master is not self.params:
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        self._iteration, self.step = state["iteration"], state["step"]
        self.entropy_coef = state.get("entropy_coef", self.config.entropy_coef)
        self._last_entropy = state.get("last_entropy", math.inf)
        self._saved = self._iteration  # that checkpoint exists: on stopping now, nothing new to write
        self._publish()

    def _load_train_state(self, path: Path, state: dict[str, Any]) -> None:
        """Read `train/` into the masters and AdamW state in place (DCP reshards to this run's ranks)."""
        import torch
        import torch.distributed.checkpoint as dcp

        have = {"exp_avg", "exp_avg_sq", "step"}
        fields = state.get("optimizer_fields") or sorted(have)
        on_device = bool(self.optim.defaults.get("fused") or self.optim.defaults.get("capturable"))
        optim = {}
        with torch.no_grad():
            for name, m in zip(self.param_names, self.master):
                optim[name] = {f: (torch.zeros((), dtype=torch.float32, device=self.device if on_device else "cpu")
                                   if f == "step" else torch.zeros_like(m.detach())) for f in fields}
        train = {"model": dict(zip(self.param_names, self.master)), "optim": optim}
        if self.config.sync_ref_model and self.ref_model is not None:
            train["ref"] = dict(self.ref_model.named_parameters())
        with _one_process_dcp(self.group is None):
            dcp.load(train, checkpoint_id=str(path), no_dist=self.group is None,
                     process_group=None if self.group is None else self.group.checkpoints)
        for name, m in zip(self.param_names, self.master):
            self.optim.state[m] = optim[name]
        for group, saved in zip(self.optim.param_groups, state["param_groups"]):
            group.update(saved)

    @classmethod
    def export(cls, run_dir: Path, config: dict[str, Any], finished: int, folder: Path, load: ModelLoader
               ) -> dict[str, Any]:
        """The newest policy at or before `finished` (a whole checkpoint's or one written alone after the
        last iteration); LoRA merged into the base."""
        run_dir = Path(run_dir)
        newest = cls._newest_policy(run_dir, finished)
        if newest is None:
            raise ValueError(f"{run_dir} has no GRPO checkpoint at or before iteration {finished} in {run_dir / 'grpo'}")
        iteration, policy = newest
        if iteration < finished:
            log.warning("the newest GRPO checkpoint of %s is after iteration %d (the run finished %d): exporting it",
                        run_dir, iteration, finished)
        info = {"optimizer": cls.name, "iteration": iteration, "base_model": config["model"]}
        if not (policy / "adapter_config.json").is_file():
            # Full fine-tuning: the checkpoint is already a Hugging Face folder (save_pretrained + tokenizer).
            shutil.copytree(policy, folder, dirs_exist_ok=True)
            return {**info, "lora": False}
        try:
            from peft import PeftModel
        except ImportError as exc:
            raise ValueError("this run trained a LoRA adapter; merging it needs peft: pip install 'vrl-core[lora]'") from exc
        from vrl.weights.export import save_model

        gen = config["generator"]
        model, tokenizer = load(config["model"], gen["dtype"], gen.get("revision"))
        merged = PeftModel.from_pretrained(model, str(policy)).merge_and_unload()
        save_model(merged, tokenizer, folder)
        return {**info, "lora": True, "merged": True}

    def _load_policy(self, path: Path) -> None:
        from safetensors.torch import load_file

        if self.peft_model is not None:
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.peft_model, load_file(str(path / "adapter_model.safetensors")))
            if result.unexpected_keys:
                raise ValueError(f"adapter checkpoint {path} has unexpected keys: {result.unexpected_keys[:5]}")
            return
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {path}")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
        result = self.model.load_state_dict(weights, strict=False)
        loaded = {t.data_ptr() for name, t in self.model.state_dict().items() if name in weights}
        own = self.model.state_dict()
        # save_pretrained drops tied weights (e.g. lm_head tied to the embeddings); anything else is an error.
        missing = [k for k in result.missing_keys if own[k].data_ptr() not in loaded]
        if result.unexpected_keys or missing:
            raise ValueError(f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                             f"unexpected {result.unexpected_keys[:5]}")


def router_aux_loss_coef(model: Any, coef: float | None) -> float:
    """The weight of the model's MoE load-balancing loss in GRPO's loss (TRL's rule): `coef`, or the model config's
    when unset, 0.0 for a dense model; a non-zero `coef` on a dense model is refused in one line, as TRL does."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not hasattr(text, "output_router_logits"):  # the mark of a model that can return its router logits
        if coef:
            raise ValueError(f"grpo.router_aux_loss_coef={coef} but {type(model).__name__} is not a Mixture-of-Experts "
                             "model (no router, no load-balancing loss to weigh); leave it unset")
        return 0.0
    return float(getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef)


def cast_head_to_fp32(model: Any) -> None:
    """`cast_lm_head_to_fp32`: the output head's weights in float32, and its input cast to float32 (for sampling
    and training alike). Refused for a head tied to the input embeddings (they would change dtype too)."""
    import torch

    head = model.get_output_embeddings()
    embeddings = model.get_input_embeddings()
    if head is None or (embeddings is not None and head.weight is embeddings.weight):
        raise ValueError("grpo.cast_lm_head_to_fp32=true needs an output head not tied to the input embeddings "
                         "(tie_word_embeddings=false); set cast_lm_head_to_fp32=false for this model")
    head.float()
    if not getattr(head, "_vrl_fp32_input", False):
        head.register_forward_pre_hook(lambda module, args: (args[0].to(torch.float32), *args[1:]))
        head._vrl_fp32_input = True


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No per-shard progress bar from save_pretrained after every iteration."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _one_process_dcp(alone: bool) -> Iterator[None]:
    """DCP on one process warns that it assumes one process, on every save and load: it is meant. (A
    process-wide filter: DCP's writer thread warns too, where a `catch_warnings` block does not reach.)"""
    if alone:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    yield


def _token_masks(comps: list[Any], like: torch.Tensor) -> torch.Tensor:
    """[B, C]: each completion's `token_mask` (1: a token the model sampled), right-padded like `like`."""
    import torch

    out = torch.ones_like(like)
    for row, c in enumerate(comps):
        if c.token_mask is not None:
            out[row, : len(c.token_mask)] = torch.tensor(c.token_mask, dtype=like.dtype, device=like.device)
    return out


def _bytes(tensors) -> int:
    """Bytes of `tensors` as written (a DTensor: this rank's shard)."""
    from vrl.optim.grpo_dist import local_bytes

    return local_bytes(tensors)


def _into_master(master: torch.Tensor):
    """A post-accumulate-grad hook: add the parameter's gradient into `master.grad` (fp32), free it."""

    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if master.grad is None:
            master.grad = grad.float()
        else:
            master.grad.add_(grad)  # computed in fp32, as add_(grad.float()), without the temporary
        param.grad = None

    return hook
