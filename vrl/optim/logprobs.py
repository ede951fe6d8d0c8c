"""Per-token log-probabilities of sampled completions under a causal LM, computed in chunks.

Each sample is laid out as one row, its prompt and completion back to back from position 0, rows
right-padded to the longest (`pack`). Padding only ever follows a row's real tokens, so the causal
mask alone keeps it out of every real token's attention: no attention mask is passed, and sdpa and
flash-attention run their plain causal kernels. Against the layout generation uses (prompts
left-padded, completions right-padded, each padded to its own longest), this computes fewer
positions: the batch is trained in micro-batches sorted by total length, so the rows of one
micro-batch are nearly equally long (for prompts of 256–768 and completions of 128–896 tokens, 64
samples in micro-batches of 8: 5 % padding instead of 24 %). Only completion positions go through
the output head, a chunk of tokens at a time (checkpointed when gradients are needed), so the full
[batch, length, vocab] logits tensor never exists: for a 152k vocabulary that tensor alone is
2.5 GB per 8 × 1024 tokens in bf16.

`pack(..., padding_free=True)` lays the samples out instead as one row with no padding at all, each
sample's prompt and completion after the previous sample's, position ids restarting at 0 for each
sample: the layout of transformers' `DataCollatorWithFlattening` (TRL's `padding_free=True`).
transformers keeps the samples apart from the position ids: flash-attention 2/3 take them as varlen
sequences (`cu_seqlens`), while sdpa, eager and flex get a block-diagonal causal mask built from the
restarts (`masking_utils.find_packed_sequence_indices`). Only the flash-attention kernels turn that
into saved compute; under sdpa the block-diagonal mask spans the whole row. The log-probs are the
padded layout's (tests/test_grpo_packing.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


@dataclass
class Packed:
    """Prompt + completion token ids of several samples: right-padded rows, or one padding-free row.

    `completion_ids` and `completion_mask` are [B, C] (right-padded) in both layouts, and so are the
    log-probs `completion_logprobs` returns: only what goes through the model differs.
    """

    input_ids: torch.Tensor  # [B, L] (each row: prompt, completion, padding), or [1, N] padding-free
    position_ids: torch.Tensor  # [B, L] counting from 0, or [1, N] restarting at 0 for each sample
    completion_ids: torch.Tensor  # [B, C]
    completion_mask: torch.Tensor  # [B, C], 1 for real completion tokens
    # For each real completion token (row-major over completion_mask), the position in the flattened
    # input (row × L + column) of the hidden state that predicts it.
    predict_index: torch.Tensor
    slots: int = 0  # positions of the padded layout, B × L
    tokens: int = 0  # real (prompt + completion) tokens
    attention_mask: torch.Tensor | None = None  # [B, L] or [1, N]: 1 on real tokens (what an MoE router loss averages)

    @property
    def pad_fraction(self) -> float:
        """Share of the padded layout's positions that are padding (what `padding_free` does not compute)."""
        return 1.0 - self.tokens / self.slots if self.slots else 0.0


def pack(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu",
    padding_free: bool = False,
) -> Packed:
    """Lay samples out as [prompt | completion | padding] rows, or (`padding_free`) as one row of the
    samples' tokens back to back, position ids restarting for each sample."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"pack needs as many prompts as completions (got {len(prompts)} and {len(completions)})")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token: the first completion token is predicted from it")
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    width_c = max(1, max(len(c) for c in completions))
    comp = [list(c) + [pad_id] * (width_c - len(c)) for c in completions]
    comp_mask = [[1] * len(c) + [0] * (width_c - len(c)) for c in completions]
    real: list[int] = []
    ids: list[int] = []
    positions: list[int] = []
    predict: list[int] = []
    for p, c in zip(prompts, completions):
        start = len(ids)
        ids += list(p) + list(c)
        positions += range(len(p) + len(c))
        real += [1] * (len(p) + len(c))
        # The state at the position before each completion token predicts it.
        predict += range(start + len(p) - 1, start + len(p) + len(c) - 1)
        if not padding_free:
            ids += [pad_id] * (width - len(p) - len(c))
            positions += range(len(p) + len(c), width)
            real += [0] * (width - len(p) - len(c))
    shape = (1, len(ids)) if padding_free else (len(prompts), width)
    return Packed(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device).view(shape),
        position_ids=torch.tensor(positions, dtype=torch.long, device=device).view(shape),
        completion_ids=torch.tensor(comp, dtype=torch.long, device=device),
        completion_mask=torch.tensor(comp_mask, dtype=torch.float32, device=device),
        predict_index=torch.tensor(predict, dtype=torch.long, device=device),
        slots=len(prompts) * width,
        tokens=sum(len(p) + len(c) for p, c in zip(prompts, completions)),
        attention_mask=torch.tensor(real, dtype=torch.long, device=device).view(shape),
    )


def packing_problem(model: torch.nn.Module) -> str | None:
    """Why `model` cannot take padding-free rows with these transformers, or None when it can.

    flash-attention reads the sample boundaries from the position ids in every transformers release
    vrl supports; sdpa, eager and flex need transformers' packed-sequence masks
    (`masking_utils.find_packed_sequence_indices`), without which the samples of a row would attend
    to each other.
    """
    impl = str(getattr(model.config, "_attn_implementation", None) or "")
    if "flash" in impl:
        return None
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        import transformers

        return (f"transformers {transformers.__version__} cannot keep packed samples apart under "
                f"attn_implementation={impl or 'default'} (this release has no masking_utils.find_packed_sequence_indices; upgrade transformers or use "
                "flash_attention_2), so grpo.padding_free=true cannot be used")
    return None


def _chunk_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, softcap: float | None,
    entropy: bool = False, seen: torch.Tensor | None = None, penalty: float = 1.0, entropy_grad: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    if seen is not None:  # the repetition penalty, before the temperature, as the samplers apply it
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    logits = logits / temperature
    # log p(target) = logit(target) - logsumexp(logits): no [rows, vocab] log-softmax tensor is kept.
    lse = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not entropy:
        return logps
    # H = logsumexp(z) − Σ softmax(z)·z; a statistic without gradient, unless an entropy bonus trains on it
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        z = logits if entropy_grad else logits.detach()
        h = (lse if entropy_grad else lse.detach()) - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logps, h


_compiled_chunks: dict[str, Callable[..., Any]] = {}  # backend -> `_chunk_logprobs` through torch.compile


def _chunk_function(compiled: bool | str):
    """`_chunk_logprobs`, or (`compiled`, `grpo.compile`) the same through `torch.compile`: inductor
    fuses the fp32 cast, the temperature, the log-sum-exp and the gather around the head's matrix
    multiply, so a chunk's [rows, vocab] logits are not written and read in fp32 several times over
    (`compiled`: True for inductor, or the name of a torch.compile backend, `grpo.compile_backend`)."""
    if not compiled:
        return _chunk_logprobs
    backend = "inductor" if compiled is True else compiled
    if backend not in _compiled_chunks:
        _compiled_chunks[backend] = torch.compile(_chunk_logprobs, dynamic=True, backend=backend)
    return _compiled_chunks[backend]


def completion_logprobs(
    model: torch.nn.Module, batch: Packed, temperature: float = 1.0, chunk_size: int = 2048, entropy: bool = False,
    compiled: bool | str = False, repetition_penalty: float = 1.0, entropy_grad: bool = False,
    router_loss: list[torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log π(token | prefix) for every completion token, as float32 [B, C] (0 at padding).

    Logits go through the sampler's repetition penalty (`repetition_penalty` ≠ 1: every token id
    already in the sample's prompt or completion prefix has its logit divided by it when positive,
    multiplied when negative) and are divided by the sampling temperature, so these are the
    log-probs of the distribution the tokens were sampled from (truncations, top-k, top-p, min-p,
    are not modelled, as in TRL). With `entropy`, also the entropy of that distribution at each
    completion position, [B, C] (0 at padding), computed in the same chunks (GRPO's
    `top_entropy_quantile` and entropy bonus), detached unless `entropy_grad`. `compiled`: each
    chunk's head and log-probs through `torch.compile` (`grpo.compile`; a string names the backend,
    `grpo.compile_backend`, True is inductor). `router_loss`: a list to which the
    same forward appends a Mixture-of-Experts model's load-balancing loss over the real tokens (with its
    gradient; the model's own `load_balancing_loss_func`, as its forward computes `aux_loss`).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs (got {temperature})")
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    # No attention mask: padding only follows real tokens (causal attention never reaches it), and a
    # padding-free row's samples are kept apart by its restarting position ids.
    extra = {"output_router_logits": True} if router_loss is not None else {}
    outputs = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **extra)
    hidden = outputs.last_hidden_state
    if router_loss is not None:
        import sys

        text = model.config.get_text_config()
        balance = sys.modules[type(model).__module__].load_balancing_loss_func
        router_loss.append(balance(outputs.router_logits, text.num_experts, text.num_experts_per_tok,
                                   batch.attention_mask))
    selected = batch.completion_mask.bool()
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.predict_index)
    targets = batch.completion_ids[selected]
    pieces, entropies = [], []
    chunk = _chunk_function(compiled)
    seen_of = _seen_tokens(batch, head.weight.shape[0]) if repetition_penalty != 1.0 else None
    for start in range(0, rows.shape[0], chunk_size):
        seen = seen_of(start, start + chunk_size) if seen_of is not None else None
        args = (head, rows[start : start + chunk_size], targets[start : start + chunk_size], temperature, softcap, entropy,
                seen, repetition_penalty, entropy_grad)
        if torch.is_grad_enabled():
            # Recompute the chunk's logits in backward instead of keeping them.
            piece = checkpoint(chunk, *args, use_reentrant=False)
        else:
            piece = chunk(*args)
        if entropy:
            piece, h = piece
            entropies.append(h)
        pieces.append(piece)
    out = torch.zeros(selected.shape, dtype=torch.float32, device=rows.device)
    if pieces:
        out = out.masked_scatter(selected, torch.cat(pieces))
    if not entropy:
        return out
    ent = torch.zeros(selected.shape, dtype=torch.float32, device=rows.device)
    if entropies:
        ent = ent.masked_scatter(selected, torch.cat(entropies))
    return out, ent


def _seen_tokens(batch: Packed, vocab: int):
    """For the repetition penalty: a function of a range of prediction rows (in `predict_index` order)
    giving [rows, vocab] bools, True for the token ids that occur in the row's sample at or before the
    position that predicts (its prompt and the completion tokens sampled so far)."""
    ids = batch.input_ids.reshape(-1)
    positions = batch.position_ids.reshape(-1)
    sample = torch.cumsum((positions == 0).long(), 0) - 1  # each sample (a row, or a restart) begins at position 0
    n = int(sample[-1]) + 1
    # The first position at which each token id occurs in each sample (padding comes after every prediction).
    first = torch.full((n, vocab), torch.iinfo(torch.long).max, dtype=torch.long, device=ids.device)
    flat = sample * vocab + ids
    first.view(-1).scatter_reduce_(0, flat, positions, reduce="amin")
    at = positions.index_select(0, batch.predict_index)
    of = sample.index_select(0, batch.predict_index)

    def seen(start: int, stop: int) -> torch.Tensor:
        return first.index_select(0, of[start:stop]) <= at[start:stop].unsqueeze(1)

    return seen
