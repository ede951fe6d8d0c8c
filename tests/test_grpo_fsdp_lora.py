"""GRPO with LoRA (`grpo.use_peft`) across 2 CPU ranks (gloo), launched with the real `torchrun`, against one process.

Under torchrun a LoRA adapter trains data-parallel (vrl.optim.grpo_dist): every rank holds the whole
frozen base and the whole adapter, starting from rank 0's bits, trains its micro-batches of the whole
batch, and the adapter's gradients are all-reduced (sum) before clipping and AdamW. Nothing is
emulated: peft injects the adapters, gloo carries the collectives, `torch.distributed.checkpoint`
writes `train/`. Only the GPUs are absent (NCCL is the same code path with another backend).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.test_grpo import capture_grads, make_generator, sample_results
from tests.test_grpo_fsdp import FIELDS, assert_same_step, load_on_one_process, run_worker
from vrl.optim.grpo import GRPO, GRPOConfig

pytest.importorskip("peft")

# No LoRA dropout: its masks are drawn per micro-batch in order, and the ranks draw theirs apart.
LORA = {**FIELDS, "use_peft": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """In one 2-rank launch (tests/grpo_fsdp_worker.py): "fresh", one GRPO LoRA step from the start, and
    "resumed", the step after a one-process LoRA run's checkpoint of iteration 1 (made here first, under
    "one"; batch seed 7). Per name: what rank 0 saw, and its run directory."""
    tmp = tmp_path_factory.mktemp("fsdp_lora")
    gen = make_generator()
    first = GRPO(GRPOConfig(**LORA), seed=0, total_iterations=10)
    first.setup(gen)
    first.tell(sample_results(gen))
    first.save(tmp / "one", final=True)
    first.close()
    return run_worker(tmp, {"fresh": LORA, "resumed": {**LORA, "_load": str(tmp / "one"), "_seed": 7}})


@pytest.fixture
def two_ranks(steps):
    """One GRPO LoRA step on 2 ranks: what rank 0 saw, and its checkpoint."""
    return steps["fresh"]


@pytest.mark.slow
def test_two_ranks_train_a_lora_adapter_as_one_process(two_ranks, monkeypatch):
    """Loss, adapter gradients and updated adapter of a 2-rank LoRA step equal the one-process step's; the
    frozen base does not move, both ranks hold the same adapter bits after the step, and rank 0's
    sampling host got the trained adapter.

    Tolerances (as for full fine-tuning in tests/test_grpo_fsdp.py): the loss and the gradient norm to
    1e-6 relative, every gradient element to 1e-6 of its tensor's largest (the ranks sum their
    micro-batches in another order); each updated weight to the bound AdamW's first step puts on that
    gradient difference, lr · min(2, ε/(|g| + ε)² · |Δg|), plus 4 fp32 ulps."""
    dist, _ = two_ranks
    assert dist["world"] == 2
    grads = capture_grads(monkeypatch)
    gen = make_generator()
    opt = GRPO(GRPOConfig(**LORA), seed=0, total_iterations=10)
    opt.setup(gen)
    metrics = opt.tell(sample_results(gen))
    weights = gen.model.state_dict()
    assert_same_step(dist, metrics, grads)
    assert [g.shape for g in dist["grads"][0]] == [p.shape for p in opt.params]  # the adapter only, whole
    assert set(dist["weights"]) == set(weights)
    base = make_generator().model.state_dict()
    for k, v in dist["weights"].items():
        if "lora_" not in k:  # the frozen base, as loaded
            assert torch.equal(v, base[k.replace(".base_layer", "")]), k
    eps, lr = 1e-8, LORA["learning_rate"]
    clip = [min(1.0, 1.0 / (m["grpo/grad_norm"] + 1e-6)) for m in (metrics, dist["metrics"])]
    for name, p, g1, g2 in zip(opt.param_names, opt.params, grads[0], dist["grads"][0]):
        key = name.removeprefix("base_model.model.")
        assert torch.equal(p.detach(), weights[key])
        g1, g2 = g1 * clip[0], g2 * clip[1]
        diff = (g1 - g2).abs()
        slope = eps / ((g1.abs() - diff).clamp(min=0) + eps) ** 2
        ulps = 4 * torch.finfo(torch.float32).eps * (weights[key].abs() + lr)
        bound = lr * torch.clamp(slope * diff, max=2.0) + ulps
        assert bool(((dist["weights"][key] - weights[key]).abs() <= bound).all()), name
    one, two = dist["replicas"]
    assert all(torch.equal(a, b) for a, b in zip(one, two))  # the ranks never drift apart
    assert dist["syncs"] == 1  # rank 0's host was handed the trained model after the step
    trained = {k: v for k, v in dist["weights"].items() if ".lora_B." in k}
    assert trained and max(float(v.abs().max()) for v in trained.values()) > 0.5 * lr  # B starts at 0: it moved


@pytest.mark.slow
def test_two_rank_lora_checkpoint_resumes_on_one_process_exactly(two_ranks):
    """The 2-rank LoRA checkpoint loads on one process to the same bits: adapter, AdamW moments, step
    counts, learning rate; its policy folder is the adapter (peft's files), holding the same weights."""
    dist, run = two_ranks
    ckpt = run / "grpo" / "iter-000001"
    assert (ckpt / "train" / ".metadata").is_file()
    gen, opt = load_on_one_process(run, LORA, dist)
    from peft import get_peft_model_state_dict

    adapter = load_file(str(ckpt / "policy" / "adapter_model.safetensors"))
    mine = get_peft_model_state_dict(opt.peft_model)
    assert set(adapter) == set(mine) and all(torch.equal(adapter[k], mine[k]) for k in adapter)
    opt.tell(sample_results(gen, seed=7))  # and it trains on from there
    assert opt.step == 2


@pytest.mark.slow
def test_a_one_process_lora_checkpoint_resumes_on_two_ranks(steps, monkeypatch):
    """The other way round: a one-process LoRA run's checkpoint loads on 2 ranks (each takes the whole
    adapter and its AdamW state from `train/`), and the next step there equals the next step of the
    checkpoint resumed on one process: loss and gradient norm to 1e-6 relative, every adapter gradient
    element to 1e-6 of its tensor's largest (the ranks sum in another order), both ranks' adapters
    identical after it. (A resume that missed the adapter would train from B = 0: gradients far apart.)"""
    dist, run = steps["resumed"]
    grads = capture_grads(monkeypatch)
    gen = make_generator()
    again = GRPO(GRPOConfig(**LORA), seed=0, total_iterations=10)
    again.setup(gen)
    again.load(run.parent / "one", 1)
    metrics = again.tell(sample_results(gen, seed=7))
    assert dist["metrics"]["grpo/loss"] == pytest.approx(metrics["grpo/loss"], rel=1e-6)
    assert dist["metrics"]["grpo/grad_norm"] == pytest.approx(metrics["grpo/grad_norm"], rel=1e-6)
    assert len(dist["grads"]) == len(grads) == 1
    for a, b in zip(dist["grads"][0], grads[0]):
        assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max())
    assert all(float(g.abs().max()) > 0 for g in grads[0])  # A's gradients too, now that B ≠ 0
    one, two = dist["replicas"]
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert (run / "grpo" / "iter-000002").is_dir()
