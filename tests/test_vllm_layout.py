"""The CPU-checkable parts of the vllm backend: HF ↔ fused-engine parameter mapping, in-engine ES
against the hf backend's ES, engine arguments from the config, stop strings and log-probs.

vLLM itself needs a GPU (tests/test_vllm_gpu.py runs it on the device). Here the engine's layout is
built from an HF Qwen2 model the way vLLM lays it out (q/k/v rows stacked in `qkv_proj`, gate/up in
`gate_up_proj`, vocabulary padded to a multiple of 64), independently of the code under test.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from vrl.config import build
from vrl.generate import make_generator
from vrl.generate.base import Generator, cut_at_stop
from vrl.generate.vllm import engine_kwargs, sampled_logprobs
from vrl.generate.vllm_inplace import EngineES
from vrl.generate.vllm_worker import engine_layout, slot_views
from vrl.optim.es import ES, ESConfig, IterationRecord, update_terms
from vrl.policy import HostNeeds
from vrl.runtime.local import LocalRuntime
from vrl.weights.flat import FlatParams, select_parameters

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB, PADDED_VOCAB, LAYERS = 4, 2, 8, 32, 48, 257, 320, 2


def hf_model(dtype=torch.float32) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(dtype).eval()


def fuse(model: Qwen2ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights in vLLM's Qwen2 layout (what `model_runner.get_model()` holds)."""
    sd = {k: v.detach().clone() for k, v in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if ".q_proj." in name:
            k, v = sd[name.replace("q_proj", "k_proj")], sd[name.replace("q_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat([t, k, v])
        elif ".gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, sd[name.replace("gate_proj", "up_proj")]])
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            pad = torch.full((PADDED_VOCAB - VOCAB, HIDDEN), 7.0, dtype=t.dtype)  # padding rows ES must not touch
            out[name] = torch.cat([t, pad])
        elif not any(s in name for s in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[name] = t
    return out


def shapes(params) -> dict[str, list[int]]:
    return {n: list(p.shape) for n, p in params.items()}


def test_layout_places_each_hf_parameter_in_its_fused_rows():
    model = hf_model()
    hf = shapes(dict(model.named_parameters()))
    layout = engine_layout(hf, shapes(fuse(model)), PACKED)
    assert set(layout) == set(hf)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for suffix in ("weight", "bias"):
        base = f"model.layers.1.self_attn.{{}}.{suffix}"
        assert (layout[base.format("q_proj")].engine_name, layout[base.format("q_proj")].row) == (base.format("qkv_proj"), 0)
        assert layout[base.format("k_proj")].row == q and layout[base.format("k_proj")].rows == kv
        assert layout[base.format("v_proj")].row == q + kv
    assert layout["model.layers.0.mlp.up_proj.weight"].engine_name == "model.layers.0.mlp.gate_up_proj.weight"
    assert layout["model.layers.0.mlp.up_proj.weight"].row == INTER
    assert layout["model.embed_tokens.weight"].rows == VOCAB  # the padding rows are not an HF parameter
    assert layout["model.layers.0.self_attn.o_proj.weight"].engine_name == "model.layers.0.self_attn.o_proj.weight"


def test_unfused_views_equal_the_hf_tensors():
    model = hf_model()
    engine = fuse(model)
    views = slot_views(engine, engine_layout(shapes(dict(model.named_parameters())), shapes(engine), PACKED))
    for name, p in model.named_parameters():
        assert torch.equal(views[name], p.detach()), name


def test_layout_errors_name_the_parameter():
    model = hf_model()
    hf = shapes(dict(model.named_parameters()))
    engine = shapes(fuse(model))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight has no engine tensor"):
        engine_layout(hf, {k: v for k, v in engine.items() if "layers.0.self_attn.qkv" not in k}, PACKED)
    wrong = dict(engine, **{"model.layers.0.mlp.down_proj.weight": [HIDDEN, INTER + 1]})
    with pytest.raises(ValueError, match="down_proj.weight .* does not fit"):
        engine_layout(hf, wrong, PACKED)
    bigger = dict(engine, **{"model.layers.1.self_attn.qkv_proj.weight": [HEADS * HEAD_DIM * 3, HIDDEN]})
    with pytest.raises(ValueError, match="have 64 rows but the engine tensor has 96"):
        engine_layout(hf, bigger, PACKED)
    no_k = {k: v for k, v in hf.items() if k != "model.layers.0.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match="sibling model.layers.0.self_attn.k_proj.weight"):
        engine_layout(no_k, engine, PACKED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_es_matches_hf_es_bit_for_bit(dtype):
    """A member perturbed inside the (fused) engine holds exactly the hf backend's member weights."""
    model = hf_model(dtype)
    reference = copy.deepcopy(model)
    engine = fuse(model)
    original = {k: v.clone() for k, v in engine.items()}
    selected = select_parameters(model, ["*"], ["*norm*"])  # a selection that leaves some tensors alone
    layout = engine_layout({n: list(p.shape) for n, p in selected}, shapes(engine), PACKED)
    views = slot_views(engine, layout)
    es = EngineES(views)
    flat = FlatParams(select_parameters(reference, ["*"], ["*norm*"]))
    hf_params = dict(reference.named_parameters())

    es.perturb(seed=12345, sign=-1, sigma=0.05)
    flat.perturb(12345, -1, 0.05)
    for name, _ in selected:
        assert torch.equal(views[name], hf_params[name].detach()), name
        assert not torch.equal(views[name], original[layout[name].engine_name][layout[name].row :][: layout[name].rows])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # vocabulary padding rows untouched
        assert torch.equal(engine[name][VOCAB:], original[name][VOCAB:])
    assert torch.equal(engine["model.norm.weight"], original["model.norm.weight"])  # excluded

    es.restore()
    for name, t in engine.items():
        assert torch.equal(t, original[name]), name  # bit-exact restore

    record = IterationRecord(seed=77, z=[1.0, -0.5, -0.5, 0.25])
    terms = update_terms(record, antithetic=False, alpha=0.01)
    es.update(terms)
    flat.restore()
    flat.update(terms)
    for name, _ in selected:
        assert torch.equal(views[name], hf_params[name].detach()), name
    state = es.state()
    assert all(torch.equal(state[n], flat.state()[n]) for n, _ in selected)


def test_engine_es_state_round_trip_replays_exactly():
    model = hf_model(torch.bfloat16)
    engine = fuse(model)
    selected = dict(model.named_parameters())
    es = EngineES(slot_views(engine, engine_layout(shapes(selected), shapes(engine), PACKED)))
    theta0 = es.state()
    terms = [update_terms(IterationRecord(seed=s, z=[1.0, -1.0]), False, 0.02) for s in (3, 9)]
    es.update(*terms)
    after = {k: v.clone() for k, v in engine.items()}
    es.load_state(theta0)
    assert not all(torch.equal(engine[k], after[k]) for k in engine)
    for t in terms:  # ES.load replays one update per iteration
        es.update(t)
    for k in engine:
        assert torch.equal(engine[k], after[k]), k


class _FakeEngineGenerator(Generator):
    """A host whose weights are engine tensors (vLLM needs a GPU): `perturbations` must go through
    its `_perturbable`, as VLLMGenerator's does, and ES must read the info it returns."""

    name = "fake-engine"

    def __init__(self, es: EngineES):
        self.es, self.calls = es, []

    def stream(self, tasks, n=1, variant=0, seed=None):
        yield []

    def _perturbable(self, spec):
        self.calls.append((list(spec.include), list(spec.exclude), spec.sigma))
        return self.es.flat


def test_es_setup_goes_through_the_hosts_perturbable_weights():
    model = hf_model()
    engine = fuse(model)
    es_state = EngineES(slot_views(engine, engine_layout(shapes(dict(model.named_parameters())), shapes(engine), PACKED)))
    gen = _FakeEngineGenerator(es_state)
    opt = ES(ESConfig(population_size=2, include=["model.*"], exclude=["*norm*"]))
    opt.setup(gen)
    assert gen.calls == [(["model.*"], ["*norm*"], 1e-3)]
    assert gen._params is es_state.flat and opt.info.numel == es_state.flat.numel


def test_engine_kwargs_read_every_vllm_field():
    cfg = build({"model": "/models/m", "seed": 5, "generator": {
        "backend": "vllm", "dtype": "float32", "revision": "abc", "vllm": {"gpu_memory_utilization": 0.3,
        "max_model_len": 2048, "enforce_eager": True, "max_num_seqs": 64, "tensor_parallel_size": 2, "sleep": True,
        "sync_every": 3}}})
    kw = engine_kwargs(cfg, "/models/m")
    assert kw == {"model": "/models/m", "revision": "abc", "dtype": "float32", "gpu_memory_utilization": 0.3,
                  "max_model_len": 2048, "enforce_eager": True, "max_num_seqs": 64, "tensor_parallel_size": 2,
                  "enable_sleep_mode": True, "seed": 5, "worker_extension_cls": "vrl.generate.vllm_trained.LoadWeightsExtension",
                  "logprobs_mode": "processed_logprobs", "generation_config": "vllm"}
    default = engine_kwargs(build({"model": "tiny", "generator": {"backend": "vllm", "revision": "x"}}), "/tmp/t")
    assert default["dtype"] == "bfloat16" and default["revision"] is None and default["max_model_len"] is None
    assert default["enforce_eager"] is False and default["enable_sleep_mode"] is False
    assert default["max_num_seqs"] == 512  # vLLM's largest CUDA-graph batch; its own default (1024) decodes eagerly
    assert "kv_cache_memory_bytes" not in default  # vLLM sizes the cache from gpu_memory_utilization
    sized = build({"model": "tiny", "generator": {"backend": "vllm", "vllm": {"kv_cache_memory_gb": 1.5}}})
    assert engine_kwargs(sized, "/tmp/t")["kv_cache_memory_bytes"] == 1610612736


def test_config_rejects_bad_vllm_values():
    from vrl.config import ConfigError

    with pytest.raises(ConfigError, match="generator.vllm.gpu_memory_utilization"):
        build({"generator": {"vllm": {"gpu_memory_utilization": 1.5}}})
    with pytest.raises(ConfigError, match="generator.vllm.sync_every"):
        build({"generator": {"vllm": {"sync_every": 0}}})
    with pytest.raises(ConfigError, match="generator.vllm.kv_cache_memory_gb"):
        build({"generator": {"vllm": {"kv_cache_memory_gb": 0}}})
    with pytest.raises(ConfigError, match="generator.vllm.max_num_seqs"):
        build({"generator": {"vllm": {"max_num_seqs": 0}}})
    with pytest.raises(ConfigError, match="generator.vllm.tensor_parallel_size"):
        build({"generator": {"vllm": {"tensor_parallel_size": 0}}})
    with pytest.raises(ConfigError, match="sampling_logprobs=true or set generator.vllm.sync_every=1"):
        build({"generator": {"vllm": {"sync_every": 2, "sampling_logprobs": False}}})
    assert not build({"generator": {"vllm": {"sampling_logprobs": False}}}).generator.vllm.sampling_logprobs


def test_sleep_needs_grpo():
    cfg = build({"generator": {"backend": "vllm", "vllm": {"sleep": True}}, "optimizer": "es"})
    with pytest.raises(ValueError, match="generator.vllm.sleep .* only helps optimizer=grpo"):
        make_generator(cfg, HostNeeds("perturbations"))  # raised before vLLM is imported: no engine, no GPU needed
    with pytest.raises(ValueError, match="generator.vllm.sleep .* only helps optimizer=grpo"):
        LocalRuntime().policy(build(cfg.model_dump(), {"runtime": {"local": {"engines": 2}}}), HostNeeds("perturbations"))


def test_in_engine_es_refuses_tensor_parallel_before_starting_an_engine():
    cfg = build({"generator": {"backend": "vllm", "vllm": {"tensor_parallel_size": 2}}, "optimizer": "es"})
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        make_generator(cfg, HostNeeds("perturbations"))  # raised before vLLM is imported: no engine, no GPU needed


def test_missing_vllm_or_gpu_is_a_clear_error():
    try:
        import vllm  # noqa: F401

        have_vllm = True
    except ImportError:
        have_vllm = False
    if have_vllm and torch.cuda.is_available():
        pytest.skip("vLLM and a GPU are present: nothing is missing")
    with pytest.raises(RuntimeError, match="generator.backend=vllm needs (vLLM|a CUDA GPU).*generator.backend=hf"):
        make_generator(build({"generator": {"backend": "vllm"}}))


def test_cut_at_stop_keeps_the_stop_string_like_the_hf_backend():
    assert cut_at_stop("abc</x>def", ["</x>"]) == ("abc</x>", True)
    assert cut_at_stop("a;b.c", [".", ";"]) == ("a;", True)
    assert cut_at_stop("nothing", ["!"]) == ("nothing", False)


def test_sampled_logprobs_reads_both_vllm_formats():
    """vLLM is not installed here: the two shapes of CompletionOutput.logprobs are rebuilt by hand."""
    flat = SimpleNamespace(start_indices=[0, 1, 3], logprobs=[-0.1, -0.2, -5.0, -0.3], token_ids=[4, 5, 9, 6])
    assert sampled_logprobs(flat, [4, 5, 6]) == [-0.1, -0.2, -0.3]
    nested = [{4: SimpleNamespace(logprob=-0.1)}, {5: SimpleNamespace(logprob=-0.2), 1: SimpleNamespace(logprob=-3.0)}]
    assert sampled_logprobs(nested, [4, 5]) == [-0.1, -0.2]


def test_grpo_reports_the_sampling_logprob_gap():
    """GRPO's metric for how far a sampler's log-probs (vllm) are from training's, on the hf backend
    with log-probs set to training's own plus a known offset."""
    from vrl.generate import tiny
    from vrl.generate.hf import HFGenerator
    from vrl.optim.grpo import GRPO, GRPOConfig
    from vrl.optim.logprobs import completion_logprobs, pack
    from vrl.types import Result, Task, Verdict

    tok = tiny.build_tokenizer()
    gen = HFGenerator(tiny.build_model(), tok, build({"sampling": {"max_new_tokens": 6}}).sampling)
    tasks = [Task(id=f"t{i}", prompt=p) for i, p in enumerate(["ab", "cde"])]
    comps = gen.generate(tasks, n=2, seed=1)
    with torch.no_grad():
        for c in comps:
            own = completion_logprobs(gen.model, pack([c.prompt_token_ids], [c.token_ids], tok.pad_token_id), 1.0)[0]
            c.logprobs = [v - (0.25 if k == 0 else 0.0) for k, v in enumerate(own.tolist())]
    results = [Result(task=tasks[int(c.task_id[1])], completion=c, verdict=Verdict.ok(), reward=float(c.sample))
               for c in comps]
    opt = GRPO(GRPOConfig(num_generations=2, lr_scheduler_type="constant"))
    opt.setup(gen)
    metrics = opt.tell(results)
    tokens = sum(len(c.token_ids) for c in comps)
    assert metrics["grpo/sampling_logprob_diff_max"] == pytest.approx(0.25, abs=1e-5)
    assert metrics["grpo/sampling_logprob_diff_mean"] == pytest.approx(0.25 * len(comps) / tokens, abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_tensors_cross_the_rpc_boundary_as_bytes(dtype):
    """vLLM decodes collective_rpc arguments untyped (tuples arrive as lists), so tensors go as bytes."""
    from vrl.generate.vllm_worker import pack_tensor, rebuild_weights, unpack_tensor

    t = (torch.randn(3, 5) * 100).to(dtype)
    packed = pack_tensor(t)
    wire = [packed[0], packed[1], list(packed[2]), bytes(packed[3])]  # what the worker receives
    assert torch.equal(unpack_tensor(wire), t) and unpack_tensor(wire).dtype == dtype
    assert torch.equal(rebuild_weights([("w", wire)])[0][1], t)


class _EngineModel(torch.nn.Module):
    """An engine's model as a worker sees it: vLLM's fused parameter names, `packed_modules_mapping`."""

    packed_modules_mapping = PACKED

    def __init__(self, fused: dict[str, torch.Tensor]):
        super().__init__()
        self._names = list(fused)
        for i, t in enumerate(fused.values()):
            self.register_parameter(f"p{i}", torch.nn.Parameter(t, requires_grad=False))

    def named_parameters(self, *args, **kwargs):
        return iter([(n, getattr(self, f"p{i}")) for i, n in enumerate(self._names)])


class _InProcessLLM:
    """vLLM's `LLM` cannot run here (no GPU): this stands in for its RPC and cache surface only, calling
    the real worker extension's methods in-process on a fused model, and records what reached it."""

    def __init__(self, model: torch.nn.Module, extension: type):
        self.worker = extension()
        self.worker.model_runner = SimpleNamespace(get_model=lambda: model)
        self.worker.parallel_config = SimpleNamespace(tensor_parallel_size=1)
        self.calls: list[str] = []
        self.at_enqueue: list[dict[str, torch.Tensor]] = []
        self.salts: list[set[str]] = []
        self.model = model
        self.llm_engine = SimpleNamespace(has_unfinished_requests=lambda: False)
        self.model_config = SimpleNamespace(max_model_len=64)

    def collective_rpc(self, method, args=()):
        self.calls.append(method)
        return [getattr(self.worker, method)(*args)]

    def enqueue(self, prompts, params, use_tqdm=False):
        self.at_enqueue.append({n: p.detach().clone() for n, p in self.model.named_parameters()})
        self.salts.append({p["cache_salt"] for p in prompts})
        return []


def test_engine_es_defers_restores_until_the_engine_is_read(tmp_path, monkeypatch):
    """ES restores after each member, but the engine only writes cast(θ) when it is next read: the
    next member's perturbation overwrites every selected weight anyway. Members, the center seen by
    a generation pass, and an update still equal the hf backend's weights bit for bit."""
    from vrl.generate import tiny
    from vrl.generate.vllm import VLLMGenerator
    from vrl.types import Task

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))
    model = hf_model(torch.bfloat16)
    model.save_pretrained(tmp_path)
    reference = copy.deepcopy(model)
    engine_model = _EngineModel(fuse(model))
    original = {n: p.detach().clone() for n, p in engine_model.named_parameters()}
    from vrl.generate.vllm_inplace import InPlaceExtension

    llm = _InProcessLLM(engine_model, InPlaceExtension)
    gen = VLLMGenerator(llm, tiny.build_tokenizer(), build({}).sampling, mode="perturb", model_path=str(tmp_path))
    opt = ES(ESConfig(population_size=4, sigma=0.05, exclude=["*norm*"]), seed=3)
    opt.setup(gen)
    flat = FlatParams(select_parameters(reference, ["*"], ["*norm*"]))
    names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", "lm_head.weight"]
    hf = dict(reference.named_parameters())

    def engine_equals_hf() -> bool:
        got = llm.worker.vrl_hf_weights(gen._params.hf_shapes, names)
        return all(torch.equal(got[n], hf[n].detach()) for n in names)

    variants = opt.ask()
    for v in variants:
        with gen.applied(v):
            flat.perturb(v.seed, v.sign, 0.05)
            assert engine_equals_hf()  # the member, over whatever the last member left behind
        flat.restore()
    assert "vrl_es_restore" not in llm.calls  # no member paid for a restore
    gen.generate([Task(id="t", prompt="ab")])  # a generation pass reads the engine: cast(θ) first
    assert llm.calls.count("vrl_es_restore") == 1
    for n, t in llm.at_enqueue[-1].items():
        assert torch.equal(t, original[n]), n
    gen.generate([Task(id="t", prompt="ab")])
    assert llm.calls.count("vrl_es_restore") == 1  # nothing was due the second time
    # Prefix caching: same weights, same salt (prompt KV reused); new weights, new salt (never reused).
    assert len(llm.salts[-1]) == 1 and llm.salts[-1] == llm.salts[-2]
    with gen.applied(variants[2]):
        gen.generate([Task(id="t", prompt="ab")])
    assert llm.salts[-1] != llm.salts[-2]
    gen.generate([Task(id="t", prompt="ab")])  # restored: a third salt, not the member's
    assert len({min(s) for s in llm.salts[-3:]}) == 3
    flat.perturb(variants[2].seed, variants[2].sign, 0.05)
    flat.restore()
    with pytest.raises(ValueError, match=r"1 of 2 prompts .*max_model_len=64 \(task 'long': 70 prompt tokens\)"):
        gen.generate([Task(id="ok", prompt="ab"), Task(id="long", prompt="x" * 70)])
    assert len(llm.at_enqueue) == 4  # refused before anything reached the engine

    with gen.applied(variants[0]):
        pass
    results_terms = update_terms(IterationRecord(seed=variants[0].seed, z=[1.0, -1.0, 0.5, -0.5]), True, 0.01)
    assert "update_worker_s" not in gen.counters()
    gen._params.update(results_terms)  # writes cast(θ') over the member the engine still held
    flat.update(results_terms)
    assert llm.calls.count("vrl_es_restore") == 2 and engine_equals_hf()
    assert gen.counters()["update_worker_s"] > 0  # the worker's own timing of the update, as the benchmark records it
    with gen.applied(variants[1]):
        pass
    assert gen._params.engine_weights(names)  # reading the weights flushes the due restore
    assert llm.calls.count("vrl_es_restore") == 3 and engine_equals_hf()


def test_published_weights_reach_the_engine_through_its_modes_worker_extension():
    """An engine started to sample (mode 'sample': evaluation, Modal's GRPO workers) takes ready
    tensors by checkpoint name through `LoadWeightsExtension` (here in-process, CPU tensors as bytes),
    every `sync_every` pushes; an ES engine refuses a whole-weights push with the reason."""
    from vrl.generate.vllm import VLLMGenerator, extension_for
    from vrl.generate.vllm_trained import LoadWeightsExtension
    from vrl.policy import Unsupported

    class Loader(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.loaded: list[dict[str, torch.Tensor]] = []

        def load_weights(self, weights):
            self.loaded.append(dict(weights))

    assert extension_for("sample") == extension_for("trained") == "vrl.generate.vllm_trained.LoadWeightsExtension"
    model = Loader()
    llm = _InProcessLLM(model, LoadWeightsExtension)
    gen = VLLMGenerator(llm, None, build({}).sampling, mode="sample", sync_every=2)
    first, second = {"w": torch.arange(4.0)}, {"w": torch.ones(4)}
    gen.publish(first)
    gen.publish(second)  # within sync_every: not pushed
    assert [torch.equal(m["w"], first["w"]) for m in model.loaded] == [True]
    gen.publish(second)
    assert len(model.loaded) == 2 and torch.equal(model.loaded[1]["w"], second["w"])
    assert gen.counters()["sync_s"] >= 0 and llm.calls == ["vrl_load_weights"] * 2
    with pytest.raises(Unsupported, match="started in mode 'perturb', whose weights move by ES"):
        VLLMGenerator(object(), None, build({}).sampling, mode="perturb").publish(first)


def test_a_weight_stream_reaches_the_engine_bucket_by_bucket_and_a_skipped_push_draws_nothing():
    """A `WeightStream` (ranks of a sharded model publish one) is loaded one bucket per worker call, each
    bucket drawn only after the previous one loaded (so the trainer can free it); a push `sync_every`
    skips draws nothing, leaving the stream to its owner to drain."""
    from vrl.generate.vllm import VLLMGenerator
    from vrl.generate.vllm_trained import LoadWeightsExtension
    from vrl.policy import WeightStream

    class Loader(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.loaded: list[list[str]] = []

        def load_weights(self, weights):
            self.loaded.append([n for n, _ in weights])

    model = Loader()
    llm = _InProcessLLM(model, LoadWeightsExtension)
    gen = VLLMGenerator(llm, None, build({}).sampling, mode="sample", sync_every=2)
    drawn: list[int] = []

    def buckets(pushed: bool = True):
        for i in range(3):
            assert not pushed or len(model.loaded) == i  # the previous bucket is in the engine before the next is made
            drawn.append(i)
            yield [(f"w{i}a", torch.full((2,), float(i))), (f"w{i}b", torch.ones(1))]

    gen.publish(WeightStream(buckets()))
    assert model.loaded == [["w0a", "w0b"], ["w1a", "w1b"], ["w2a", "w2b"]] and drawn == [0, 1, 2]
    drawn.clear()
    stream = WeightStream(buckets(pushed=False))
    gen.publish(stream)  # within sync_every: not pushed, nothing drawn
    assert drawn == [] and len(model.loaded) == 3
    stream.drain()
    assert drawn == [0, 1, 2] and len(model.loaded) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_weights_reach_the_engine_merged_and_the_base_stays_untouched(dtype):
    """GRPO with LoRA: the engine gets W + ΔW under the checkpoint's names (what peft's own
    merge_and_unload gives), computed out of place, so the trainable base keeps its bits."""
    peft = pytest.importorskip("peft", reason="LoRA needs peft (pip install 'vrl-core[lora]')")
    from vrl.weights.export import weights_for_engine

    model = hf_model(dtype)
    expected_names = [n for n, _ in model.named_parameters()]
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # trained adapters: B is no longer zero
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p) * 0.1)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    sent = dict(weights_for_engine(model))
    assert sorted(sent) == sorted(expected_names)
    merged = dict(copy.deepcopy(lora).merge_and_unload().named_parameters())
    for n in expected_names:
        assert torch.equal(sent[n], merged[n].detach()), n
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sent[q], base_before[q.replace("q_proj.", "q_proj.base_layer.")])  # ΔW is in
    for n, p in model.named_parameters():
        if "base_layer" in n:
            assert torch.equal(p, base_before[n]), n
    with lora.disable_adapter():  # adapters off (the GRPO reference policy): the plain base weights
        off = dict(weights_for_engine(model))
    assert torch.equal(off[q], base_before[q.replace("q_proj.", "q_proj.base_layer.")])


def test_an_engine_that_cannot_wake_after_training_says_what_to_change():
    """vLLM's wake-up OOM (what a colocated GRPO run hit on an H100 with 0.6 of the GPU for the
    engine) becomes an error naming the settings that free memory; other failures pass through."""
    from vrl.generate.vllm import VLLMGenerator

    class Sleepy:
        def __init__(self, message):
            self.message = message

        def wake_up(self, tags=None):
            raise Exception(self.message)

    gen = VLLMGenerator(Sleepy("Call to wake_up method failed: CUDA Error: out of memory at cumem_allocator.cpp:163"),
                        None, build({}).sampling, mode="trained", sleep=True)
    gen._asleep = 2
    with pytest.raises(RuntimeError, match="Lower generator.vllm.gpu_memory_utilization.*gradient_checkpointing"):
        gen._wake()
    gen.llm = Sleepy("engine core died")
    with pytest.raises(Exception, match="engine core died"):
        gen._wake()


@pytest.mark.slow
def test_vllm_backend_without_vllm_is_a_one_line_error_and_leaves_no_run(tmp_path):
    """On a machine without vLLM (this one), `--set generator.backend=vllm` says how to install it, exit 2."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    proc = subprocess.run([sys.executable, "-m", "vrl.cli", "train", "--plugin", "letters", "--iterations", "1",
                           "--set", "generator.backend=vllm", "--set", f"logging.runs_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pip install 'vrl-core[vllm]'" in errors[0] and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # the run directory was removed
