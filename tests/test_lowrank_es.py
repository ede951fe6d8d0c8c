"""Low-rank ES (es.noise=lowrank) end to end on the hf backend: the batched population sampler, the
training loop, resume, replay, a pool of engines and the Modal worker body."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from vrl.config import TrainConfig
from vrl.envs.letters import LettersEnvironment
from vrl.generate.hf import HFGenerator
from vrl.generate.vllm_lora import lora_factors
from vrl.optim.es import ES, ESHistory, iteration_update, replay, update_terms
from vrl.policy import PerturbationSpec, Unsupported, Variant
from vrl.rundir import RunDir
from vrl.runtime.local import LocalRuntime
from vrl.runtime.modal import workers
from vrl.runtime.pool import HostPool
from vrl.trainer import Trainer
from vrl.weights.factors import factors
from vrl.weights.lowrank import LowRankParams
from vrl.weights.update import FullRankUpdate, LowRankUpdate, update_from_wire

INCLUDE = ["model.layers.*proj.weight", "lm_head.weight"]  # attention/MLP projections and the (untied) output layer


class RecordingRuntime(LocalRuntime):
    """The local runtime, keeping the host it builds so the test can read the final weights."""

    def policy(self, config: Any, moves=None):
        self.built = super().policy(config, moves)
        return self.built


def _config(tmp_path: Path, name: str, iterations: int, engines: int = 1, **es: Any) -> TrainConfig:
    return TrainConfig(
        plugin="letters",
        model="tiny",
        iterations=iterations,
        tasks_per_iteration=3,
        seed=3,
        sampling={"max_new_tokens": 4, "temperature": 1.0, "batch_size": 2},
        generator={"device": "cpu", "dtype": "float32"},
        runtime={"local": {"engines": engines}},
        logging={"runs_dir": str(tmp_path), "name": name, "samples_per_iteration": 100},
        es={"population_size": 4, "sigma": 0.2, "alpha": 0.5, "noise": "lowrank", "rank": 2, "antithetic": True,
            "include": INCLUDE, **es},
    )


def _train(config: TrainConfig, run_dir: RunDir | None = None, stop_after: int | None = None) -> tuple[dict, RecordingRuntime]:
    def interrupt(metrics: dict[str, Any]) -> None:
        if stop_after is not None and metrics["iteration"] + 1 == stop_after:
            raise KeyboardInterrupt

    runtime = RecordingRuntime()
    trainer = Trainer(config, run_dir=run_dir, environment=LettersEnvironment(), runtime=runtime,
                      console=Console(file=io.StringIO()), on_iteration=interrupt)
    return trainer.run(), runtime


def _weights(host: Any) -> dict[str, torch.Tensor]:
    model = host.hosts[0].model if isinstance(host, HostPool) else host.model
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _host(sigma: float = 0.3, rank: int = 2, temperature: float = 1.0) -> HFGenerator:
    from vrl.config import build

    cfg = build({"plugin": "letters", "sampling": {"max_new_tokens": 5, "temperature": temperature, "batch_size": 2},
                 "generator": {"device": "cpu", "dtype": "float32"}})
    host = HFGenerator.from_config(cfg)
    host.perturbations(PerturbationSpec(tuple(INCLUDE), (), sigma, noise="lowrank", rank=rank))
    return host


def _key(batches) -> list:
    return sorted((c.variant, c.task_id, c.sample, c.text, tuple(c.token_ids)) for b in batches for c in b)


MEMBERS = [Variant(index=0, seed=40, sign=1), Variant(index=1, seed=40, sign=-1),
           Variant(index=2, seed=41, samples_per_task=2), Variant(index=3, seed=42)]


# -- the batched sampler ----------------------------------------------------------------------------


def test_hf_host_samples_all_lowrank_members_in_one_generate_per_prompt_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    host = _host()
    tasks = LettersEnvironment().tasks()[:3]  # two prompt batches (batch_size 2)
    calls: list[int] = []
    generate = host.model.generate
    monkeypatch.setattr(host.model, "generate", lambda **kw: calls.append(kw["input_ids"].shape[0]) or generate(**kw))
    before = _weights(host)
    got = [c for b in host.sample(tasks, [Variant(index=4), *MEMBERS], seed=9) for c in b]
    # One call for the unperturbed variant per prompt batch, then one per prompt batch for all members:
    # rows = Σ members' samples × prompts (5 × 2, then 5 × 1).
    assert calls == [2, 1, 10, 5]
    assert sorted((c.variant, c.task_id, c.sample) for c in got) == sorted(
        (v.index, t.id, j) for v in [Variant(index=4), *MEMBERS] for t in tasks for j in range(v.samples_per_task))
    by_member = {v.index: [c.token_ids for c in got if c.variant == v.index] for v in MEMBERS}
    assert len({tuple(map(tuple, x)) for x in by_member.values()}) == len(MEMBERS)  # members differ
    assert all(torch.equal(p, before[n]) for n, p in _weights(host).items())  # hooks only: θ untouched
    assert not any(m._forward_hooks for m in host.model.modules())


def test_lowrank_sampling_is_deterministic_and_independent_of_the_other_members() -> None:
    """A member's rows draw from generators seeded by (seed, task position, sample), not by their batch:
    the same call twice is identical, and each member alone (or the tasks split in shards) gives the
    same completions as the whole population in one batch."""
    host, tasks = _host(), LettersEnvironment().tasks()[:3]
    whole = _key(host.sample(tasks, MEMBERS, seed=9))
    assert whole == _key(host.sample(tasks, MEMBERS, seed=9))
    assert whole != _key(host.sample(tasks, MEMBERS, seed=10))
    alone = [c for v in MEMBERS for c in _key(host.sample(tasks, [v], seed=9))]
    assert sorted(alone) == whole
    # Shards sampled with `shard_seed` give what the whole task list gives (what a pool relies on).
    from vrl.generate.base import shard_seed

    v = MEMBERS[2]
    shards = _key(host.sample(tasks[:2], [v], seed=9)) + _key(host.sample(tasks[2:], [v], seed=shard_seed(9, 2, 2)))
    assert sorted(shards) == _key(host.sample(tasks, [v], seed=9))


def test_greedy_lowrank_rows_follow_each_members_materialised_weights() -> None:
    """Greedy decoding in one batch gives each member's tokens as its materialised weights θ + σ·A·Bᵀ/√r
    do, decoded alone (the per-row logits match within fp32 rounding; see tests/test_lowrank.py)."""
    host, tasks = _host(temperature=0.0), LettersEnvironment().tasks()[:2]
    batched = _key(host.sample(tasks, MEMBERS[:2] + MEMBERS[3:], seed=1))
    materialised = []
    for v in MEMBERS[:2] + MEMBERS[3:]:
        with host.applied(v):  # Generator.applied: LowRankParams.perturb writes the weights, then restores
            materialised += _key([host.generate(tasks, n=1, variant=v.index, seed=1)])
    assert batched == sorted(materialised)


def test_lowrank_terms_round_trip_and_a_host_refuses_full_rank_terms() -> None:
    upd = LowRankUpdate.from_members([(7, 1), (7, -1), (8, 1)], [0.5, -0.25, 0.1], alpha=0.3, rank=2)
    wire = json.loads(json.dumps(upd.to_wire()))  # what ModalPolicy stores and the worker gets back
    assert wire == {"kind": "lowrank", "rank": 2, "coeff": upd.coeff, "terms": [[7, 7500], [8, 1000]]}
    assert update_from_wire(wire) == upd
    assert not LowRankUpdate.from_members([(7, 1)], [0.0], 0.3, 2)  # nothing to apply: a host skips it
    full = FullRankUpdate(((7, 0.01), (8, -0.02)))
    assert update_from_wire(json.loads(json.dumps(full.to_wire()))) == full
    host = _host()
    with pytest.raises(ValueError, match="not low-rank terms"):
        host.update(full)


def test_a_vllm_engine_without_lora_slots_refuses_lowrank_with_the_fix() -> None:
    from vrl.config import build
    from vrl.generate.vllm import VLLMGenerator

    gen = VLLMGenerator(object(), None, build({}).sampling, mode="lowrank")  # no LoRA slots; no RPC before the refusal
    with pytest.raises(Unsupported, match=r"without LoRA slots.*needs"):
        gen._perturbable(PerturbationSpec(("*",), (), 0.1, noise="lowrank", rank=4))


def test_es_asks_for_one_lora_slot_per_member_at_a_rank_vllm_accepts() -> None:
    """ES declares its perturbations before engines start; the vllm engine gets LoRA slots for
    low-rank members only, rank rounded up to one vLLM accepts (the unused rank stays zero)."""
    from vrl.config import build
    from vrl.generate.vllm import engine_kwargs
    from vrl.optim import make_optimizer

    cfg = build({"optimizer": "es", "es": {"noise": "lowrank", "rank": 4, "population_size": 12},
                 "generator": {"backend": "vllm"}})
    needs = make_optimizer(cfg).needs()
    assert (needs.moves, needs.variants, needs.spec.noise, needs.spec.rank) == ("perturbations", 12, "lowrank", 4)
    kw = engine_kwargs(cfg, "/m", needs)
    assert (kw["enable_lora"], kw["max_loras"], kw["max_cpu_loras"], kw["max_lora_rank"]) == (True, 12, 12, 8)
    assert kw["specialize_active_lora"] is True  # LoRA kernel grids sized by the step's active members
    assert engine_kwargs(build(cfg.model_dump(), {"es": {"rank": 16}}), "/m", make_optimizer(
        build(cfg.model_dump(), {"es": {"rank": 16}})).needs())["max_lora_rank"] == 16
    full = build({"optimizer": "es", "generator": {"backend": "vllm"}})
    assert "enable_lora" not in engine_kwargs(full, "/m", make_optimizer(full).needs())
    grpo = build({"optimizer": "grpo", "generator": {"backend": "vllm"}})
    assert "enable_lora" not in engine_kwargs(grpo, "/m", make_optimizer(grpo).needs())
    assert "enable_lora" not in engine_kwargs(cfg, "/m")  # eval: sampling only


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_each_rank_of_a_torchrun_launch_gets_lora_slots_for_its_share_of_the_members(
        monkeypatch: pytest.MonkeyPatch, ranks: int) -> None:
    """Under torchrun the members are dealt over the ranks, so each rank's engine needs a slot per member
    of its share, not of the population: vLLM's LoRA kernels launch blocks for every slot, used or not
    (the 2-rank engines of session 22 had 30 slots for 15 members). No rank is ever dealt more."""
    from vrl.config import build
    from vrl.generate.vllm import engine_kwargs
    from vrl.optim import make_optimizer
    from vrl.policy import Variant, deal
    from vrl.types import Task

    monkeypatch.setenv("WORLD_SIZE", str(ranks))
    for population in (2, 4, 12, 13, 30):
        cfg = build({"optimizer": "es", "es": {"noise": "lowrank", "rank": 4, "population_size": population},
                     "generator": {"backend": "vllm"}})
        slots = make_optimizer(cfg).needs().variants
        assert slots == -(-population // ranks)
        assert engine_kwargs(cfg, "/m", make_optimizer(cfg).needs())["max_loras"] == slots
        variants = [Variant(index=i, seed=i) for i in range(population)]
        for tasks in (1, 8):
            work = deal([Task(id=f"t{i}", prompt="p") for i in range(tasks)], variants, 0, ranks)
            assert max(len(v) for calls in work for _, v, _ in calls) <= slots
            assert {v.index for calls in work for _, vs, _ in calls for v in vs} == set(range(population))


@pytest.mark.parametrize(("include", "exclude", "targets"), [
    (["*"], [], None),  # every kind of linear layer: vLLM's default (lm_head is never a LoRA target)
    (["*"], ["lm_head*"], None),
    (["*.mlp.*"], [], ["down_proj", "gate_proj", "up_proj"]),
    (["*"], ["*.mlp.*", "lm_head*"], ["k_proj", "o_proj", "q_proj", "v_proj"]),
    (["*.q_proj.weight"], [], ["q_proj"]),  # vLLM wraps the fused qkv_proj, whose other slices stay zero
])
def test_the_engine_puts_lora_layers_on_the_selected_kinds_of_module_only(include, exclude, targets) -> None:
    """An es.include narrower than the model's linear layers restricts the engine's LoRA layers to the
    selected kinds of module (`lora_target_modules`), so the rest runs no LoRA kernels per step."""
    from vrl.config import build
    from vrl.generate.vllm import engine_kwargs
    from vrl.optim import make_optimizer

    cfg = build({"optimizer": "es", "es": {"noise": "lowrank", "rank": 8, "include": include, "exclude": exclude},
                 "generator": {"backend": "vllm"}})
    assert engine_kwargs(cfg, "/m", make_optimizer(cfg).needs()).get("lora_target_modules") == targets


def test_lora_slices_place_each_weight_in_its_fused_slice_and_refuse_what_lora_cannot_serve() -> None:
    from vrl.generate.vllm_slots import lora_slices
    from vrl.generate.vllm_worker import engine_layout

    hf = {"model.layers.0.self_attn.q_proj.weight": [8, 4], "model.layers.0.self_attn.k_proj.weight": [2, 4],
          "model.layers.0.self_attn.v_proj.weight": [2, 4], "model.layers.0.mlp.down_proj.weight": [4, 6],
          "lm_head.weight": [10, 4]}
    engine = {"model.layers.0.self_attn.qkv_proj.weight": [12, 4], "model.layers.0.mlp.down_proj.weight": [4, 6],
              "lm_head.weight": [16, 4]}
    layout = engine_layout(hf, engine, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    modules = {"model.layers.0.self_attn.qkv_proj": (8, 2, 2), "model.layers.0.mlp.down_proj": (4,)}
    served = {n: s for n, s in layout.items() if not n.startswith("lm_head")}
    slices = lora_slices(served, modules)
    assert [(s.module.rsplit(".", 1)[-1], s.index) for s in slices.values()] == [
        ("qkv_proj", 0), ("qkv_proj", 1), ("qkv_proj", 2), ("down_proj", 0)]
    with pytest.raises(ValueError, match=r"does not serve 1 selected weight.*lm_head\.weight.*down_proj, qkv_proj.*es\.exclude"):
        lora_slices(layout, modules)
    # A slice whose rows do not match the weight's (another split of the fused tensor) is not guessed.
    with pytest.raises(ValueError, match="k_proj"):
        lora_slices(served, {**modules, "model.layers.0.self_attn.qkv_proj": (8, 4)})


def test_lora_factors_multiply_to_the_member_perturbation() -> None:
    """lora_b·lora_a equals σ·sign·A·Bᵀ/√r (exact fp32 factors; the two scale roundings differ < 2⁻¹⁴)."""
    members = [(17, 1), (17, -1), (3, 1)]
    la, lb = lora_factors(members, "w", (6, 5), 4, 0.02)
    assert la.shape == (3, 4, 5) and lb.shape == (3, 6, 4) and la.dtype == lb.dtype == torch.float32
    for p, (seed, sign) in enumerate(members):
        a, b = factors(seed, "w", (6, 5), 4)
        exact = sign * 0.02 * (a.double() @ b.double().T) / 2
        got = lb[p].double() @ la[p].double()
        assert (got - exact).abs().max() <= 2**-13 * exact.abs().max()
    assert torch.equal(lb[0], -lb[1]) and torch.equal(la[0], la[1])  # antithetic: same factors, opposite sign


def test_engine_writes_each_member_into_its_lora_slot_as_the_reference_factors(monkeypatch: pytest.MonkeyPatch) -> None:
    """`LowRankEngine.load_members` (what the vLLM worker runs; here on CPU stacks shaped like vLLM's
    lora_a_stacked (slots×1×R×n) and lora_b_stacked (slots×1×m×R)) writes cast(lora_factors) of every
    matrix into each member's slot, zeros beyond es.rank and leaves the other slots alone, also when
    the matrices of one shape are generated together and in several chunks."""
    from vrl.generate.vllm_slots import LowRankEngine

    shapes = {"l0.q": (6, 5), "l0.down": (3, 7), "l1.q": (6, 5), "l1.down": (3, 7), "l2.q": (6, 5)}
    views = {n: torch.randn(s).to(torch.bfloat16) for n, s in shapes.items()}
    big_rank, rank, slots = 8, 4, [4, 0, 2]
    layers = {n: (torch.full((5, 1, big_rank, s[1]), 7.0, dtype=torch.bfloat16),
                  torch.full((5, 1, s[0], big_rank), 7.0, dtype=torch.bfloat16)) for n, s in shapes.items()}
    engine = LowRankEngine(views, layers, rank, slots)
    members = [(11, 1), (11, -1)]  # two of the three slots
    monkeypatch.setattr(LowRankEngine, "CHUNK", len(members) * rank * 6 * 2)  # two q matrices per chunk
    engine.load_members(members, 0.02)
    for name, shape in shapes.items():
        ref_a, ref_b = lora_factors(members, name, shape, rank, 0.02)
        a_stack, b_stack = layers[name]
        for p, slot in enumerate(slots[:2]):
            assert torch.equal(a_stack[slot, 0, :rank], ref_a[p].to(torch.bfloat16)), (name, p)
            assert torch.equal(b_stack[slot, 0, :, :rank], ref_b[p].to(torch.bfloat16)), (name, p)
            assert not a_stack[slot, 0, rank:].any() and not b_stack[slot, 0, :, rank:].any()
        others = [s for s in range(5) if s not in slots[:2]]
        assert (a_stack[others] == 7).all() and (b_stack[others] == 7).all()


def test_the_slot_kernel_is_used_only_on_stacks_laid_out_as_it_addresses_them() -> None:
    """`lowrank_triton.lora_slots` writes slots by pointer arithmetic (S×1×R×n, S×1×m×R, contiguous):
    any other layout must fall back to the indexing torch path, or it would write into other slots."""
    from vrl.generate.vllm_slots import LowRankEngine

    views = {"q": torch.zeros(6, 5), "down": torch.zeros(3, 7)}

    def stacks(slots=4, rank=8, **changed):
        out = {n: (torch.zeros(slots, 1, rank, s[1]), torch.zeros(slots, 1, s[0], rank)) for n, s in
               {"q": (6, 5), "down": (3, 7)}.items()}
        out.update(changed)
        return out

    assert LowRankEngine.kernel_layout(views, stacks())
    assert not LowRankEngine.kernel_layout(views, stacks(down=(torch.zeros(4, 2, 8, 7), torch.zeros(4, 2, 3, 8))))
    assert not LowRankEngine.kernel_layout(views, stacks(down=(torch.zeros(4, 1, 16, 7), torch.zeros(4, 1, 3, 16))))
    assert not LowRankEngine.kernel_layout(views, stacks(down=(torch.zeros(4, 1, 7, 8).transpose(2, 3),
                                                                torch.zeros(4, 1, 3, 8))))
    assert not LowRankEngine.kernel_layout(views, stacks(down=(torch.zeros(4, 1, 8, 7, dtype=torch.bfloat16),
                                                                torch.zeros(4, 1, 3, 8, dtype=torch.bfloat16))))
    assert not LowRankEngine.kernel_layout(views, stacks(down=(torch.zeros(4, 1, 8, 6), torch.zeros(4, 1, 3, 8))))


# -- the training loop ------------------------------------------------------------------------------


def test_vrl_train_lowrank_resumes_bit_exactly_and_replays_the_history(tmp_path: Path) -> None:
    straight, rt_straight = _train(_config(tmp_path, "straight", 4))
    assert straight["status"] == "finished"
    first, _ = _train(_config(tmp_path, "resumed", 4), stop_after=2)
    assert first["status"] == "interrupted" and first["iterations_completed"] == 2
    second, rt_resumed = _train(_config(tmp_path, "resumed", 4), run_dir=RunDir.open(tmp_path / "resumed"))
    assert second["status"] == "finished" and second["iterations_completed"] == 4

    a, b = _weights(rt_straight.built), _weights(rt_resumed.built)
    assert all(torch.equal(a[n], b[n]) for n in a)
    history = ESHistory.read(tmp_path / "straight" / "es_history.json")
    assert (history.perturbation, history.rank) == ("lowrank", 2)
    assert any(z != 0 for r in history.iterations for z in r.z)
    assert (tmp_path / "straight" / "es_history.json").read_text() == (tmp_path / "resumed" / "es_history.json").read_text()
    fresh = _host(sigma=0.2)  # θ₀ of the same model
    theta0 = _weights(fresh)
    changed = {n for n in a if not torch.equal(a[n], theta0[n])}
    assert changed and all(n.endswith("proj.weight") or n == "lm_head.weight" for n in changed)  # matrices only
    # ES.load-style replay onto a fresh host: the history alone rebuilds θ₄ bit for bit.
    replay(history, fresh)
    assert all(torch.equal(p, a[n]) for n, p in _weights(fresh).items())
    # ... and onto bare LowRankParams, in two pieces; the full-rank replay refuses a low-rank history.
    model = _host(sigma=0.2).model
    params = LowRankParams.from_model(model, INCLUDE, [], 2)
    replay(history, params, 0, 1)
    replay(history, params, 1)
    assert all(torch.equal(p, a[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="low-rank noise"):
        replay(history, params.flat)
    with pytest.raises(ValueError, match="full-rank noise"):
        replay(history.model_copy(update={"perturbation": "full", "rank": None}), params)
    # Full-rank terms are unchanged by this mode's existence (histories and replays stay bit-identical).
    full = history.model_copy(update={"perturbation": "full", "rank": None})
    assert iteration_update(full, full.iterations[0]) == update_terms(full.iterations[0], True, full.alpha)


def test_two_hf_engines_write_the_same_lowrank_run_as_one(tmp_path: Path) -> None:
    rows = {}
    for engines in (1, 2):
        _train(_config(tmp_path, f"e{engines}", 2, engines=engines))
        run = tmp_path / f"e{engines}"
        samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
        rows[engines] = (
            [{k: r[k] for k in ("reward_mean", "tokens")} for r in RunDir(run).metrics()],
            sorted(json.dumps({**s, "verdict": {**s["verdict"], "elapsed_s": None}}, sort_keys=True) for s in samples),
            ESHistory.read(run / "es_history.json").iterations,
        )
    assert rows[1] == rows[2]


def test_modal_worker_body_replays_a_lowrank_update_list_like_the_local_host(tmp_path: Path) -> None:
    """`workers.sample` (the Modal GPU worker), given the low-rank update list as JSON, samples each member
    exactly as the local host holding θ_2 does with all members batched."""
    config = _config(tmp_path, "run", 2)
    _train(config)
    history = ESHistory.read(tmp_path / "run" / "es_history.json")
    updates = json.loads(json.dumps([iteration_update(history, r).to_wire() for r in history.iterations]))
    es = config.es
    spec = PerturbationSpec(tuple(es.include), tuple(es.exclude), es.sigma, noise="lowrank", rank=es.rank)
    engine = workers.engine_config(config)
    tasks = LettersEnvironment().tasks()[:3]
    seed = random.Random(5).randrange(2**31)

    host = HFGenerator.from_config(config)
    lowrank_es = ES(config.es, seed=config.seed, base={"model": "tiny", "revision": None})
    lowrank_es.setup(host)
    lowrank_es.load(tmp_path / "run", 2)
    expected = _key(host.sample(tasks, MEMBERS, seed=seed))
    got = []
    for v in MEMBERS:
        out = workers.sample(workers.variant_to_wire(v), 0, len(tasks), config=engine, tasks=workers.tasks_to_wire(tasks),
                             seed=seed, spec=workers.spec_to_wire(spec), updates=updates)
        got.append([workers.completion_from_wire(c) for c in out])
    assert len(workers._WARM.applied) == 2 and workers._WARM.spec == spec
    assert _key(got) == expected
