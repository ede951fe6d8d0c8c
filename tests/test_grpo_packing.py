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


def test_layouts():
    """Padded: one row per sample, prompt and completion back to back from position 0, right-padded to
    the longest sample (here 11 + 1 = 12 positions, not the 11 + 7 of padding prompts and completions
    separately). Padding-free: the samples back to back in one row, positions restarting."""
    lengths = [len(p) + len(c) for p, c in zip(PROMPTS, COMPLETIONS)]
    padded = pack(PROMPTS, COMPLETIONS, 256)
    assert padded.input_ids.shape == (4, 12)
    for row, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        assert padded.input_ids[row].tolist() == p + c + [256] * (12 - len(p) - len(c))
        assert padded.position_ids[row].tolist() == list(range(12))
    packed = pack(PROMPTS, COMPLETIONS, 256, padding_free=True)
    assert packed.input_ids.shape == (1, sum(lengths))
    assert packed.input_ids[0].tolist() == [t for p, c in zip(PROMPTS, COMPLETIONS) for t in p + c]
    assert packed.position_ids[0].tolist() == [i for n in lengths for i in range(n)]
    for layout in (padded, packed):  # the state before each completion token predicts it
        flat = layout.input_ids.reshape(-1)
        for k, (row, col) in enumerate(layout.completion_mask.nonzero().tolist()):
            assert flat[layout.predict_index[k] + 1] == COMPLETIONS[row][col]
    assert packed.slots == padded.slots == 4 * 12 and packed.tokens == padded.tokens == sum(lengths)
    assert padded.pad_fraction == pytest.approx(1 - sum(lengths) / (4 * 12))
    for name in ("completion_ids", "completion_mask"):
        assert torch.equal(getattr(packed, name), getattr(padded, name))


def _alone(model, prompts, comps) -> torch.Tensor:
    """The reference: each sample through the model on its own (no batch, no padding), its full logits,
    log-softmax at the temperature, gathered; [B, C] right-padded with 0 like `completion_logprobs`."""
    width = max(1, max(len(c) for c in comps))
    out = []
    for p, c in zip(prompts, comps):
        logits = model(input_ids=torch.tensor([p + c])).logits[0].float() / TEMPERATURE
        lp = torch.log_softmax(logits[len(p) - 1 : len(p) + len(c) - 1], -1).gather(-1, torch.tensor(c, dtype=torch.long)[:, None])
        out.append(torch.cat([lp[:, 0], torch.zeros(width - len(c))]))
    return torch.stack(out)


@pytest.mark.parametrize("free", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_both_layouts_give_each_sample_its_own_logprobs(attn, free):
    """Batched (either layout) against each sample alone: fp32, 1e-5 absolute on log-probs, 1e-5 + 1e-4
    relative on every parameter's gradient. Another pad id changes nothing (padding is never attended)."""
    ref = _model(attn)
    weights = torch.linspace(-1, 1, 4 * 7).view(4, 7)
    want = _alone(ref, PROMPTS, COMPLETIONS)
    want_grads = torch.autograd.grad((want * weights).sum(), list(ref.parameters()))
    model = copy.deepcopy(ref)
    got = completion_logprobs(model, pack(PROMPTS, COMPLETIONS, 256, padding_free=free), TEMPERATURE, chunk_size=3)
    torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=0)
    for a, b in zip(torch.autograd.grad((got * weights).sum(), list(model.parameters())), want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        other = completion_logprobs(model, pack(PROMPTS, COMPLETIONS, 17, padding_free=free), TEMPERATURE)
    torch.testing.assert_close(other, got.detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_restarting_positions_keep_padding_free_samples_apart(attn):
    """The padding-free row with positions counting on (no restarts) lets samples see each other: the
    restarts are what the equality above rests on."""
    assert packing_problem(_model(attn)) is None
    model = _model(attn)
    with torch.no_grad():
        apart = completion_logprobs(model, pack(PROMPTS, COMPLETIONS, 256, padding_free=True), TEMPERATURE)
        joined = pack(PROMPTS, COMPLETIONS, 256, padding_free=True)
        joined.position_ids = torch.arange(joined.input_ids.shape[1])[None]
        leaky = completion_logprobs(model, joined, TEMPERATURE)
    assert (leaky[1:] - apart[1:]).abs().max() > 1e-3
    assert apart[3].abs().sum() == 0 and apart[1, 1:].abs().sum() == 0  # padding is 0


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
    # Micro-batches of 5, 5, 2 samples, shortest first, each row padded to the micro-batch's longest sample.
    order = sorted(results, key=lambda r: len(r.completion.prompt_token_ids) + len(r.completion.token_ids))
    slots = tokens = 0
    for s in range(0, len(order), 5):
        chunk = [r.completion for r in order[s : s + 5]]
        slots += len(chunk) * max(len(c.prompt_token_ids) + len(c.token_ids) for c in chunk)
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
    """The unchunked reference: the model's whole [batch, length, vocab] logits, log-softmax, gather."""
    packed = pack(prompts, comps, 0)
    logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits.float() / TEMPERATURE
    lp = torch.log_softmax(logits, -1).reshape(-1, logits.shape[-1])[packed.predict_index]
    out = torch.zeros(packed.completion_mask.shape)
    return out.masked_scatter(packed.completion_mask.bool(),
                              lp.gather(-1, packed.completion_ids[packed.completion_mask.bool()][:, None])[:, 0])


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
