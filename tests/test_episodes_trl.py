"""GRPO with environment-token masks against TRL 1.16's own `_compute_loss` given the same `tool_mask`:
every loss type, with KL and the entropy mask, value and gradient. TRL multiplies its completion mask by
the tool mask in the loss, the KL, the entropy quantile and the token count that normalises the loss
(`num_items_in_batch`); vrl narrows the completion mask the same way (`GRPO._micro_batch`), checked here
on the micro-batch GRPO builds from episode completions, then fed to `grpo_loss`.

Skipped where trl==1.16.0 is not importable (as tests/test_grpo_trl_equality.py, whose stand-in trainer
this reuses).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_grpo_trl_equality import trl_loss
from vrl.optim.grpo import GRPO, GRPOConfig
from vrl.optim.grpo_loss import grpo_loss, high_entropy_mask
from vrl.types import Completion, Result, Task, Verdict


def _episode_masks(b: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A completion mask (right padding) and a tool mask with environment spans inside each completion."""
    lengths = torch.randint(3, n + 1, (b,), generator=gen)
    mask = (torch.arange(n)[None] < lengths[:, None]).float()
    tool = torch.ones(b, n)
    for row in range(b):
        start = int(torch.randint(1, int(lengths[row]) - 1, (), generator=gen))
        tool[row, start : start + int(torch.randint(1, 3, (), generator=gen))] = 0.0  # the environment's tokens
    return mask, tool


def test_grpo_builds_the_masks_trl_builds_from_episode_completions() -> None:
    """GRPO's micro-batch mask is TRL's `completion_mask * tool_mask` for episode completions, also with
    mask_truncated_completions (TRL masks a truncated completion's tool mask too)."""
    gen = torch.Generator().manual_seed(0)
    mask, tool = _episode_masks(4, 7, gen)
    comps, results = [], []
    for row in range(4):
        n = int(mask[row].sum())
        c = Completion(task_id="t", text="", prompt_token_ids=[1, 2], token_ids=list(range(3, 3 + n)),
                       token_mask=[int(x) for x in tool[row, :n]], finish_reason="length" if row == 1 else "stop")
        comps.append(c)
        results.append(Result(task=Task(id="t", prompt="p"), completion=c, verdict=Verdict.ok(), reward=1.0))
    grpo = GRPO(GRPOConfig(mask_truncated_completions=True))
    grpo.pad_id, grpo.device = 0, torch.device("cpu")  # what `setup` sets; no model needed to build a batch
    b = grpo._micro_batch(results, [0, 1, 2, 3], torch.zeros(4), [c.finish_reason == "length" for c in comps])
    expected = mask * tool
    expected[1] = 0.0
    assert torch.equal(b.mask, expected[:, : b.mask.shape[1]])
    assert b.mask.shape[1] == int(mask.sum(1).max())


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"])
def test_loss_and_gradient_with_environment_masks_equal_trl(loss: str) -> None:
    gen = torch.Generator().manual_seed(1)
    b, n, max_len = 6, 10, 12
    for level, beta, q in [("token", 0.0, 1.0), ("token", 0.04, 0.3), ("sequence", 0.04, 1.0)]:
        if loss == "vespo" and level == "sequence":
            continue  # TRL refuses it
        mask, tool = _episode_masks(b, n, gen)
        base = -torch.rand(b, n, generator=gen) * 3
        old = base + 0.3 * torch.randn(b, n, generator=gen)
        ref = base + 0.3 * torch.randn(b, n, generator=gen)
        adv, entropies = torch.randn(b, generator=gen), torch.rand(b, n, generator=gen) * 4
        o = {"q": q, "level": level, "beta": beta, "loss": loss, "eps_high": None, "L": max_len, "bc": False,
             "delta": None}
        theirs_lp = base.clone().requires_grad_(True)
        import tests.test_grpo_trl_equality as eq

        original = eq.grpo_trainer()._compute_loss

        def with_tool_mask(self, model, inputs, tool=tool, mask=mask, original=original):
            # TRL's inputs carry the tool mask; its token count is of both masks
            inputs = {**inputs, "tool_mask": tool, "num_items_in_batch": (mask * tool).sum()}
            return original(self, model, inputs)

        eq.grpo_trainer()._compute_loss = with_tool_mask
        try:
            theirs = trl_loss(theirs_lp, old, ref, adv, mask, entropies, None, o)
        finally:
            eq.grpo_trainer()._compute_loss = original
        theirs.backward()
        narrowed = mask * tool  # what GRPO._micro_batch hands the loss
        ours_lp = base.clone().requires_grad_(True)
        ours, _ = grpo_loss(ours_lp, old, adv, narrowed, loss_type=loss, epsilon=0.2, beta=beta, ref_logps=ref,
                            max_completion_length=max_len, importance_sampling_level=level,
                            num_tokens=float(narrowed.sum()),
                            entropy_mask=high_entropy_mask(entropies, narrowed, q) if q < 1 else None)
        ours.backward()
        assert torch.allclose(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-7), (level, beta, q)
        assert torch.allclose(ours_lp.grad, theirs_lp.grad, rtol=1e-5, atol=1e-7), (level, beta, q)
        assert float(theirs_lp.grad[tool == 0].abs().max()) == 0.0  # no gradient through environment tokens
