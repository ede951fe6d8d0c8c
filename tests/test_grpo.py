"""GRPO on a real (tiny, random-weight) Qwen2 model: log-probs, gradients, reference model,
num_iterations, masking, LoRA, mixed precision, schedules, checkpoints, and learning with the real
Trainer. Nothing is mocked; a few tests wrap a method to *observe* the tensors it receives.
"""

from __future__ import annotations

import copy
import io
import json
import math
import statistics

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from vrl.config import SamplingConfig, build
from vrl.envs.letters import TARGET, LettersEnvironment
from vrl.generate import tiny
from vrl.generate.hf import HFGenerator
from vrl.optim import grpo as grpo_mod
from vrl.optim.grpo import GRPO, GRPOConfig
from vrl.optim.logprobs import completion_logprobs, pack
from vrl.policy import WeightStream
from vrl.rundir import RunDir
from vrl.trainer import Trainer
from vrl.types import Result, Task, Verdict

TEMPERATURE = 0.9
MAX_NEW = 8


class CountingGenerator(HFGenerator):
    """The real hf generator, counting published weights."""

    syncs = 0

    def publish(self, model) -> None:
        if isinstance(model, WeightStream):  # ranks of a torchrun launch: the weights gathered from the shards
            super().publish(model)
        else:
            assert model is self.model  # GRPO trained this host's own module in place
        self.syncs += 1


def make_generator(dtype: torch.dtype = torch.float32, max_new_tokens: int = MAX_NEW) -> CountingGenerator:
    tok = tiny.build_tokenizer()
    sampling = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=max_new_tokens, batch_size=8)
    return CountingGenerator(tiny.build_model().to(dtype), tok, sampling)


def score(text: str) -> float:
    return sum(ch in TARGET for ch in text) / len(text) if text else 0.0


def sample_results(gen: HFGenerator, n_tasks: int = 3, g: int = 4, seed: int = 1) -> list[Result]:
    tasks = [Task(id=f"t{i}", prompt=f"Task {i}: letters.\n") for i in range(n_tasks)]
    out = []
    for c in gen.generate(tasks, n=g, seed=seed):
        task = next(t for t in tasks if t.id == c.task_id)
        r = score(c.text)
        out.append(Result(task=task, completion=c, verdict=Verdict.fail("failed", "toy", score=r), reward=r))
    return out


def make_grpo(gen: HFGenerator, **fields) -> GRPO:
    fields.setdefault("lr_scheduler_type", "constant")
    total = fields.pop("_total", 10)
    opt = GRPO(GRPOConfig(**fields), seed=0, total_iterations=total)
    opt.setup(gen)
    return opt


def capture_grads(monkeypatch) -> list[list[torch.Tensor]]:
    """Record the accumulated (pre-clipping) master gradients at every optimizer step."""
    seen: list[list[torch.Tensor]] = []
    original = GRPO._apply_step

    def spy(self):
        seen.append([m.grad.detach().clone() for m in self.master])
        return original(self)

    monkeypatch.setattr(GRPO, "_apply_step", spy)
    return seen


def capture_loss_inputs(monkeypatch) -> list[dict]:
    seen: list[dict] = []
    original = grpo_mod.grpo_loss

    def spy(logps, old_logps, advantages, mask, **kw):
        seen.append({"logps": logps.detach().clone(), "old": old_logps.detach().clone(), "mask": mask.clone(),
                     "advantages": advantages.clone()})
        return original(logps, old_logps, advantages, mask, **kw)

    monkeypatch.setattr(grpo_mod, "grpo_loss", spy)
    return seen


def reference_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Log-probs of one unpadded sequence from the full model's logits (no packing, no chunking)."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def advantages_by_hand(results: list[Result]) -> list[float]:
    groups: dict[str, list[float]] = {}
    for r in results:
        groups.setdefault(r.task.id, []).append(r.reward)
    return [(r.reward - statistics.fmean(groups[r.task.id])) / (statistics.stdev(groups[r.task.id]) + 1e-4)
            for r in results]


# -- log-probs ----------------------------------------------------------------------------------------
def test_logprobs_equal_generation_time_logprobs():
    """Same token ids, same positions: training log-probs are the sampler's (no re-tokenisation drift)."""
    model, tok = tiny.build_model(), tiny.build_tokenizer()
    enc = tok(["hi", "a much longer prompt"], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=10, do_sample=True, temperature=TEMPERATURE, top_k=0,
                         num_return_sequences=2, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    width = enc["input_ids"].shape[1]
    sampled = out.sequences[:, width:]
    at_sampling = torch.log_softmax(torch.stack(out.logits, 1).float() / TEMPERATURE, -1)
    at_sampling = at_sampling.gather(-1, sampled[..., None]).squeeze(-1)
    prompts = [enc["input_ids"][i // 2][enc["attention_mask"][i // 2].bool()].tolist() for i in range(4)]
    with torch.no_grad():
        ours = completion_logprobs(model, pack(prompts, sampled.tolist(), tok.pad_token_id), TEMPERATURE, chunk_size=7)
    torch.testing.assert_close(ours, at_sampling, atol=1e-5, rtol=1e-5)


def test_logprobs_do_not_depend_on_padding_or_chunks():
    model = tiny.build_model()
    prompts, comps = [[5, 6, 7], [9] * 11, [3]], [[1, 2, 3, 4, 5], [8], [40, 41, 42]]
    with torch.no_grad():
        batched = completion_logprobs(model, pack(prompts, comps, 256), 1.0, chunk_size=2)
        for i in range(3):
            alone = completion_logprobs(model, pack([prompts[i]], [comps[i]], 256), 1.0, chunk_size=1000)
            torch.testing.assert_close(batched[i, : len(comps[i])], alone[0, : len(comps[i])], atol=1e-5, rtol=1e-5)
            full = torch.log_softmax(model(input_ids=torch.tensor([prompts[i] + comps[i]])).logits[0].float(), -1)
            want = full[len(prompts[i]) - 1 : -1].gather(-1, torch.tensor(comps[i])[:, None]).squeeze(-1)
            torch.testing.assert_close(alone[0, : len(comps[i])], want, atol=1e-5, rtol=1e-5)
        assert batched[1, 1:].abs().sum() == 0  # padding positions are zero


# -- the update ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_gradient_equals_hand_computed_loss(monkeypatch, loss_type):
    """The accumulated gradient is the gradient of the loss written out per sequence (ρ = 1 on the first step)."""
    gen = make_generator()
    results = sample_results(gen)
    initial = copy.deepcopy(gen.model)
    grads = capture_grads(monkeypatch)
    make_grpo(gen, loss_type=loss_type, micro_batch_size=5, logprob_chunk_size=3, max_grad_norm=None).tell(results)

    adv = advantages_by_hand(results)
    per_seq = []
    for r, a in zip(results, adv):
        lp = reference_logps(initial, r.completion.prompt_token_ids, r.completion.token_ids)
        ratio = torch.exp(lp - lp.detach())  # 1, with the policy gradient of log π
        per_seq.append((-(ratio * a)).sum())
    lengths = [len(r.completion.token_ids) for r in results]
    if loss_type == "grpo":
        loss = sum(s / n for s, n in zip(per_seq, lengths)) / len(results)
    elif loss_type == "dapo":
        loss = sum(per_seq) / sum(lengths)
    else:
        loss = sum(per_seq) / (len(results) * MAX_NEW)
    want = torch.autograd.grad(loss, list(initial.parameters()))
    assert len(grads) == 1
    for got, ref in zip(grads[0], want):
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads[0])


def test_micro_batch_size_and_checkpointing_do_not_change_the_gradient(monkeypatch):
    results = sample_results(make_generator())
    grads = capture_grads(monkeypatch)
    for mb, ckpt in ((1, False), (12, False), (5, True)):
        opt = make_grpo(make_generator(), micro_batch_size=mb, gradient_checkpointing=ckpt, loss_type="grpo")
        on = getattr(opt.model, "is_activation_checkpointing", None)
        assert (on if on is not None else opt.model.is_gradient_checkpointing) == ckpt
        opt.tell(results)
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_step_moves_weights_and_syncs_generator():
    gen = make_generator()
    before = {k: v.clone() for k, v in gen.model.state_dict().items()}
    opt = make_grpo(gen, learning_rate=1e-3)
    metrics = opt.tell(sample_results(gen))
    assert gen.syncs == 1
    assert any(not torch.equal(before[k], v) for k, v in gen.model.state_dict().items())
    assert metrics["grpo/learning_rate"] == pytest.approx(1e-3)
    assert metrics["grpo/grad_norm"] > 0 and opt.ref_model is None  # beta = 0 loads no reference model
    assert opt.ask()[0].samples_per_task == 8


def test_reference_model_gets_no_gradient(monkeypatch):
    gen = make_generator()
    initial = {k: v.clone() for k, v in gen.model.state_dict().items()}
    opt = make_grpo(gen, beta=0.1, learning_rate=1e-2)
    first = opt.tell(sample_results(gen, seed=1))
    second = opt.tell(sample_results(gen, seed=2))
    assert first["grpo/kl"] == 0.0  # policy == reference before the first step
    assert second["grpo/kl"] > 0.0
    for p in opt.ref_model.parameters():
        assert not p.requires_grad and p.grad is None
    for k, v in opt.ref_model.state_dict().items():
        assert torch.equal(v, initial[k])
    assert any(not torch.equal(v, initial[k]) for k, v in gen.model.state_dict().items())


def test_bias_correction_kl_setting_reaches_the_update(monkeypatch):
    """grpo.use_bias_correction_kl changes the KL gradient once the policy has left the reference."""
    grads = {}
    for corrected in (True, False):
        gen = make_generator()
        seen = capture_grads(monkeypatch)
        opt = make_grpo(gen, beta=0.5, learning_rate=1e-2, use_bias_correction_kl=corrected)
        opt.tell(sample_results(gen, seed=1))
        opt.tell(sample_results(gen, seed=2))
        grads[corrected] = list(seen[:2])
    # Step 1: π_θ = π_ref, the KL gradient is 0 either way; step 2: β·ρ·(lp − ref) vs β·(1 − e^(ref−lp)).
    assert all(torch.equal(a, b) for a, b in zip(grads[True][0], grads[False][0]))
    assert any(not torch.allclose(a, b) for a, b in zip(grads[True][1], grads[False][1]))


def test_num_iterations_uses_stored_old_logprobs(monkeypatch):
    gen = make_generator()
    results = sample_results(gen)
    initial = copy.deepcopy(gen.model)
    seen = capture_loss_inputs(monkeypatch)
    opt = make_grpo(gen, num_iterations=3, micro_batch_size=100, learning_rate=1e-2)
    metrics = opt.tell(results)
    assert len(seen) == 3 and opt.step == 3
    order = sorted(range(len(results)), key=lambda i: len(results[i].completion.prompt_token_ids)
                   + len(results[i].completion.token_ids))
    with torch.no_grad():
        for row, i in enumerate(order):
            c = results[i].completion
            want = reference_logps(initial, c.prompt_token_ids, c.token_ids)
            for call in seen:  # the same sampling-policy log-probs at every step
                torch.testing.assert_close(call["old"][row, : len(c.token_ids)], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(seen[0]["logps"], seen[0]["old"], atol=1e-5, rtol=0)
    assert (seen[2]["logps"] - seen[2]["old"]).abs().max() > 1e-3  # the policy moved; ρ ≠ 1
    assert metrics["grpo/clip_ratio/region_mean"] >= 0.0


def test_mask_truncated_completions(monkeypatch):
    gen = make_generator(max_new_tokens=4)  # most samples hit the cap
    results = sample_results(gen, g=4)
    truncated = [r.completion.finish_reason == "length" for r in results]
    assert any(truncated)
    seen = capture_loss_inputs(monkeypatch)
    grads = capture_grads(monkeypatch)
    make_grpo(gen, micro_batch_size=100, mask_truncated_completions=True).tell(results)
    comps = sorted((r.completion for r in results), key=lambda c: len(c.prompt_token_ids) + len(c.token_ids))
    for row, c in enumerate(comps):
        assert float(seen[0]["mask"][row].sum()) == (0 if c.finish_reason == "length" else len(c.token_ids))
    # Changing what a truncated completion says does not change the update.
    altered = [r.model_copy(deep=True) for r in results]
    for r in altered:
        if r.completion.finish_reason == "length":
            r.completion.token_ids = [ord("z")] * len(r.completion.token_ids)
    make_grpo(make_generator(max_new_tokens=4), micro_batch_size=100, mask_truncated_completions=True).tell(altered)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


def test_max_grad_norm_clips_and_adamw_settings_apply(monkeypatch):
    gen = make_generator()
    opt = make_grpo(gen, max_grad_norm=1e-3, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.1)
    group = opt.optim.param_groups[0]
    assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6 and group["weight_decay"] == 0.1
    norms = []

    def observe(optimizer, args, kwargs):  # a pre-step hook: AdamW's step stays the one the schedule wrapped
        norms.append(float(torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in opt.master]))))

    opt.optim.register_step_pre_hook(observe)
    metrics = opt.tell(sample_results(gen))
    assert metrics["grpo/grad_norm"] > 1e-3  # the norm before clipping
    assert norms[0] == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_learning_rate_schedule(kind):
    opt = GRPO(GRPOConfig(lr_scheduler_type=kind, warmup_steps=2, learning_rate=1.0, num_iterations=2),
               total_iterations=5)
    total = 10  # 5 iterations × 2 steps
    for step in range(total):
        if step < 2:
            want = step / 2
        elif kind == "constant":
            want = 1.0
        else:
            progress = (step - 2) / (total - 2)
            want = 1 - progress if kind == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        assert opt.lr_factor(step) == pytest.approx(want)


def test_schedule_follows_tells():
    gen = make_generator()
    opt = make_grpo(gen, lr_scheduler_type="linear", learning_rate=1e-3, _total=4)
    lrs = [opt.tell(sample_results(gen, n_tasks=2, g=2, seed=s))["grpo/learning_rate"] for s in range(4)]
    assert lrs == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])


def test_bf16_model_trains_through_fp32_master_weights():
    gen = make_generator(dtype=torch.bfloat16)
    opt = make_grpo(gen, learning_rate=1e-6)
    start = [m.clone() for m in opt.master]
    assert all(m.dtype == torch.float32 for m in opt.master) and opt.master is not opt.params
    opt.tell(sample_results(gen))
    assert any(not torch.equal(a, b) for a, b in zip(start, opt.master))  # a 1e-6 step survives in fp32
    for p, m in zip(opt.params, opt.master):
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16)) and p.grad is None


def test_bf16_gradients_accumulate_in_fp32(monkeypatch):
    """bf16 gradients move into the fp32 masters per micro-batch; the sum matches one big batch."""
    results = sample_results(make_generator(dtype=torch.bfloat16))
    grads = capture_grads(monkeypatch)
    for mb in (1, 12):
        make_grpo(make_generator(dtype=torch.bfloat16), micro_batch_size=mb).tell(results)
    assert all(g.dtype == torch.float32 for g in grads[0])
    one, many = torch.cat([g.flatten() for g in grads[0]]), torch.cat([g.flatten() for g in grads[1]])
    assert one.abs().sum() > 0
    assert float((one - many).norm() / many.norm()) < 0.02  # bf16 forward noise, not a missing micro-batch


@pytest.mark.parametrize("checkpointing", [False, True])
def test_bf16_gradients_leave_the_model_during_backward(monkeypatch, checkpointing):
    """Post-accumulate hooks move each bf16 gradient into its fp32 master as backward produces it:
    when backward returns no parameter holds a gradient (the memory the whole model's bf16
    gradients would take), and the masters hold every micro-batch's sum."""
    seen = []
    original = GRPO._move_grads_to_master

    def after_backward(self):
        seen.append(sum(p.grad is not None for p in self.params))
        original(self)

    monkeypatch.setattr(GRPO, "_move_grads_to_master", after_backward)
    grads = capture_grads(monkeypatch)
    gen = make_generator(dtype=torch.bfloat16)
    make_grpo(gen, micro_batch_size=4, gradient_checkpointing=checkpointing).tell(sample_results(gen))
    assert len(seen) > 1 and set(seen) == {0}
    assert all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads[0])
    # A second GRPO on the same model takes over the hooks: its masters get the gradients.
    second = make_grpo(gen, micro_batch_size=4, gradient_checkpointing=checkpointing)
    second.tell(sample_results(gen, seed=5))
    assert len(grads) == 2 and all(g.abs().sum() > 0 for g in grads[1])


def test_setup_errors():
    gen = make_generator()
    gen.sampling = SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="temperature > 0"):
        make_grpo(gen)
    with pytest.raises(ValueError, match="total_iterations"):
        GRPO(GRPOConfig(lr_scheduler_type="linear")).setup(make_generator())
    opt = make_grpo(make_generator())
    results = sample_results(opt.host)
    results[0].completion.token_ids = None
    with pytest.raises(ValueError, match="token ids"):
        opt.tell(results)


# -- LoRA ---------------------------------------------------------------------------------------------
def test_lora_trains_only_adapters_and_the_generator_sees_them():
    pytest.importorskip("peft")
    gen = make_generator()
    base = {k: v.clone() for k, v in gen.model.state_dict().items()}
    probe = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        logits_before = gen.model(input_ids=probe).logits
    opt = make_grpo(gen, use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"],
                    learning_rate=1e-2, beta=0.05)
    assert opt.ref_model is None  # the reference is the model with adapters disabled
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in gen.model.named_parameters() if p.requires_grad} \
        == {"q_proj", "v_proj"}
    assert all(p.shape[0] == 4 or p.shape[1] == 4 for p in opt.params)
    opt.tell(sample_results(gen, seed=1))
    metrics = opt.tell(sample_results(gen, seed=2))
    assert metrics["grpo/kl"] > 0
    for k, v in gen.model.state_dict().items():
        if "lora_" not in k:
            assert torch.equal(v, base[k.replace(".base_layer", "")]), k
    with torch.no_grad():
        assert not torch.allclose(gen.model(input_ids=probe).logits, logits_before)


# -- checkpoints and the real loop --------------------------------------------------------------------
def _toy_config(tmp_path, name: str, iterations: int, tasks: int = 3, max_new_tokens: int = 12, **grpo):
    # save_every=1: these tests look at the checkpoint of every iteration (the default cadence is by time)
    grpo = {"num_generations": 4, "learning_rate": 1e-2, "lr_scheduler_type": "linear", "micro_batch_size": 6,
            "save_every": 1, **grpo}
    return build({"plugin": "letters", "optimizer": "grpo", "iterations": iterations, "tasks_per_iteration": tasks,
                  "sampling": {"max_new_tokens": max_new_tokens, "temperature": 1.0}, "grpo": grpo,
                  "logging": {"runs_dir": str(tmp_path), "name": name}})


def _quiet() -> Console:
    return Console(file=io.StringIO())


def _final_weights(run: RunDir, iteration: int, file: str) -> dict[str, torch.Tensor]:
    return load_file(str(run.path / "grpo" / f"iter-{iteration:06d}" / "policy" / file))


def test_save_every_checkpoints_less_and_resume_redoes_the_iterations_since(tmp_path, monkeypatch):
    """grpo.save_every=2 over 5 iterations: checkpoints after 2, 4 and the last (5). A stop inside
    iteration 4's update (nothing can be saved then) leaves the one after 2 while 3 iterations are
    finished, so a resume rewinds the run to 2 and redoes 3: same metrics and same final weights as
    the uninterrupted run."""
    file = "model.safetensors"
    straight = Trainer(_toy_config(tmp_path, "straight", 5, save_every=2), environment=LettersEnvironment(),
                       console=_quiet())
    assert straight.run()["status"] == "finished"
    assert sorted(p.name for p in (straight.run_dir.path / "grpo").iterdir()) == ["iter-000004", "iter-000005"]
    assert all(r["save_s"] >= 0 for r in straight.run_dir.metrics())

    tell, calls = GRPO.tell, []

    def stop_in_fourth_update(self, results):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return tell(self, results)

    monkeypatch.setattr(GRPO, "tell", stop_in_fourth_update)
    cfg = _toy_config(tmp_path, "resumed", 5, save_every=2)
    first = Trainer(cfg, environment=LettersEnvironment(), console=_quiet())
    assert first.run()["status"] == "interrupted" and first.run_dir.completed_iterations() == 3
    assert sorted(p.name for p in (first.run_dir.path / "grpo").iterdir()) == ["iter-000002"]
    out = io.StringIO()
    second = Trainer(cfg, run_dir=RunDir.open(first.run_dir.path), environment=LettersEnvironment(),
                     console=Console(file=out, width=200))
    assert second.run()["status"] == "finished" and second.start_iteration == 2
    assert "redoing iterations 3..3" in out.getvalue()
    rows_a, rows_b = straight.run_dir.metrics(), second.run_dir.metrics()
    assert [r["iteration"] for r in rows_b] == [0, 1, 2, 3, 4]
    assert [r["reward_mean"] for r in rows_a] == [r["reward_mean"] for r in rows_b]
    samples = [json.loads(line)["iteration"] for line in (second.run_dir.path / "samples.jsonl").read_text().splitlines()]
    assert samples == sorted(samples) and samples.count(2) == samples.count(0)  # iteration 2's samples once
    a, b = _final_weights(straight.run_dir, 5, file), _final_weights(second.run_dir, 5, file)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_stop_between_updates_writes_the_checkpoint_save_every_skipped(tmp_path, monkeypatch):
    """grpo.save_every=3, Ctrl-C during iteration 3's generation: the trainer has GRPO write the
    checkpoint of iteration 2 on the way out, so the resume redoes nothing. A stop inside the update
    (state half-written) writes nothing and falls back to the last regular checkpoint."""
    cfg = _toy_config(tmp_path, "stop", 5, save_every=3)
    trainer = Trainer(cfg, environment=LettersEnvironment(), console=_quiet())
    stream = trainer.runtime.policy  # interrupt the third iteration's first generation pass

    def generator(config, moves=None):
        gen = stream(config, moves)
        original, calls = gen.stream, []

        def interrupted(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            yield from original(*args, **kwargs)

        gen.stream = interrupted
        return gen

    monkeypatch.setattr(trainer.runtime, "policy", generator)
    assert trainer.run()["status"] == "interrupted" and trainer.run_dir.completed_iterations() == 2
    assert sorted(p.name for p in (trainer.run_dir.path / "grpo").iterdir()) == ["iter-000002"]
    again = Trainer(cfg, run_dir=RunDir.open(trainer.run_dir.path), environment=LettersEnvironment(), console=_quiet())
    assert again.run()["status"] == "finished" and again.start_iteration == 2

    def failing_tell(self, results):
        raise KeyboardInterrupt  # as if Ctrl-C arrived in the middle of the update

    cfg2 = _toy_config(tmp_path, "mid-update", 5, save_every=3)
    first = Trainer(cfg2, environment=LettersEnvironment(), console=_quiet(),
                    on_iteration=lambda m: m["iteration"] == 1 and monkeypatch.setattr(GRPO, "tell", failing_tell))
    assert first.run()["status"] == "interrupted" and first.run_dir.completed_iterations() == 2
    assert not (first.run_dir.path / "grpo").exists()  # nothing written: no regular checkpoint was due yet


@pytest.mark.parametrize("lora", [False, True])
def test_resume_matches_uninterrupted_run(tmp_path, lora):
    """Ctrl-C after iteration 2, then a new Trainer on the same run directory: same final weights."""
    if lora:
        pytest.importorskip("peft")
    extra = {"use_peft": True, "lora_r": 4, "lora_dropout": 0.1, "beta": 0.05} if lora else {"num_iterations": 2}
    file = "adapter_model.safetensors" if lora else "model.safetensors"
    straight = Trainer(_toy_config(tmp_path, "straight", 4, **extra), environment=LettersEnvironment(), console=_quiet())
    assert straight.run()["status"] == "finished"

    def interrupt(metrics):
        if metrics["iteration"] == 1:
            raise KeyboardInterrupt

    cfg = _toy_config(tmp_path, "resumed", 4, **extra)
    first = Trainer(cfg, environment=LettersEnvironment(), console=_quiet(), on_iteration=interrupt)
    assert first.run()["status"] == "interrupted"
    assert first.run_dir.completed_iterations() == 2
    second = Trainer(cfg, run_dir=RunDir.open(first.run_dir.path), environment=LettersEnvironment(), console=_quiet())
    assert second.start_iteration == 2 and second.run()["status"] == "finished"

    a, b = _final_weights(straight.run_dir, 4, file), _final_weights(second.run_dir, 4, file)
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not all(torch.equal(a[k], _final_weights(straight.run_dir, 3, file)[k]) for k in a)
    # Two checkpoints are kept: the last and the one before it.
    assert sorted(p.name for p in (second.run_dir.path / "grpo").iterdir()) == ["iter-000003", "iter-000004"]
    rows_a, rows_b = straight.run_dir.metrics(), second.run_dir.metrics()
    assert [r["reward_mean"] for r in rows_a] == [r["reward_mean"] for r in rows_b]


def test_checkpoint_policy_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gen = make_generator()
    opt = make_grpo(gen, learning_rate=1e-3)
    opt.tell(sample_results(gen))
    opt.save(tmp_path, final=True)  # final: written before it returns (else in the background)
    path = tmp_path / "grpo" / "iter-000001" / "policy"
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    for k, v in gen.model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)
    assert tok("abc")["input_ids"] == gen.tokenizer("abc")["input_ids"]
    with pytest.raises(FileNotFoundError, match="no GRPO checkpoint at or before iteration 0"):
        make_grpo(make_generator()).load(tmp_path / "elsewhere", 0)


@pytest.mark.slow
def test_grpo_raises_reward_on_the_toy_environment(tmp_path):
    """The real Trainer, tiny model, 12 iterations × 4 tasks × 8 samples of 16 tokens, dapo, lr 1e-2.
    Measured on CPU: the mean reward goes from 0.063 (random model, ≈ 16/257 of its characters in
    a-p) in the first iteration to 0.83 (mean of the last two; 0.85 in the last)."""
    cfg = _toy_config(tmp_path, "learn", 12, tasks=4, max_new_tokens=16, num_generations=8, micro_batch_size=32,
                      lr_scheduler_type="constant")
    trainer = Trainer(cfg, environment=LettersEnvironment(), console=_quiet())
    summary = trainer.run()
    rows = trainer.run_dir.metrics()
    first, last = rows[0]["reward_mean"], sum(r["reward_mean"] for r in rows[-2:]) / 2
    assert summary["status"] == "finished"
    assert first < 0.15, first
    assert last > 0.5, (first, last)


def test_a_grpo_run_whose_host_cannot_start_fails_with_that_error_alone(tmp_path, monkeypatch):
    """GRPO is closed at the end of every run, also one whose host never started (so `setup` never ran):
    the run's error is the host's, not an AttributeError from closing a rule that was never set up."""
    from vrl.runtime.local import LocalRuntime

    def no_engine(self, *args, **kwargs):
        raise RuntimeError("the engine could not start")

    monkeypatch.setattr(LocalRuntime, "policy", no_engine)
    console = Console(file=io.StringIO(), width=200)
    with pytest.raises(RuntimeError, match="the engine could not start"):
        Trainer(_toy_config(tmp_path, "nohost", 1), environment=LettersEnvironment(), console=console).run()
    assert "checkpoint" not in console.file.getvalue(), console.file.getvalue()
