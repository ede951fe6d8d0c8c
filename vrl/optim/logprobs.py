"""Per-token log-probabilities of sampled completions under a causal LM, computed in chunks.

The batch layout is the one generation used: prompts left-padded, completions right-padded, and
position ids counted from each row's first real token, so a row's log-probs do not depend on what
it is batched with. Only completion positions go through the output head, a chunk of rows at a
time (checkpointed when gradients are needed), so the full [batch, length, vocab] logits tensor
never exists: for a 152k vocabulary that tensor alone is 2.5 GB per 8 × 1024 tokens in bf16.

`pack(..., padding_free=True)` lays the samples out instead as one row with no padding at all, each
sample's prompt and completion after the previous sample's, position ids restarting at 0 for each
sample and no attention mask: the layout of transformers' `DataCollatorWithFlattening` (TRL's
`padding_free=True`). transformers keeps the samples apart from the position ids: flash-attention
2/3 take them as varlen sequences (`cu_seqlens`), while sdpa, eager and flex get a block-diagonal
causal mask built from the restarts (`masking_utils.find_packed_sequence_indices`). Only the
flash-attention kernels turn that into saved compute; under sdpa the block-diagonal mask spans the
whole row. The log-probs are the padded layout's (tests/test_grpo_packing.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint


@dataclass
class Packed:
    """Prompt + completion token ids of several samples: padded rows, or one padding-free row.

    `completion_ids` and `completion_mask` are [B, C] (right-padded) in both layouts, and so are the
    log-probs `completion_logprobs` returns: only what goes through the model differs.
    """

    input_ids: torch.Tensor  # [B, P + C], or [1, N] padding-free (N = the real tokens)
    attention_mask: torch.Tensor | None  # [B, P + C]; None padding-free (the position ids separate the samples)
    position_ids: torch.Tensor  # [B, P + C], or [1, N] restarting at 0 for each sample
    completion_ids: torch.Tensor  # [B, C]
    completion_mask: torch.Tensor  # [B, C], 1 for real completion tokens
    prompt_width: int  # P (of the padded layout)
    # Padding-free: for each real completion token (row-major over completion_mask), the position in
    # the row of the hidden state that predicts it. None in the padded layout.
    predict_index: torch.Tensor | None = None
    slots: int = 0  # positions of the padded layout, B × (P + C)
    tokens: int = 0  # real (prompt + completion) tokens

    @property
    def pad_fraction(self) -> float:
        """Share of the padded layout's positions that are padding (what `padding_free` does not compute)."""
        return 1.0 - self.tokens / self.slots if self.slots else 0.0


def pack(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu",
    padding_free: bool = False,
) -> Packed:
    """Lay samples out as [left-padded prompt | right-padded completion] rows, or (`padding_free`) as
    one row of the samples' tokens back to back, position ids restarting for each sample."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"pack needs as many prompts as completions (got {len(prompts)} and {len(completions)})")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token: the first completion token is predicted from it")
    width_p = max(len(p) for p in prompts)
    width_c = max(1, max(len(c) for c in completions))
    rows, masks, comp, comp_mask = [], [], [], []
    for p, c in zip(prompts, completions):
        lead, tail = width_p - len(p), width_c - len(c)
        rows.append([pad_id] * lead + list(p) + list(c) + [pad_id] * tail)
        masks.append([0] * lead + [1] * (len(p) + len(c)) + [0] * tail)
        comp.append(list(c) + [pad_id] * tail)
        comp_mask.append([1] * len(c) + [0] * tail)
    slots = len(prompts) * (width_p + width_c)
    tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    if padding_free:
        ids: list[int] = []
        positions: list[int] = []
        predict: list[int] = []
        for p, c in zip(prompts, completions):
            start = len(ids)
            ids += list(p) + list(c)
            positions += range(len(p) + len(c))
            # The state at the position before each completion token predicts it.
            predict += range(start + len(p) - 1, start + len(p) + len(c) - 1)
        return Packed(
            input_ids=torch.tensor([ids], dtype=torch.long, device=device),
            attention_mask=None,
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            completion_ids=torch.tensor(comp, dtype=torch.long, device=device),
            completion_mask=torch.tensor(comp_mask, dtype=torch.float32, device=device),
            prompt_width=width_p,
            predict_index=torch.tensor(predict, dtype=torch.long, device=device),
            slots=slots,
            tokens=tokens,
        )
    attention_mask = torch.tensor(masks, dtype=torch.long, device=device)
    return Packed(
        input_ids=torch.tensor(rows, dtype=torch.long, device=device),
        attention_mask=attention_mask,
        # Generation counts positions from the first real token; so must training.
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        completion_ids=torch.tensor(comp, dtype=torch.long, device=device),
        completion_mask=torch.tensor(comp_mask, dtype=torch.float32, device=device),
        prompt_width=width_p,
        slots=slots,
        tokens=tokens,
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
    entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    # log p(target) = logit(target) - logsumexp(logits): no [rows, vocab] log-softmax tensor is kept.
    lse = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not entropy:
        return logps
    with torch.no_grad():  # H = logsumexp(z) − Σ softmax(z)·z; a statistic, no gradient
        z = logits.detach()
        h = lse.detach() - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logps, h


def completion_logprobs(
    model: torch.nn.Module, batch: Packed, temperature: float = 1.0, chunk_size: int = 2048, entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log π(token | prefix) for every completion token, as float32 [B, C] (0 at padding).

    Logits are divided by the sampling temperature first, so these are the log-probs of the
    distribution the tokens were sampled from (as TRL does; top-p is not modelled). With `entropy`,
    also the entropy of that distribution at each completion position, [B, C] (0 at padding),
    detached, computed in the same chunks (GRPO's `top_entropy_quantile`).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs (got {temperature})")
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    hidden = decoder(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).last_hidden_state
    width_p, width_c = batch.prompt_width, batch.completion_ids.shape[1]
    selected = batch.completion_mask.bool()
    if batch.predict_index is None:
        # The hidden state at position t predicts token t + 1.
        states = hidden[:, width_p - 1 : width_p + width_c - 1]
        rows = states[selected]
    else:
        rows = hidden[0].index_select(0, batch.predict_index)
    targets = batch.completion_ids[selected]
    pieces, entropies = [], []
    for start in range(0, rows.shape[0], chunk_size):
        args = (head, rows[start : start + chunk_size], targets[start : start + chunk_size], temperature, softcap, entropy)
        if torch.is_grad_enabled():
            # Recompute the chunk's logits in backward instead of keeping them.
            piece = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            piece = _chunk_logprobs(*args)
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
