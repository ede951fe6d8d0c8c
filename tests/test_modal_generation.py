"""The Modal GPU function bodies, run here with Modal's `.local()` on the tiny model.

No Modal account exists here, so the functions run in this process (the app is built for real;
`.local()` executes the declared method, `@modal.enter` included). The results must be identical to
the local runtime's for the same seeds: ES member completions, the whole ES run's history and
samples, and GRPO generation shards before and after a weight sync through the "Volume" (a directory).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vrl.config import ConfigError, build
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


def update_log(root, updates, snapshot_every=0, store="runs/w/es"):
    """The orchestrator's update log of `updates`, its files written under `root` (the Volume)."""
    def put(files):
        for rel, data in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)

    log = workers.UpdateLog(store, put, snapshot_every)
    for u in updates:
        log.append(u.to_wire())
    log.flush()
    return log


def _worker_call(worker, variant, tasks, cfg, seed, spec=None, updates=None, weights=None, start=0, stop=None,
                 log=None, write_snapshot=False, full=False):
    """One GPUWorker.sample call as ModalPolicy makes it: the ES state as `UpdateLog.head()` (of `log`, or of
    `updates` written to the worker's Volume directory)."""
    engine = workers.engine_config(cfg)
    if log is None and updates is not None:
        log = update_log(Path(worker.root), updates)
    out = worker.sample.local(workers.variant_to_wire(variant), start, len(tasks) if stop is None else stop,
                              write_snapshot, config=engine, tasks=workers.tasks_to_wire(tasks), seed=seed,
                              spec=workers.spec_to_wire(spec), weights=weights, es=None if log is None else log.head())
    completions = [workers.completion_from_wire(c) for c in out["completions"]]
    return (completions, out) if full else completions


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
    workers._fresh_host(TrainConfigOf(cfg), "other", None)  # another run's container: nothing of this one
    _worker_call(worker, member, tasks, cfg, 1, spec, updates[:1])
    host = workers._WARM.host
    applied: list = []
    original = host.update
    host.update = lambda terms: (applied.append(terms), original(terms))[1]
    try:
        _, out = _worker_call(worker, member, tasks, cfg, 1, spec, updates, full=True)
    finally:
        host.update = original
    assert workers._WARM.host is host  # the warm model was kept
    assert applied == [updates[1]] and workers._WARM.count == 2 and out["replayed"] == 1


def TrainConfigOf(cfg):  # noqa: N802 - reads as the type it returns
    from vrl.config import TrainConfig

    return TrainConfig.model_validate(workers.engine_config(cfg))


def test_a_member_call_carries_only_the_newest_update():
    """Issue 25 defect 9: the ES state a call carries is the newest update and digests, whatever the
    iteration count (before: every update since the base, in every call)."""
    from vrl.weights.update import FullRankUpdate

    log = workers.UpdateLog("runs/r/es", lambda files: None)
    sizes = []
    for i in range(50):
        log.append(FullRankUpdate(tuple((10**6 + 10 * i + j, 0.5 + j) for j in range(8))).to_wire())
        sizes.append(len(json.dumps(log.head())))
    assert len(log.head()["recent"]) == 1 and log.head()["count"] == 50
    assert max(sizes[1:]) - min(sizes[1:]) <= 1  # from the second update on: a digit of the count, nothing more


@local_bodies
def test_a_cold_worker_starts_from_the_theta_snapshot_and_matches_a_full_replay(tmp_path):
    """Issue 25 item 4: a worker writes θ after K updates to the Volume; a cold worker loads it and
    replays only the updates after it, and samples exactly what a worker that replayed everything does."""
    local, _, _ = run_pair(tmp_path, {"iterations": 3})
    history = ESHistory.read(local / "es_history.json")
    updates = [update_terms(r, history.antithetic, history.alpha) for r in history.iterations]
    assert len(updates) == 3 and updates[0] and updates[1]  # θ moved before the snapshot
    cfg = build(BASE, {"runtime": {"kind": "modal"}})
    spec = PerturbationSpec(tuple(cfg.es.include), tuple(cfg.es.exclude), cfg.es.sigma)
    tasks = LettersEnvironment().tasks("train")[:2]
    member = Variant(index=0, samples_per_task=2, seed=5, sign=-1)
    root = tmp_path / "volume"
    worker = build_app(cfg).worker(str(root))

    log = update_log(root, updates[:2], snapshot_every=2)
    assert log.snapshot_due()
    _, out = _worker_call(worker, member, tasks, cfg, 3, spec, log=log, write_snapshot=True, full=True)
    assert out["snapshot"] == 2 and workers.snapshot_file(root / log.store, 2).exists()
    log.append(updates[2].to_wire())  # (the call carries no word of the snapshot: the worker finds it)
    log.flush()

    workers._fresh_host(TrainConfigOf(cfg), "cold", None)  # a cold container
    from_snapshot, out = _worker_call(worker, member, tasks, cfg, 3, spec, log=log, full=True)
    assert out["replayed"] == 1  # the snapshot, then the one update after it

    workers._fresh_host(TrainConfigOf(cfg), "cold", None)
    log_without = update_log(tmp_path / "volume", updates, store="runs/full/es")
    replayed, out = _worker_call(worker, member, tasks, cfg, 3, spec, log=log_without, full=True)
    assert out["replayed"] == 3
    assert _key(from_snapshot) == _key(replayed)


@local_bodies
def test_a_history_that_does_not_extend_the_warm_one_starts_over(tmp_path):
    """A rewound run (same store, another last update) is caught by the digests: the worker rebuilds from
    the base model and replays the Volume's history, never applying the new update on top of the old."""
    local, _, _ = run_pair(tmp_path)
    history = ESHistory.read(local / "es_history.json")
    updates = [update_terms(r, history.antithetic, history.alpha) for r in history.iterations]
    cfg = build(BASE, {"runtime": {"kind": "modal"}})
    spec = PerturbationSpec(tuple(cfg.es.include), tuple(cfg.es.exclude), cfg.es.sigma)
    tasks = LettersEnvironment().tasks("train")[:1]
    root = tmp_path / "volume"
    worker = build_app(cfg).worker(str(root))
    member = Variant(index=0, seed=9)
    _worker_call(worker, member, tasks, cfg, 1, spec, log=update_log(root, updates, store="runs/x/es"))
    rewound = [updates[1], updates[0]]  # same count, another history
    got, out = _worker_call(worker, member, tasks, cfg, 1, spec, log=update_log(root, rewound, store="runs/x/es"),
                            full=True)
    assert out["replayed"] == 2 and workers._WARM.digest == update_log(root, rewound, store="runs/x/es").head()["digest"]


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


@local_bodies
def test_low_rank_members_share_a_worker_call_and_sample_what_one_per_call_does(tmp_path):
    """Issue 25 item 4: with es.noise=lowrank a worker call samples several members (one engine pass on
    vllm), as many as share runtime.modal.max_containers; the completions are those of one member per call."""
    layers = [BASE, {"es": {"noise": "lowrank", "rank": 2}, "runtime": {"kind": "modal", "modal": {"max_containers": 2}}}]
    tasks = LettersEnvironment().tasks("train")[:2]
    got = {}
    for per_call in (0, 1):
        cfg = build(*layers, {"logging": {"name": f"lr{per_call}"}, "runtime": {"modal": {"members_per_call": per_call}}})
        runtime = modal_local(cfg, tmp_path / f"v{per_call}")
        policy = runtime.policy(cfg, HostNeeds("perturbations"))
        es = ES(cfg.es, seed=cfg.seed, base={"model": "tiny", "revision": None})
        es.setup(policy)
        variants = es.ask()
        assert len(variants) == 4
        batches = list(policy.sample(tasks, variants, seed=3))
        assert sorted(c.variant for b in batches for c in b[:1]) == [v.index for v in variants]
        got[per_call] = (policy.calls, sorted(_key([c for b in batches for c in b])))
        runtime.close()
    assert got[0][0] == 2 and got[1][0] == 4  # two members per call by default, on two containers
    assert got[0][1] == got[1][1]


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


def test_the_gpu_worker_takes_a_gpu_fallback_list_and_min_containers():
    """Issue 25 item 4: `runtime.modal.gpu` may be a list (modal 1.6's `gpu=` takes one and tries the
    types in order) and `min_containers` keeps workers warm while the run's app runs; both reach the
    worker's declaration, built with the real modal package."""
    cfg = build(BASE, {"runtime": {"kind": "modal", "modal": {"gpu": ["H100", "A100-80GB"], "min_containers": 2}}})
    app = build_app(cfg)
    assert app.GPUWorker._get_class_service_function()._spec_.gpus == ["H100", "A100-80GB"]
    assert app.options["gpu"]["gpu"] == ["H100", "A100-80GB"] and app.options["gpu"]["min_containers"] == 2
    assert "min_containers" not in build_app(build(BASE, {"runtime": {"kind": "modal"}})).options["gpu"]
    with pytest.raises(ConfigError, match="at least 1 item"):
        build(BASE, {"runtime": {"kind": "modal", "modal": {"gpu": []}}})


def test_an_iteration_longer_than_the_scaledown_window_warns_once(tmp_path, caplog):
    """Issue 25 item 4: workers that scale down between iterations start cold every iteration; the run
    says so (once), with the setting to raise, unless min_containers keeps them."""
    import logging
    import time

    cfg = build(BASE, {"runtime": {"kind": "modal", "modal": {"scaledown_window_s": 2}}})
    policy = ModalRuntime(cfg, app=build_app(cfg), execute="local", volume_root=tmp_path).policy(cfg)
    with caplog.at_level(logging.WARNING, logger="vrl.runtime.modal.runtime"):
        policy._check_warm()  # the first iteration: nothing to compare
        policy._last_sample = time.monotonic() - 5
        policy._check_warm()
        policy._last_sample = time.monotonic() - 5
        policy._check_warm()
    warnings_ = [r.getMessage() for r in caplog.records if "scaledown_window_s" in r.getMessage()]
    assert len(warnings_) == 1 and "min_containers" in warnings_[0]
    kept = build(BASE, {"runtime": {"kind": "modal", "modal": {"scaledown_window_s": 2, "min_containers": 1}}})
    policy = ModalRuntime(kept, app=build_app(kept), execute="local", volume_root=tmp_path).policy(kept)
    caplog.clear()
    policy._check_warm()
    policy._last_sample = time.monotonic() - 5
    policy._check_warm()
    assert not [r for r in caplog.records if "scaledown_window_s" in r.getMessage()]
