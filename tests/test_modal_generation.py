"""The Modal GPU function bodies, run here with Modal's `.local()` on the tiny model.

No Modal account exists here, so the functions run in this process (the app is built for real;
`.local()` executes the declared method, `@modal.enter` included). The results must be identical to
the local runtime's for the same seeds: ES member completions, the whole ES run's history and
samples, and GRPO generation shards before and after a weight sync through the "Volume" (a directory).
"""

from __future__ import annotations

import json

import pytest
import torch

from vrl.config import build
from vrl.envs.letters import LettersEnvironment
from vrl.generate.hf import HFGenerator
from vrl.optim.es import ES, ESHistory, update_terms
from vrl.policy import HostNeeds, PerturbationSpec, Unsupported, Variant
from vrl.runtime.local import LocalRuntime
from vrl.runtime.modal import workers
from vrl.runtime.modal.app import build_app
from vrl.runtime.modal.runtime import ModalRuntime
from vrl.trainer import Trainer

# vrl's own deprecations fail these tests. Modal's `.local()` warns that a local call has no mounted Volume:
# the tests marked `local_bodies` run worker bodies in this process on purpose (their Volume is a directory
# passed to them), so that one warning, and nothing else, is ignored there.
pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning:vrl")
local_bodies = pytest.mark.filterwarnings("ignore:The .* function is executing locally:UserWarning")

BASE = {
    "plugin": "countdown",
    "iterations": 2,
    "tasks_per_iteration": 3,
    "es": {"population_size": 4, "sigma": 0.05},
    "generator": {"dtype": "float32", "device": "cpu"},
    "sampling": {"max_new_tokens": 12, "batch_size": 2},
}


def modal_local(cfg, tmp_path):
    return ModalRuntime(cfg, app=build_app(cfg), execute="local", volume_root=tmp_path / "volume")


def run_pair(tmp_path, extra=None):
    """The same ES run twice: local runtime, then the Modal runtime executing its bodies locally."""
    layers = [BASE, {"logging": {"runs_dir": str(tmp_path)}}, extra or {}]
    local_cfg = build(*layers, {"logging": {"name": "local"}})
    modal_cfg = build(*layers, {"logging": {"name": "modal"}, "runtime": {"kind": "modal", "modal": {"verify_in": "local"}}})
    Trainer(local_cfg, environment=LettersEnvironment(), runtime=LocalRuntime()).run()
    runtime = modal_local(modal_cfg, tmp_path)
    Trainer(modal_cfg, environment=LettersEnvironment(), runtime=runtime).run()
    return tmp_path / "local", tmp_path / "modal", runtime


def _samples(path):
    rows = [json.loads(line) for line in (path / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        r["verdict"].pop("elapsed_s")
    return rows


@local_bodies
def test_es_run_on_modal_bodies_matches_the_local_runtime(tmp_path):
    local, remote, _ = run_pair(tmp_path)
    h_local, h_remote = ESHistory.read(local / "es_history.json"), ESHistory.read(remote / "es_history.json")
    assert h_local.iterations == h_remote.iterations
    assert any(z != 0 for r in h_local.iterations for z in r.z)  # rewards differed: the updates were real
    assert h_local.base == h_remote.base
    assert _samples(local) == _samples(remote)
    m_local = [json.loads(x) for x in (local / "metrics.jsonl").read_text().splitlines()]
    m_remote = [json.loads(x) for x in (remote / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(m_local, m_remote, strict=True):
        for key in ("reward_mean", "reward_max", "tokens", "es/member_reward_mean", "es/member_reward_std"):
            assert a[key] == b[key], key


def _worker_call(worker, variant, tasks, cfg, seed, spec=None, updates=None, weights=None, start=0, stop=None):
    engine = workers.engine_config(cfg)
    out = worker.sample.local(workers.variant_to_wire(variant), start, len(tasks) if stop is None else stop,
                              config=engine, tasks=workers.tasks_to_wire(tasks), seed=seed,
                              spec=workers.spec_to_wire(spec), weights=weights,
                              updates=None if updates is None else [u.to_wire() for u in updates])
    return [workers.completion_from_wire(c) for c in out]


def _key(cs):
    return [(c.task_id, c.sample, c.variant, c.text, c.token_ids) for c in cs]


@local_bodies
def test_worker_sample_body_equals_the_local_host_for_each_member(tmp_path):
    """GPUWorker.sample (the Modal method's body, run with .local()) given the run's updates gives each
    member's completions exactly as the local host does after ES.load."""
    local, _, _ = run_pair(tmp_path, {"iterations": 2})
    history = ESHistory.read(local / "es_history.json")
    cfg = build(BASE, {"runtime": {"kind": "modal"}})
    worker = build_app(cfg).worker(str(tmp_path / "volume"))

    host = HFGenerator.from_config(cfg)
    es = ES(cfg.es, seed=cfg.seed, base={"model": "tiny", "revision": None})
    es.setup(host)
    es.load(local, 2)  # θ_2, replayed from the history
    spec = PerturbationSpec(tuple(cfg.es.include), tuple(cfg.es.exclude), cfg.es.sigma)
    updates = [update_terms(r, history.antithetic, history.alpha) for r in history.iterations]
    tasks = LettersEnvironment().tasks("train")[:3]
    for index, (seed, sign) in enumerate([(11, 1), (12, 1), (11, -1)]):
        v = Variant(index=index, samples_per_task=2, seed=seed, sign=sign)
        expected = [c for batch in host.sample(tasks, [v], seed=5) for c in batch]
        got = _worker_call(worker, v, tasks, cfg, 5, spec, updates)
        assert _key(got) == _key(expected) and {c.variant for c in got} == {index}


@local_bodies
def test_warm_worker_replays_only_the_new_update(tmp_path):
    """A second call with one more update reuses the warm host and applies just that update."""
    local, _, _ = run_pair(tmp_path)
    history = ESHistory.read(local / "es_history.json")
    updates = [update_terms(r, history.antithetic, history.alpha) for r in history.iterations]
    cfg = build(BASE, {"runtime": {"kind": "modal"}})
    worker = build_app(cfg).worker(str(tmp_path / "volume"))
    spec = PerturbationSpec(tuple(cfg.es.include), tuple(cfg.es.exclude), cfg.es.sigma)
    tasks = LettersEnvironment().tasks("train")[:1]
    member = Variant(index=0, seed=7)
    _worker_call(worker, member, tasks, cfg, 1, spec, updates[:1])
    host = workers._WARM.host
    applied: list = []
    original = host.update
    host.update = lambda terms: (applied.append(terms), original(terms))[1]
    try:
        _worker_call(worker, member, tasks, cfg, 1, spec, updates)
    finally:
        host.update = original
    assert workers._WARM.host is host  # the warm model was kept
    assert applied == [updates[1]] and len(workers._WARM.applied) == 2


@local_bodies
def test_es_members_are_one_call_each_and_stream_as_they_finish(tmp_path):
    """One sample() of the Modal policy makes one worker call per member; each member's completions
    arrive as its own batch (as soon as that call returns), tagged with the member's index."""
    from vrl.types import Result, Verdict

    cfg = build(BASE, {"runtime": {"kind": "modal"}})
    runtime = modal_local(cfg, tmp_path)
    policy = runtime.policy(cfg, HostNeeds("perturbations"))
    es = ES(cfg.es, seed=cfg.seed, base={"model": "tiny", "revision": None})
    es.setup(policy)
    tasks = LettersEnvironment().tasks("train")[:2]
    for iteration in range(2):
        variants = es.ask()
        batches = list(policy.sample(tasks, variants, seed=iteration))
        assert [{c.variant for c in b} for b in batches] == [{v.index} for v in variants]
        assert all(len(b) == 2 for b in batches)
        assert policy.calls == (iteration + 1) * len(variants)
        es.tell([Result(task=tasks[i % 2], completion=c, verdict=Verdict.ok(), reward=float(c.variant))
                 for b in batches for i, c in enumerate(b)])
    assert len(policy.updates) == 2 and all(policy.updates)
    runtime.close()


def test_the_modal_policy_keeps_no_weights_and_refuses_snapshots(tmp_path):
    cfg = build(BASE, {"runtime": {"kind": "modal"}})
    runtime = ModalRuntime(cfg, app=build_app(cfg), execute="local")
    policy = runtime.policy(cfg, HostNeeds("perturbations"))
    with pytest.raises(RuntimeError, match="perturbations"):
        next(policy.sample(LettersEnvironment().tasks("train")[:1], [Variant(index=0, seed=1)]))
    es = ES(cfg.es, seed=cfg.seed, base={"model": "tiny", "revision": None})
    es.setup(policy)
    assert es.history.base.dtype == "float32" and policy._trainable is None
    with pytest.raises(Unsupported, match="keeps the weights on its workers"):
        policy.state()
    snap = build(BASE, {"runtime": {"kind": "modal"}, "es": {"snapshot_every": 2}})
    with pytest.raises(ValueError, match="es.snapshot_every=0"):
        ES(snap.es, base={"model": "tiny"}).setup(runtime.policy(snap, HostNeeds("perturbations")))
    runtime.close()


@local_bodies
def test_remote_es_resume_continues_the_history_exactly(tmp_path):
    layers = [BASE, {"logging": {"runs_dir": str(tmp_path), "name": "r"}, "runtime": {"kind": "modal", "modal": {"verify_in": "local"}}}]
    cfg1 = build(*layers, {"iterations": 1})
    Trainer(cfg1, environment=LettersEnvironment(), runtime=modal_local(cfg1, tmp_path)).run()
    from vrl.rundir import RunDir

    cfg2 = build(*layers, {"iterations": 2})
    Trainer(cfg2, run_dir=RunDir.open(tmp_path / "r"), environment=LettersEnvironment(),
            runtime=modal_local(cfg2, tmp_path)).run()
    local, _, _ = run_pair(tmp_path / "ref")
    assert ESHistory.read(tmp_path / "r" / "es_history.json").iterations == ESHistory.read(local / "es_history.json").iterations


@local_bodies
def test_grpo_shards_match_local_generation_before_and_after_publishing(tmp_path):
    cfg = build(BASE, {"optimizer": "grpo", "logging": {"name": "g"}, "runtime": {"kind": "modal"},
                       "sampling": {"batch_size": 2, "max_new_tokens": 10}})
    runtime = modal_local(cfg, tmp_path)
    policy = runtime.policy(cfg, HostNeeds("trained"))
    trained = policy.trainable().model
    local = HFGenerator.from_config(cfg)
    tasks = LettersEnvironment().tasks("train")[:5]

    def same(a, b):
        return [(c.task_id, c.sample, c.text, c.token_ids, c.prompt_token_ids) for c in a] == [
            (c.task_id, c.sample, c.text, c.token_ids, c.prompt_token_ids) for c in b
        ]

    def sampled(seed, n):
        return [c for b in policy.sample(tasks, [Variant(index=0, samples_per_task=n)], seed=seed) for c in b]

    assert len(list(policy.sample(tasks, [Variant(index=0, samples_per_task=2)], seed=3))) == 3  # shards of 2
    assert same(sampled(3, 2), local.generate(tasks, n=2, seed=3))
    with torch.no_grad():  # an "update": both copies move the same way
        for p_remote, p_local in zip(trained.parameters(), local.model.parameters()):
            delta = torch.randn(p_remote.shape, generator=torch.Generator().manual_seed(p_remote.numel())) * 0.5
            p_remote.add_(delta)
            p_local.add_(delta)
    before = sampled(9, 1)
    policy.publish(trained)
    after = sampled(9, 1)
    weights = sorted((tmp_path / "volume" / "runs" / "g" / "weights").glob("*.safetensors"))
    assert [w.name for w in weights] == ["v000001.safetensors"]
    assert same(after, local.generate(tasks, n=1, seed=9))
    assert not same(before, after)  # the shard worker really loaded the new weights
    runtime.close()


def test_offline_volume_cache_serves_a_model_by_id(tmp_path, monkeypatch):
    """What `vrl modal prepare` leaves on the Volume (an HF cache) loads by model id with the Hub off."""
    from vrl.generate import tiny

    snapshot = tmp_path / "hf" / "models--acme--tiny" / "snapshots" / ("0" * 40)
    tiny.build_model().save_pretrained(snapshot)
    tiny.build_tokenizer().save_pretrained(snapshot)
    (tmp_path / "hf" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hf" / "models--acme--tiny" / "refs" / "main").write_text("0" * 40)
    info = workers.prepare_model("acme/tiny", None, tmp_path)  # cached: nothing is downloaded
    assert info["downloaded"] is False and "model.safetensors" in info["files"] and info["bytes"] > 0
    assert workers.volume_env(tmp_path) == {"HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
                                            "TRANSFORMERS_OFFLINE": "1"}


@local_bodies
def test_detached_orchestrator_body_writes_to_the_volume_and_resumes(tmp_path):
    """`orchestrate` (the detached loop's body) keeps the run on the Volume and continues it exactly;
    `vrl modal resume` reads the recorded config back from the Volume (read here from the directory
    that stands in for it: no Modal account exists here)."""
    from vrl.config import dump
    from vrl.runtime.modal.detached import orchestrate
    from vrl.runtime.modal.launch import recorded_config

    volume = tmp_path / "volume"
    layers = [BASE, {"logging": {"name": "d"}, "runtime": {"kind": "modal", "modal": {"verify_in": "local"}}}]
    first = build(*layers, {"iterations": 1})
    worker = build_app(first).worker(str(volume))
    commits: list = []
    summary = orchestrate(dump(first), volume, worker, on_iteration=commits.append, execute="local")
    assert summary["status"] == "finished" and len(commits) == 1

    def read(name, path):
        assert name == "vrl"
        return (volume / path).read_bytes()

    resumed = recorded_config("d", "vrl", 2, read=read)
    assert resumed.iterations == 2 and resumed.runtime.modal.detach and resumed.es == first.es
    with pytest.raises(ValueError, match="recorded runtime.modal.volume='vrl'"):
        recorded_config("d", "other", 2, read=lambda _v, p: (volume / p).read_bytes())
    summary = orchestrate(dump(resumed), volume, worker, resume=True, execute="local")
    run = volume / "runs" / "d"
    assert summary["iterations_completed"] == 2
    assert len(ESHistory.read(run / "es_history.json").iterations) == 2
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
