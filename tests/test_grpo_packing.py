"""Padding-free packing and chunked log-probs (issue 29, throughput) on real tiny Qwen2 models on CPU.

What runs here: transformers' sdpa and eager attention on CPU, which keep the samples of a
padding-free row apart by the block-diagonal causal mask transformers builds from the restarting
position ids (`masking_utils.find_packed_sequence_indices`; no mask is built by vrl). The
flash-attention varlen path (the one that saves compute on a GPU) cannot run on this machine.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vrl.generate import tiny
from vrl.optim.logprobs import completion_logprobs, pack, packing_problem

from .test_grpo import capture_grads, make_generator, make_grpo, sample_results

PROMPTS = [[5, 6, 7], [9] * 11, [3], [20, 21]]
COMPLETIONS = [[1, 2, 3, 4, 5], [8], [40, 41, 42, 43, 44, 45, 46], []]  # an empty completion too
TEMPERATURE = 0.7


def _model(attn: str, **kw) -> torch.nn.Module:
    model = tiny.build_model(**kw)
    model.config._attn_implementation = attn
    return model


def test_padding_free_layout():
    packed = pack(PROMPTS, COMPLETIONS, 256, padding_free=True)
    lengths = [len(p) + len(c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert packed.input_ids.shape == (1, sum(lengths)) and packed.attention_mask is None
    assert packed.input_ids[0].tolist() == [t for p, c in zip(PROMPTS, COMPLETIONS) for t in p + c]
    assert packed.position_ids[0].tolist() == [i for n in lengths for i in range(n)]
    # The state before each completion token predicts it.
    for k, (row, col) in enumerate(packed.completion_mask.nonzero().tolist()):
        assert packed.input_ids[0, packed.predict_index[k] + 1] == COMPLETIONS[row][col]
    padded = pack(PROMPTS, COMPLETIONS, 256)
    assert packed.slots == padded.input_ids.numel() == 4 * (11 + 7)
    assert packed.tokens == padded.attention_mask.sum() == sum(lengths)
    assert packed.pad_fraction == pytest.approx(1 - sum(lengths) / (4 * 18))
    for name in ("completion_ids", "completion_mask"):
        assert torch.equal(getattr(packed, name), getattr(padded, name))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_free_logprobs_and_gradients_equal_padded(attn):
    """fp32, tolerance 1e-5 absolute on log-probs and 1e-5 + 1e-4 relative on every parameter's gradient."""
    assert packing_problem(_model(attn)) is None
    results = {}
    for free in (False, True):
        model = _model(attn)
        packed = pack(PROMPTS, COMPLETIONS, 256, padding_free=free)
        logps = completion_logprobs(model, packed, TEMPERATURE, chunk_size=3)
        (logps * torch.linspace(-1, 1, logps.numel()).view_as(logps)).sum().backward()
        results[free] = logps.detach(), [p.grad.clone() for p in model.parameters()]
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=0)
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert results[True][0][3].abs().sum() == 0 and results[True][0][1, 1:].abs().sum() == 0  # padding is 0

    # The same row with positions counting on (no restarts) lets samples see each other: the check bites.
    model = _model(attn)
    joined = pack(PROMPTS, COMPLETIONS, 256, padding_free=True)
    joined.position_ids = torch.arange(joined.input_ids.shape[1])[None]
    with torch.no_grad():
        leaky = completion_logprobs(model, joined, TEMPERATURE)
    assert (leaky[1:] - results[False][0][1:]).abs().max() > 1e-3


def test_grpo_padding_free_gives_the_same_update(monkeypatch):
    """GRPO.tell with padding_free (and activation checkpointing): the same gradients as padded rows
    (1e-6 abs / 1e-4 rel) over two steps with a reference model, and the pad-share metric."""
    gen = make_generator()
    results = sample_results(gen)
    grads = capture_grads(monkeypatch)
    metrics = {}
    for free in (False, True):
        opt = make_grpo(make_generator(), micro_batch_size=5, logprob_chunk_size=3, loss_type="grpo",
                        padding_free=free, gradient_checkpointing=free, beta=0.04, num_iterations=2)
        metrics[free] = opt.tell(results)
    assert len(grads) == 4
    for a, b in zip(grads[0] + grads[1], grads[2] + grads[3]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert metrics[True]["grpo/loss"] == pytest.approx(metrics[False]["grpo/loss"], abs=1e-6)
    # Micro-batches of 5, 5, 2 samples, shortest first, each padded to its widest prompt and completion.
    order = sorted(results, key=lambda r: len(r.completion.prompt_token_ids) + len(r.completion.token_ids))
    slots = tokens = 0
    for s in range(0, len(order), 5):
        chunk = [r.completion for r in order[s : s + 5]]
        slots += len(chunk) * (max(len(c.prompt_token_ids) for c in chunk) + max(1, max(len(c.token_ids) for c in chunk)))
        tokens += sum(len(c.prompt_token_ids) + len(c.token_ids) for c in chunk)
    assert tokens < slots
    assert metrics[True]["grpo/pad_fraction"] == metrics[False]["grpo/pad_fraction"] == pytest.approx(1 - tokens / slots)


def test_padding_free_refused_where_samples_would_attend_to_each_other(monkeypatch):
    import transformers.masking_utils as mu

    monkeypatch.delattr(mu, "find_packed_sequence_indices")
    with pytest.raises(ValueError, match="padding_free"):
        make_grpo(make_generator(), padding_free=True)
    assert packing_problem(_model("flash_attention_2")) is None  # flash reads the boundaries itself


# -- chunked log-probs ---------------------------------------------------------------------------------
def _full_logprobs(model, prompts, comps) -> torch.Tensor:
    """The unchunked reference: the model's whole [tokens, vocab] logits, log-softmax, gather."""
    packed = pack(prompts, comps, 0)
    logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                   position_ids=packed.position_ids).logits.float() / TEMPERATURE
    width = packed.prompt_width
    lp = torch.log_softmax(logits[:, width - 1 : -1], -1).gather(-1, packed.completion_ids[..., None]).squeeze(-1)
    return lp * packed.completion_mask


@pytest.mark.parametrize("free", [False, True])
def test_chunked_logprobs_and_gradients_equal_the_full_logits(free):
    """Chunks of 2 and 5 tokens against the full-logits reference: 1e-5 abs on log-probs, 1e-5 + 1e-4 rel on grads."""
    ref_model = _model("sdpa")
    want = _full_logprobs(ref_model, PROMPTS, COMPLETIONS)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    want_grads = torch.autograd.grad((want * weights).sum(), list(ref_model.parameters()))
    for chunk in (2, 5):
        model = copy.deepcopy(ref_model)
        got = completion_logprobs(model, pack(PROMPTS, COMPLETIONS, 0, padding_free=free), TEMPERATURE, chunk_size=chunk)
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=0)
        grads = torch.autograd.grad((got * weights).sum(), list(model.parameters()))
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


class LargestTensor(TorchDispatchMode):
    """Records the size in bytes of the largest tensor any op creates (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("free", [False, True])
def test_chunked_logprobs_never_allocate_vocab_by_tokens(free):
    """A 50k vocabulary, 64 completion tokens, chunks of 8: no tensor of forward or backward reaches
    vocab × tokens × 4 bytes (the full fp32 logits), while the unchunked reference does."""
    vocab, n = 50_000, 64
    model = _model("sdpa", vocab_size=vocab, hidden_size=16, num_heads=2)
    prompts = [[1, 2, 3], [4, 5]] * 2
    comps = [[(7 * i + k) % 1000 for k in range(n // 4)] for i in range(4)]
    full = vocab * n * 4
    with LargestTensor() as seen:
        logps = completion_logprobs(model, pack(prompts, comps, 0, padding_free=free), TEMPERATURE, chunk_size=8)
        logps.sum().backward()
    assert seen.largest < full / 2, (seen.largest, full)
    assert seen.largest >= vocab * 8 * 4  # one chunk's fp32 logits: the counter sees the head's tensors
    model.zero_grad()
    with LargestTensor() as seen:
        _full_logprobs(model, prompts, comps).sum().backward()
    assert seen.largest >= full
