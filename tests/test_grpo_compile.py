"""`grpo.compile`: decoder layers through the real `torch.compile` (dynamo + inductor, C++ on CPU).

Nothing is emulated: the tiny Qwen2 model's layers are compiled with inductor, as a GPU run does (only
the code generator differs: C++ here, Triton there). A cold compile takes seconds to tens of seconds on
CPU, hence the `slow` marks, and each distinct graph is compiled once in the file: the module's `runs`
(the padded and checkpointing cases, one compiled GRPO trained on new lengths and one-row micro-batches)
serve the step comparison, the recompile counts and the generation test; the other tests reuse their
graphs where theirs are the same and compile only what is theirs alone (the LoRA layer, the head's
chunks with entropies).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.utils import counters

from tests.test_grpo import capture_grads, make_generator, sample_results
from vrl.generate import tiny
from vrl.generate.hf import HFGenerator
from vrl.optim.compile import compile_layers, decoder_layers, restore_layers
from vrl.optim.grpo import GRPO, GRPOConfig
from vrl.optim.logprobs import completion_logprobs, pack
from vrl.types import Completion, Result, Task, Verdict

LR = 1e-3
# Inductor fuses and reorders float32 arithmetic. Measured on the settings below (torch 2.13, CPU): the
# log-probs differ by at most 4.8e-7; a gradient element by at most 8.7e-7 of its tensor's largest at the
# first optimizer step (5.2e-7 on 2 FSDP2 ranks). A later step starts from weights that already differ
# (AdamW's first step turns the gradients' float noise into up to a few percent of lr, see
# `assert_adamw_step_close`): 5.7e-6 there. Each tolerance is about 4-6 times the measured difference.
LOGP_ATOL = 2e-6
GRAD_RTOL = 5e-6
LATER_GRAD_RTOL = 3e-5


@pytest.fixture(autouse=True, scope="module")
def _compile_in_process():
    """Inductor compiles in this process (`compile_threads=1`) instead of starting a pool of compile
    workers: on the 2-core machine each worker costs its own torch import and buys no parallelism. Its C++
    kernels are scalar (`cpp.simdlen=1`): on a cold cache the vectorised ones cost g++ more (this file: 120
    against 107 s; its first test 61 against 51 s; idle machine, session 23), and a GPU run's kernels are
    Triton's, not these; the graphs, fusions and dynamic shapes under test are the same. So inductor need
    not probe which vector instruction sets this CPU has (`cpp.vec_isa_ok=False`): on a cold cache it
    builds a test program per set, with ATen's vectorised headers, about 7 CPU-seconds of g++; the
    kernels and their g++ flags are the same without it."""
    from torch._inductor import config, cpu_vec_isa

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "compile_threads", 1)
        mp.setattr(config.cpp, "simdlen", 1)
        mp.setattr(config.cpp, "vec_isa_ok", False)
        yield
    cpu_vec_isa.valid_vec_isa_list.cache_clear()  # it kept the empty list of the probe-free answer


def varied_results(seed: int, n: int = 6, group: int = 3) -> list[Result]:
    """`n` rewarded samples of random prompts (2–12 tokens) and completions (1–10): padded rows of
    different lengths, so micro-batches of 2 have different widths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        task = Task(id=f"t{i // group}", prompt="p")
        completion = Completion(task_id=task.id, text="x", sample=i % group, finish_reason="stop",
                                prompt_token_ids=[rng.randrange(256) for _ in range(rng.randint(2, 12))],
                                token_ids=[rng.randrange(256) for _ in range(rng.randint(1, 10))])
        reward = rng.random()
        out.append(Result(task=task, completion=completion, verdict=Verdict.fail("failed", "toy", score=reward),
                          reward=reward))
    return out


def make_generator_with(layers: int) -> HFGenerator:
    """`make_generator`'s tiny model, with `layers` decoder layers."""
    gen = make_generator()
    if layers != len(gen.model.model.layers):
        gen.model = tiny.build_model(num_layers=layers)
    return gen


# The GRPO configs whose one compiled step `test_compiled_step_equals_eager_step` compares with the eager step.
CASES = {"padded": {}, "checkpointing-beta-2-steps": {"gradient_checkpointing": True, "beta": 0.1, "num_iterations": 2},
         "lora": {"use_peft": True, "lora_dropout": 0.0}}


@dataclass
class Steps:
    """One `tell` on the same varied rows from two fresh tiny models, the layers eager and compiled."""

    fields: dict  # the GRPO config's fields
    eager: dict  # the eager step's metrics
    compiled: dict
    weights_eager: dict[str, torch.Tensor]  # the weights after it
    weights_compiled: dict[str, torch.Tensor]
    grads: list[list[torch.Tensor]]  # the master gradients at each optimizer step: the eager run's, then the compiled run's
    names: list[str]  # the trained parameters' names, in the order of each step's gradients
    moved: float  # how far the compiled step moved the trained parameters (largest element)
    graphs: int  # the graphs dynamo compiled during the compiled step
    opt: GRPO  # the compiled run's optimizer (its generator: `gen`), to train on
    gen: HFGenerator


def eager_and_compiled(fields: dict, layers: int = 2) -> Steps:
    """`Steps` for GRPO config `fields` on `varied_results(0)` in micro-batches of 2."""
    results = varied_results(0)
    runs = []
    with pytest.MonkeyPatch.context() as mp:
        grads = capture_grads(mp)
        for compile in (False, True):
            gen = make_generator_with(layers)
            opt = GRPO(GRPOConfig(lr_scheduler_type="constant", micro_batch_size=2, learning_rate=LR, compile=compile,
                                  **fields), seed=0, total_iterations=10)
            opt.setup(gen)
            before = [p.detach().clone() for p in opt.params]
            graphs = counters["stats"]["unique_graphs"]
            metrics = opt.tell(results)
            moved = max(float((p.detach() - b).abs().max()) for p, b in zip(opt.params, before))
            runs.append((metrics, {k: v.clone() for k, v in gen.model.state_dict().items()}, opt, gen, moved,
                         counters["stats"]["unique_graphs"] - graphs))
    (eager, weights_eager, eager_opt, *_), (compiled, weights_compiled, opt, gen, moved, graphs) = runs
    return Steps(fields, eager, compiled, weights_eager, weights_compiled, grads, eager_opt.param_names, moved,
                 graphs, opt, gen)


@pytest.fixture(scope="module")
def runs() -> dict:
    """The 2-layer model's compiled runs, once for the module, in an order that compiles each graph once.
    From a reset dynamo (so its `graphs` count all it needed), the padded case's `Steps`; its compiled
    GRPO trained on rows of other lengths; the checkpointing case's `Steps` (its layer graph is the padded
    one, so from inductor's cache: a one-row specialisation compiled before it made that a miss); then
    the padded GRPO on micro-batches of one row. `tells`: the graphs each of those `tell`s compiled
    (`test_new_lengths_do_not_recompile`). The padded GRPO's generator is left to
    `test_generation_after_a_compiled_step_stays_eager`."""
    torch._dynamo.reset()
    out = {"padded": eager_and_compiled(CASES["padded"]), "tells": {}}

    def tell(name: str, results: list[Result]) -> None:
        before = counters["stats"]["unique_graphs"]
        out["padded"].opt.tell(results)
        out["tells"][name] = counters["stats"]["unique_graphs"] - before

    tell("other lengths", varied_results(1))
    tell("more rows", varied_results(2, n=8, group=4))
    out["checkpointing-beta-2-steps"] = eager_and_compiled(CASES["checkpointing-beta-2-steps"])
    tell("one row", varied_results(3, n=5, group=5))  # 5 rows: the last micro-batch holds one
    tell("one row again", varied_results(4, n=3, group=3))  # other lengths, the last micro-batch one row again
    return out


def assert_adamw_step_close(names, grads_a, grads_b, metrics_a, metrics_b, weights_a, weights_b) -> None:
    """Weights after AdamW's first step, from two gradients that differ by float noise. The step is
    lr·ĝ/(|ĝ| + ε) of the clipped gradient ĝ; its slope ε/(|ĝ| + ε)² turns a 1e-8 difference in a
    near-zero gradient into a sizeable part of lr: each element is held to that bound (plus 4 fp32 ulps)."""
    eps = 1e-8
    clip = [min(1.0, 1.0 / (m["grpo/grad_norm"] + 1e-6)) for m in (metrics_a, metrics_b)]
    for name, g1, g2 in zip(names, grads_a, grads_b):
        g1, g2 = g1 * clip[0], g2 * clip[1]
        diff = (g1 - g2).abs()
        slope = eps / ((g1.abs() - diff).clamp(min=0) + eps) ** 2
        ulps = 4 * torch.finfo(torch.float32).eps * (weights_a[name].abs() + LR)
        bound = LR * torch.clamp(slope * diff, max=2.0) + ulps
        assert bool(((weights_a[name] - weights_b[name]).abs() <= bound).all()), name


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_step_equals_eager_step(case, request):
    """One `tell` with the layers compiled gives the eager step's loss, gradients (every optimizer step)
    and updated weights, on padded rows of varied lengths, within float reordering. With
    checkpointing the compiled layer is recomputed in backward; with beta > 0 and 2 steps the eval-mode
    (eager) reference and old log-probs meet compiled training log-probs. LoRA without dropout
    (inductor draws dropout masks with its own generator, so masks differ from eager's) on a one-layer
    model: with LoRA the first layer's input has no gradient (the embedding is frozen) and a later
    layer's has, two graphs; one layer puts peft's wrapped projections through the compiler, a second
    would cost a second cold compile. The other cases are the module's `runs`."""
    s = eager_and_compiled(CASES[case], layers=1) if case == "lora" else request.getfixturevalue("runs")[case]
    grads, n_steps = s.grads, len(s.grads) // 2
    assert len(grads) == 2 * n_steps == 2 * s.fields.get("num_iterations", 1)
    assert s.compiled["grpo/loss"] == pytest.approx(s.eager["grpo/loss"], rel=1e-6, abs=1e-9)
    assert s.compiled["grpo/grad_norm"] == pytest.approx(s.eager["grpo/grad_norm"], rel=1e-5)
    for i, (a_step, b_step) in enumerate(zip(grads[:n_steps], grads[n_steps:])):
        for a, b in zip(a_step, b_step):
            assert float((a - b).abs().max()) <= (LATER_GRAD_RTOL if i else GRAD_RTOL) * float(a.abs().max()) + 1e-12
    assert any(float(g.abs().max()) > 0 for g in grads[0])
    if n_steps == 1:
        assert_adamw_step_close(s.names, grads[0], grads[1], s.eager, s.compiled, s.weights_eager, s.weights_compiled)
    assert s.moved > 0.5 * LR  # the step did move the weights


@pytest.mark.slow
def test_compiled_logprobs_equal_eager_in_training_mode():
    """The compiled decoder's log-probs on padded rows of different lengths are the eager decoder's."""
    eager, model = tiny.build_model().train(), tiny.build_model().train()
    compile_layers(model)
    for seed in range(3):
        rows = varied_results(seed, n=3)
        packed = pack([r.completion.prompt_token_ids for r in rows], [r.completion.token_ids for r in rows], 256)
        want = completion_logprobs(eager, packed, 0.9, chunk_size=5)
        got = completion_logprobs(model, packed, 0.9, chunk_size=5)
        torch.testing.assert_close(got, want, atol=LOGP_ATOL, rtol=0)
        assert torch.equal(got == 0, want == 0)  # the padding stays 0


@pytest.mark.slow
def test_the_compiled_head_chunks_give_eager_logprobs_entropies_and_gradients():
    """`completion_logprobs(compiled=True)` (grpo.compile's head: cast, temperature, log-sum-exp and gather
    fused around the matrix multiply, chunk by chunk, recomputed in backward) against the eager chunks:
    log-probs and entropies to LOGP_ATOL, the head's gradient to 1e-5 of its largest element; a
    compiled graph was made for it."""
    torch._dynamo.reset()  # count from nothing: earlier tests in this process may have compiled the chunks
    model = tiny.build_model().train()
    rows = varied_results(0, n=4)
    packed = pack([r.completion.prompt_token_ids for r in rows], [r.completion.token_ids for r in rows], 256)
    out = {}
    for compiled in (False, True):
        model.zero_grad()
        before = counters["stats"]["unique_graphs"]
        logps, ent = completion_logprobs(model, packed, 0.7, chunk_size=7, entropy=True, compiled=compiled)
        (logps.sum()).backward()
        out[compiled] = (logps.detach(), ent, model.get_output_embeddings().weight.grad.clone(),
                         counters["stats"]["unique_graphs"] - before)
    torch.testing.assert_close(out[True][0], out[False][0], atol=LOGP_ATOL, rtol=0)
    torch.testing.assert_close(out[True][1], out[False][1], atol=LOGP_ATOL, rtol=0)
    g_eager, g_compiled = out[False][2], out[True][2]
    assert float((g_compiled - g_eager).abs().max()) <= 1e-5 * float(g_eager.abs().max())
    assert out[False][3] == 0 and out[True][3] >= 1


@pytest.mark.slow
def test_new_lengths_do_not_recompile(runs):
    """Micro-batches of new lengths reuse the compiled graph (shapes are dynamic); both layers share it.
    A one-row micro-batch (size 1 is specialised) adds at most one graph, and only once."""
    widths = {max(len(r.completion.prompt_token_ids) + len(r.completion.token_ids) for r in pair)
              for pair in _micro_batches(varied_results(0), 2)}
    assert len(widths) == 3  # the first step's three micro-batches have three lengths
    assert len(runs["padded"].gen.model.model.layers) == 2
    assert 1 <= runs["padded"].graphs <= 2  # one graph for both layers and every length, one for the head's chunks
    tells = runs["tells"]
    assert tells["other lengths"] == tells["more rows"] == 0
    assert tells["one row"] <= 1
    assert tells["one row again"] == 0


def _micro_batches(results: list[Result], size: int) -> list[list[Result]]:
    order = sorted(results, key=lambda r: len(r.completion.prompt_token_ids) + len(r.completion.token_ids))
    return [order[s : s + size] for s in range(0, len(order), size)]


@pytest.mark.slow
def test_generation_after_a_compiled_step_stays_eager(runs):
    """The host samples from the module GRPO trains (one process): after compiled steps, generation
    compiles nothing and samples exactly what an uncompiled model with the same weights samples."""
    gen = runs["padded"].gen
    frames = dict(counters["frames"])
    sampled = [c.text for c in (r.completion for r in sample_results(gen, seed=7))]
    assert dict(counters["frames"]) == frames
    plain = make_generator()
    plain.model.load_state_dict(gen.model.state_dict())
    assert [c.text for c in (r.completion for r in sample_results(plain, seed=7))] == sampled


def test_layers_are_compiled_in_place_and_restored():
    """Each layer keeps its class's name (FSDP2 finds layers by it) and survives a deep copy;
    `restore_layers` gives back the eager class. (No forward here: nothing is compiled.)"""
    import copy

    model = tiny.build_model()
    base = type(model.model.layers[0])
    assert compile_layers(model) == 2
    assert compile_layers(model) == 2  # idempotent: no subclass of the subclass
    layer = model.model.layers[0]
    assert type(layer) is not base and type(layer).__name__ == base.__name__ and type(layer).__mro__[1] is base
    assert type(copy.deepcopy(model).model.layers[1]) is type(layer)
    assert restore_layers(model) == 2
    assert all(type(m) is base for m in model.model.layers)


def test_a_model_without_a_layer_list_is_refused():
    """A model whose decoder keeps its layers under an unknown name: one line naming the model's class."""
    gen = make_generator()
    layers = gen.model.model.layers
    del gen.model.model.layers
    gen.model.model.stack = layers
    assert decoder_layers(gen.model) is None
    opt = GRPO(GRPOConfig(lr_scheduler_type="constant", compile=True), seed=0, total_iterations=10)
    with pytest.raises(ValueError) as err:
        opt.setup(gen)
    message = str(err.value)
    assert "\n" not in message and "Qwen2ForCausalLM" in message and "grpo.compile=false" in message


def test_compile_backend_names_the_backend_that_gets_the_graphs():
    """`grpo.compile_backend` reaches torch.compile: a backend registered under a name of its own receives
    the layers' graph and the head chunks' (and runs them as dynamo captured them, so the step is the
    eager step); a name torch does not know is refused when the config is built, in one line. (Dynamo
    traces here, no code is generated: a few seconds.)"""
    from pydantic import ValidationError
    from torch._dynamo import register_backend

    graphs = []

    @register_backend(name="vrl_test_recording")
    def recording(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    torch._dynamo.reset()
    results = varied_results(0)
    metrics = {}
    for backend in (None, "vrl_test_recording"):
        gen = make_generator()
        fields = {"compile": True, "compile_backend": backend} if backend else {}
        opt = GRPO(GRPOConfig(lr_scheduler_type="constant", micro_batch_size=2, **fields), seed=0, total_iterations=10)
        opt.setup(gen)
        metrics[backend] = opt.tell(results)
    assert len(graphs) >= 2  # the layer's, the head chunks'
    assert any("silu" in " ".join(g) for g in graphs) and any("logsumexp" in " ".join(g) for g in graphs)
    assert metrics["vrl_test_recording"]["grpo/loss"] == pytest.approx(metrics[None]["grpo/loss"], rel=1e-6)
    with pytest.raises(ValidationError) as err:
        GRPOConfig(compile=True, compile_backend="inductr")
    assert "grpo.compile_backend='inductr' is not a torch.compile backend" in str(err.value)
    GRPOConfig(compile=False, compile_backend="inductr")  # checked only when it is used
