"""Per-token log-probabilities of sampled completions under a causal LM, computed in chunks.

The batch layout is the one generation used: prompts left-padded, completions right-padded, and
position ids counted from each row's first real token, so a row's log-probs do not depend on what
it is batched with. Only completion positions go through the output head, a chunk of rows at a
time (checkpointed when gradients are needed), so the full [batch, length, vocab] logits tensor
never exists: for a 152k vocabulary that tensor alone is 2.5 GB per 8 × 1024 tokens in bf16.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint


@dataclass
class Packed:
    """Prompt + completion token ids of several samples as padded tensors."""

    input_ids: torch.Tensor  # [B, P + C]
    attention_mask: torch.Tensor  # [B, P + C]
    position_ids: torch.Tensor  # [B, P + C]
    completion_ids: torch.Tensor  # [B, C]
    completion_mask: torch.Tensor  # [B, C], 1 for real completion tokens
    prompt_width: int  # P


def pack(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu"
) -> Packed:
    """Lay samples out as [left-padded prompt | right-padded completion] rows."""
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
    attention_mask = torch.tensor(masks, dtype=torch.long, device=device)
    return Packed(
        input_ids=torch.tensor(rows, dtype=torch.long, device=device),
        attention_mask=attention_mask,
        # Generation counts positions from the first real token; so must training.
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        completion_ids=torch.tensor(comp, dtype=torch.long, device=device),
        completion_mask=torch.tensor(comp_mask, dtype=torch.float32, device=device),
        prompt_width=width_p,
    )


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
    # The hidden state at position t predicts token t + 1.
    states = hidden[:, width_p - 1 : width_p + width_c - 1]
    selected = batch.completion_mask.bool()
    rows, targets = states[selected], batch.completion_ids[selected]
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
