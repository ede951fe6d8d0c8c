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
from vrl.optim.base import Variant
from vrl.optim.es import ES, ESHistory
from vrl.runtime.local import LocalRuntime
from vrl.runtime.modal import workers
from vrl.runtime.modal.app import build_app
from vrl.runtime.modal.runtime import ModalRuntime, RemoteES
from vrl.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

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
    modal_cfg = build(*layers, {"logging": {"name": "modal"}, "runtime": {"kind": "modal", "verify_in": "local"}})
    Trainer(local_cfg, environment=LettersEnvironment(), runtime=LocalRuntime()).run()
    runtime = modal_local(modal_cfg, tmp_path)
    Trainer(modal_cfg, environment=LettersEnvironment(), runtime=runtime).run()
    return tmp_path / "local", tmp_path / "modal", runtime


def _samples(path):
    rows = [json.loads(line) for line in (path / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        r["verdict"].pop("elapsed_s")
    return rows


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


def test_es_member_body_equals_local_perturbed_generation(tmp_path):
    """Each member's completions from GPUWorker.es_member equal ES.activate + generate locally."""
    local, _, _ = run_pair(tmp_path, {"iterations": 2})
    history = ESHistory.read(local / "es_history.json")
    cfg = build(BASE, {"runtime": {"kind": "modal"}})
    app = build_app(cfg)
    worker = app.worker(str(tmp_path / "volume"))

    gen = HFGenerator.from_config(cfg)
    es = ES(cfg.es, seed=cfg.seed, base={"model": "tiny", "revision": None})
    es.setup(gen)
    es.load(local)  # θ_2, replayed from the history
    tasks = LettersEnvironment().tasks("train")[:3]
    for index, (seed, sign) in enumerate([(11, 1), (12, 1), (11, -1)]):
        with es.activate(Variant(index=index, seed=seed, sign=sign)):
            expected = gen.generate(tasks, n=2, variant=index, seed=5)
        got = worker.es_member.local(
            seed, sign, index, history=history.model_dump(mode="json"), tasks=workers.tasks_to_wire(tasks),
            sampling=cfg.sampling.model_dump(mode="json"), sample_seed=5, n=2,
        )
        got = [workers.completion_from_wire(c) for c in got]
        assert [(c.task_id, c.sample, c.variant, c.text, c.token_ids) for c in got] == [
            (c.task_id, c.sample, c.variant, c.text, c.token_ids) for c in expected
        ]


def test_warm_worker_replays_only_the_new_iteration(tmp_path):
    """A second call with a history one iteration longer reuses the replica and applies one update."""
    import vrl.optim.es as es_module

    local, _, _ = run_pair(tmp_path)
    full = ESHistory.read(local / "es_history.json")
    first = full.model_copy(update={"iterations": full.iterations[:1]})
    cfg = build(BASE, {"runtime": {"kind": "modal"}})
    worker = build_app(cfg).worker(str(tmp_path / "volume"))
    kwargs = {"tasks": workers.tasks_to_wire(LettersEnvironment().tasks("train")[:1]),
              "sampling": cfg.sampling.model_dump(mode="json"), "sample_seed": 1}
    worker.es_member.local(7, 1, 0, history=first.model_dump(mode="json"), **kwargs)
    replica = es_module._REPLICA
    assert replica is not None and len(replica.es.history.iterations) == 1
    updates = []
    original = replica.es.params.update
    replica.es.params.update = lambda terms: (updates.append(terms), original(terms))[1]
    try:
        worker.es_member.local(7, 1, 0, history=full.model_dump(mode="json"), **kwargs)
    finally:
        replica.es.params.update = original
    assert es_module._REPLICA is replica  # the warm model was kept
    assert len(updates) == 1 and len(replica.es.history.iterations) == 2


def test_es_members_are_launched_once_per_iteration(tmp_path):
    """The first request of an iteration launches every member; the others read their results."""
    from vrl.types import Result, Verdict

    cfg = build(BASE, {"runtime": {"kind": "modal"}})
    runtime = modal_local(cfg, tmp_path)
    gen = runtime.generator(cfg)
    es = runtime.optimizer(cfg)
    es.setup(gen)
    tasks = LettersEnvironment().tasks("train")[:2]
    for iteration in range(2):
        results = []
        for variant in es.ask():
            (batch,) = list(gen.stream(tasks, n=1, variant=variant.index, seed=iteration))
            assert {c.variant for c in batch} == {variant.index} and len(batch) == 2
            results += [Result(task=tasks[i], completion=c, verdict=Verdict.ok(), reward=float(variant.index))
                        for i, c in enumerate(batch)]
        assert gen.inner.launches == iteration + 1
        es.tell(results)
    gen.close()
    with pytest.raises(ValueError, match="snapshot_every"):
        snap = build(BASE, {"runtime": {"kind": "modal"}, "es": {"snapshot_every": 2}})
        modal_local(snap, tmp_path).optimizer(snap)


def test_remote_es_resume_continues_the_history_exactly(tmp_path):
    layers = [BASE, {"logging": {"runs_dir": str(tmp_path), "name": "r"}, "runtime": {"kind": "modal", "verify_in": "local"}}]
    cfg1 = build(*layers, {"iterations": 1})
    Trainer(cfg1, environment=LettersEnvironment(), runtime=modal_local(cfg1, tmp_path)).run()
    from vrl.rundir import RunDir

    cfg2 = build(*layers, {"iterations": 2})
    Trainer(cfg2, run_dir=RunDir.open(tmp_path / "r"), environment=LettersEnvironment(),
            runtime=modal_local(cfg2, tmp_path)).run()
    local, _, _ = run_pair(tmp_path / "ref")
    assert ESHistory.read(tmp_path / "r" / "es_history.json").iterations == ESHistory.read(local / "es_history.json").iterations


def test_remote_es_keeps_no_weights(tmp_path):
    cfg = build(BASE, {"runtime": {"kind": "modal"}})
    runtime = ModalRuntime(cfg, app=build_app(cfg), execute="local")
    opt = runtime.optimizer(cfg)
    assert isinstance(opt, RemoteES)
    gen = runtime.generator(cfg)
    opt.setup(gen)
    assert opt.history.base.dtype == "float32" and not hasattr(gen.inner, "model")
    with pytest.raises(RuntimeError, match="asked"):
        next(gen.stream(LettersEnvironment().tasks("train")[:1]))
    gen.close()


def test_grpo_shards_match_local_generation_before_and_after_a_weight_sync(tmp_path):
    cfg = build(BASE, {"optimizer": "grpo", "logging": {"name": "g"}, "runtime": {"kind": "modal"},
                       "sampling": {"batch_size": 2, "max_new_tokens": 10}})
    runtime = modal_local(cfg, tmp_path)
    gen = runtime.generator(cfg)
    local = HFGenerator.from_config(cfg)
    tasks = LettersEnvironment().tasks("train")[:5]

    def same(a, b):
        return [(c.task_id, c.sample, c.text, c.token_ids, c.prompt_token_ids) for c in a] == [
            (c.task_id, c.sample, c.text, c.token_ids, c.prompt_token_ids) for c in b
        ]

    assert len(list(gen.stream(tasks, n=2, seed=3))) == 3  # 5 tasks in shards of 2
    assert same(gen.generate(tasks, n=2, seed=3), local.generate(tasks, n=2, seed=3))
    with torch.no_grad():  # an "update": both copies move the same way
        for p_remote, p_local in zip(gen.model.parameters(), local.model.parameters()):
            delta = torch.randn(p_remote.shape, generator=torch.Generator().manual_seed(p_remote.numel())) * 0.5
            p_remote.add_(delta)
            p_local.add_(delta)
    before = gen.generate(tasks, n=1, seed=9)
    gen.sync_weights()
    after = gen.generate(tasks, n=1, seed=9)
    weights = sorted((tmp_path / "volume" / "runs" / "g" / "weights").glob("*.safetensors"))
    assert [w.name for w in weights] == ["v000001.safetensors"]
    assert same(after, local.generate(tasks, n=1, seed=9))
    assert not same(before, after)  # the shard worker really reloaded the new weights
    gen.close()


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


def test_detached_orchestrator_body_writes_to_the_volume_and_resumes(tmp_path):
    """`orchestrate` (the detached loop's body) keeps the run on the Volume and continues it exactly."""
    from vrl.config import dump

    volume = tmp_path / "volume"
    layers = [BASE, {"logging": {"name": "d"}, "runtime": {"kind": "modal", "verify_in": "local"}}]
    first = build(*layers, {"iterations": 1})
    commits: list = []
    summary = workers.orchestrate(dump(first), volume, modal_local(first, tmp_path), on_iteration=commits.append)
    assert summary["status"] == "finished" and len(commits) == 1
    more = build(*layers, {"iterations": 2})
    summary = workers.orchestrate(dump(more), volume, modal_local(more, tmp_path), resume=True)
    run = volume / "runs" / "d"
    assert summary["iterations_completed"] == 2
    assert len(ESHistory.read(run / "es_history.json").iterations) == 2
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
