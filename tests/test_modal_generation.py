"""The Modal runtime's GPU worker on the Modal emulator (tests/modal_emulator), on the tiny model.

No Modal account exists here. The real `vrl/runtime/modal` code runs against the emulated service:
each GPU worker is a separate process in its image's filesystem (vrl installed from its wheel, not
this checkout), arguments and results cross as pickles, `.map()` inputs go to containers in random
order and come back as they finish, and a container sees the Volume's files only once they are
committed (an upload from here, a commit in another container) and it reloads. The results must be
identical to the local runtime's for the same seeds: ES member completions, a whole ES run's history
and samples (resumed, detached, or in one go), and GRPO generation shards before and after a weight
sync through the Volume.

One emulated service serves the whole module (`module_emu`), and one running app (`shared`) the tests
that call the worker directly or through a `ModalPolicy`: its GPU container stays warm from test to
test, as through a run (a test that needs a cold one kills it, as a lost host would). Each test writes
the Volume under its own run name. Every app has one GPU container (`max_containers=1`: members run
one after another in it); what is checked does not need two at once.
"""

from __future__ import annotations

import functools
import json
import time
from types import SimpleNamespace

import pytest
import torch

from vrl.config import build
from vrl.envs.letters import LettersEnvironment
from vrl.generate import make_generator
from vrl.generate.hf import HFGenerator
from vrl.optim.es import ES, ESHistory, update_terms
from vrl.policy import HostNeeds, PerturbationSpec, Unsupported, Variant
from vrl.runtime import make_runtime
from vrl.runtime.local import LocalRuntime
from vrl.runtime.modal import workers
from vrl.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning:vrl")  # vrl's own deprecations fail

BASE = {
    "plugin": "letters",  # the tiny model's members score differently: every iteration makes a real update
    "iterations": 2,
    "tasks_per_iteration": 3,
    "es": {"population_size": 4, "sigma": 0.05},
    "generator": {"dtype": "float32", "device": "cpu"},
    "sampling": {"max_new_tokens": 12, "batch_size": 2},
}
MODAL = {"verify_in": "local", "max_containers": 1}  # one GPU container: each costs 4-6 CPU-s of imports


def modal_cfg(runs_dir, name, *layers, **modal):
    """`BASE` with `--runtime modal` (`runtime.modal.*` on top of `MODAL`), run `name` under `runs_dir`."""
    return build(BASE, {"logging": {"runs_dir": str(runs_dir), "name": name}}, *layers,
                 {"runtime": {"kind": "modal", "modal": {**MODAL, **modal}}})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The local runtime's ES run of `BASE`: what every emulated result must equal."""
    runs = tmp_path_factory.mktemp("local")
    Trainer(build(BASE, {"logging": {"runs_dir": str(runs), "name": "local"}}), runtime=LocalRuntime()).run()
    history = ESHistory.read(runs / "local" / "es_history.json")
    updates = [update_terms(r, history.antithetic, history.alpha) for r in history.iterations]
    assert len(updates) == 2 and all(updates)  # rewards differed: the updates are real
    return SimpleNamespace(dir=runs / "local", history=history, updates=updates)


@pytest.fixture(scope="module")
def shared(module_emu, tmp_path_factory):
    """A Modal runtime whose app runs for the whole module (its first policy starts it)."""
    from vrl.runtime.modal.app import build_app
    from vrl.runtime.modal.runtime import ModalRuntime

    cfg = modal_cfg(tmp_path_factory.mktemp("runs"), "shared")
    runtime = ModalRuntime(cfg, app=build_app(cfg))
    runtime.policy(cfg)
    yield runtime
    runtime.close()


class KeptOpen:
    """`shared` as a Trainer's runtime: the run ends without stopping the module's app (a Trainer closes its
    runtime), so the warm worker serves the next test. Every call but `close` is the ModalRuntime's own."""

    def __init__(self, runtime):
        self._runtime = runtime

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def close(self) -> None:
        pass


def _samples(path):
    rows = [json.loads(line) for line in (path / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        r["verdict"].pop("elapsed_s")
    return rows


def _key(cs):
    return [(c.task_id, c.sample, c.variant, c.text, c.token_ids) for c in cs]


def _spec(cfg):
    return PerturbationSpec(tuple(cfg.es.include), tuple(cfg.es.exclude), cfg.es.sigma)


def local_sample(cfg, updates, tasks, variant, seed):
    """What the local runtime's host samples for `variant` after `updates` (the host `ES.setup` prepares)."""
    host = make_generator(cfg, HostNeeds("perturbations", _spec(cfg)))
    try:
        host.perturbations(_spec(cfg))
        for u in updates:
            host.update(u)
        return [c for batch in host.sample(tasks, [variant], seed=seed) for c in batch]
    finally:
        host.close()


def update_log(shared, store, updates=(), snapshot_every=0):
    """The orchestrator's update log of run store `store` (`runs/<name>/es`), uploading to the Volume as
    `ModalPolicy` does."""
    log = workers.UpdateLog(store, shared._put_files, snapshot_every)
    for u in updates:
        log.append(u.to_wire())
    return log


def call_worker(emu, shared, variant, tasks, seed, log, write_snapshot=False):
    """One `sample` call as `ModalPolicy` makes it (its new updates uploaded first, the ES state as
    `UpdateLog.head()`). Returns the completions, the call's output and the container that ran it."""
    cfg = build(BASE)
    log.flush()
    out = shared.worker.remote(workers.variant_to_wire(variant), 0, len(tasks), write_snapshot,
                                      config=workers.engine_config(cfg), tasks=workers.tasks_to_wire(tasks),
                                      seed=seed, spec=workers.spec_to_wire(_spec(cfg)), es=log.head())
    container = [row["container"] for row in emu.log if row["function"] == "sample"][-1]
    return [workers.completion_from_wire(c) for c in out["completions"]], out, container


def cold(emu):
    """Every GPU worker container is lost (a crash, a lost host): the next call starts a cold one."""
    for cid in emu.running("sample"):
        emu.kill(cid)
    deadline = time.monotonic() + 60
    while emu.running("sample"):
        assert time.monotonic() < deadline, "the killed containers did not go"
        time.sleep(0.05)


# -- whole runs ----------------------------------------------------------------------------------------


def test_es_run_on_emulated_modal_matches_the_local_runtime(module_emu, shared, reference, tmp_path):
    """The same ES run with `--runtime modal`: members sampled in the worker container, in any order. (On
    the module's running app: its worker, cold or holding another run's θ, starts this run from the base
    model, as a new app's would; a new app's run is the resume test's.)"""
    cfg = modal_cfg(tmp_path, "modal")
    before = len(module_emu.log)
    Trainer(cfg, runtime=KeptOpen(shared)).run()
    inputs = [row for row in module_emu.log[before:] if row["function"] == "sample"]
    assert len({row["call"] for row in inputs}) == 8 and len(inputs) >= 8  # a call per member, 4 per iteration
    local, remote = reference.dir, tmp_path / "modal"
    h_local, h_remote = reference.history, ESHistory.read(remote / "es_history.json")
    assert h_local.iterations == h_remote.iterations
    assert any(z != 0 for r in h_local.iterations for z in r.z)  # rewards differed: the updates were real
    assert h_local.base == h_remote.base
    assert _samples(local) == _samples(remote)
    m_local = [json.loads(x) for x in (local / "metrics.jsonl").read_text().splitlines()]
    m_remote = [json.loads(x) for x in (remote / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(m_local, m_remote, strict=True):
        for key in ("reward_mean", "reward_max", "tokens", "es/member_reward_mean", "es/member_reward_std"):
            assert a[key] == b[key], key


def test_remote_es_resume_continues_the_history_exactly(module_emu, shared, reference, tmp_path):
    """A run stopped after one iteration (on the module's running app) and resumed (another app: a cold
    worker that catches up from the updates on the Volume) has the uninterrupted local run's history."""
    from vrl.rundir import RunDir

    cfg1 = modal_cfg(tmp_path, "resumed", {"iterations": 1})
    Trainer(cfg1, runtime=KeptOpen(shared)).run()
    cfg2 = modal_cfg(tmp_path, "resumed")
    Trainer(cfg2, run_dir=RunDir.open(tmp_path / "resumed"), runtime=make_runtime(cfg2)).run()
    assert ESHistory.read(tmp_path / "resumed" / "es_history.json").iterations == reference.history.iterations


def test_a_detached_run_resumes_from_the_volume_and_continues_the_history_exactly(module_emu, reference, tmp_path):
    """`vrl train --detach` for one iteration, then `vrl modal resume NAME --iterations 2`: the orchestrator
    runs in its own container, keeps the run on the Volume (committed after each iteration), and the
    resumed call reads its recorded config back from there and continues the local run's history."""
    import modal

    from tests.modal_emulated import follow, run_detached
    from vrl.runtime.modal.launch import read_volume_file, recorded_config, resume_detached

    first = modal_cfg(tmp_path, "detached", {"iterations": 1})
    before = len(module_emu.log)
    summary = run_detached(first)
    assert summary["status"] == "finished" and summary["iterations_completed"] == 1
    metrics = b"".join(modal.Volume.from_name("vrl").read_file("runs/detached/metrics.jsonl")).splitlines()
    assert len(metrics) == 1  # committed: the client sees only what a container committed

    resumed = recorded_config("detached", "vrl", 2)
    assert resumed.iterations == 2 and resumed.runtime.modal.detach and resumed.es == first.es
    with pytest.raises(ValueError, match="recorded runtime.modal.volume='vrl'"):
        recorded_config("detached", "other", 2, read=lambda _v, p: read_volume_file("vrl", p))
    call, _ = resume_detached("detached", "vrl", 2)
    summary = follow(call)
    assert summary["status"] == "finished" and summary["iterations_completed"] == 2
    run = module_emu.volume("vrl") / "runs" / "detached"  # the Volume's committed state
    assert ESHistory.read(run / "es_history.json").iterations == reference.history.iterations
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert len({row["call"] for row in module_emu.log[before:] if row["function"] == "orchestrate"}) == 2


GAME = {"plugin": "guess", "optimizer": "grpo", "iterations": 2, "tasks_per_iteration": 3, "env_options": {"turns": 3},
        "grpo": {"num_generations": 4, "learning_rate": 0.05}, "sampling": {"max_new_tokens": 3, "batch_size": 2},
        "logging": {"samples_per_iteration": 4}}


def test_a_multi_turn_grpo_run_on_emulated_modal_plays_the_local_runs_episodes(module_emu, shared, tmp_path):
    """An environment that answers back (the built-in guess game) with `--runtime modal`: the worker builds
    the run's environment from its plugin and options and samples whole episodes, and their token masks
    cross back with them, so GRPO's losses, the rewards and every recorded episode equal the local
    runtime's; the second iteration samples the weights published through the Volume."""
    local = tmp_path / "local"
    Trainer(build(BASE, GAME, {"logging": {"runs_dir": str(local), "name": "guess"}}), runtime=LocalRuntime()).run()
    Trainer(modal_cfg(tmp_path, "guess", GAME), runtime=KeptOpen(shared)).run()
    rows, want = _samples(tmp_path / "guess"), _samples(local / "guess")
    for r in rows + want:  # the environment's step times (wall clock)
        r["episode"]["metrics"].pop("env_step_s")
        for turn in r["episode"]["turns"]:
            turn.pop("seconds")
    assert rows == want
    assert any(len(r["episode"]["turns"]) > 2 for r in rows)  # the environment answered, the model again
    m_local = [json.loads(x) for x in (local / "guess" / "metrics.jsonl").read_text().splitlines()]
    m_remote = [json.loads(x) for x in (tmp_path / "guess" / "metrics.jsonl").read_text().splitlines()]
    assert len(m_remote) == 2 and m_local[0]["grpo/grad_norm"] > 0  # a real step: its loss reads the token masks
    for a, b in zip(m_local, m_remote, strict=True):
        for key in ("reward_mean", "grpo/loss", "grpo/grad_norm", "episodes/turns_mean"):
            assert a[key] == b[key], key


# -- the worker, called directly -------------------------------------------------------------------------


def test_worker_sample_equals_the_local_host_for_each_member(module_emu, shared, reference):
    """the `sample` function, in its container (a `.map()` of three members: inputs in random order,
    pickled arguments, the updates from the Volume), gives each member's completions exactly as the
    local host does after `ES.load`."""
    cfg = build(BASE)
    host = HFGenerator.from_config(cfg)
    es = ES(cfg.es, seed=cfg.seed, base={"model": "tiny", "revision": None})
    es.setup(host)
    es.load(reference.dir, 2)  # θ_2, replayed from the history
    tasks = LettersEnvironment().tasks("train")[:3]
    members = [Variant(index=i, samples_per_task=2, seed=seed, sign=sign)
               for i, (seed, sign) in enumerate([(11, 1), (12, 1), (11, -1)])]
    log = update_log(shared, "runs/members/es", reference.updates)
    log.flush()
    outs = list(shared.worker.map(
        [workers.variant_to_wire(v) for v in members], [0] * 3, [len(tasks)] * 3,
        kwargs={"config": workers.engine_config(cfg), "tasks": workers.tasks_to_wire(tasks), "seed": 5,
                "spec": workers.spec_to_wire(_spec(cfg)), "es": log.head()}))
    for v, out in zip(members, outs, strict=True):
        expected = [c for batch in host.sample(tasks, [v], seed=5) for c in batch]
        got = [workers.completion_from_wire(c) for c in out["completions"]]
        assert _key(got) == _key(expected) and {c.variant for c in got} == {v.index}


def test_warm_worker_replays_only_the_new_update(module_emu, shared, reference):
    """A second call with one more update runs on the warm container and applies just that update, and
    samples what the local host does after both. (The first call replays the one update from the base
    model, whether its container is cold or holds another run's θ: no cold start is needed for it.)"""
    tasks = LettersEnvironment().tasks("train")[:1]
    member = Variant(index=0, seed=7)
    log = update_log(shared, "runs/warm/es", reference.updates[:1])
    _, first, container = call_worker(module_emu, shared, member, tasks, 1, log)
    assert first["replayed"] == 1
    log.append(reference.updates[1].to_wire())
    got, second, again = call_worker(module_emu, shared, member, tasks, 1, log)
    assert again == container and second["replayed"] == 1  # the warm model was kept: one update applied
    assert _key(got) == _key(local_sample(build(BASE), reference.updates, tasks, member, 1))


def test_a_cold_worker_starts_from_the_theta_snapshot_and_matches_a_full_replay(module_emu, shared, reference):
    """Issue 25 item 4: a worker writes θ after K updates to the Volume and commits it; a cold worker (another
    container) loads it, replays only the updates after it, and samples exactly what the local host does
    after every update."""
    updates = [*reference.updates, reference.updates[0]]  # a third update (the first again: any will do)
    tasks = LettersEnvironment().tasks("train")[:2]
    member = Variant(index=0, samples_per_task=2, seed=5, sign=-1)
    log = update_log(shared, "runs/snap/es", updates[:2], snapshot_every=2)
    assert log.snapshot_due()
    _, out, writer = call_worker(module_emu, shared, member, tasks, 3, log, write_snapshot=True)
    theta = module_emu.volume("vrl") / "runs" / "snap" / "es" / "theta"
    assert out["snapshot"] == 2 and [p.name for p in theta.glob("*.safetensors")] == ["000002.safetensors"]
    log.append(updates[2].to_wire())  # (the call carries no word of the snapshot: the worker finds it)

    cold(module_emu)
    from_snapshot, out, reader = call_worker(module_emu, shared, member, tasks, 3, log)
    assert reader != writer and out["replayed"] == 1  # the snapshot, then the one update after it
    assert _key(from_snapshot) == _key(local_sample(build(BASE), updates, tasks, member, 3))


def test_a_history_that_does_not_extend_the_warm_one_starts_over(module_emu, shared, reference):
    """A rewound run (same store, another last update) is caught by the digests: the warm worker rebuilds
    from the base model and replays the Volume's new history (reloaded: the upload came after it mounted
    the Volume), never applying the new update on top of the old. (The first call's container may be cold
    or hold another run's θ: either way it starts from the base model.)"""
    tasks = LettersEnvironment().tasks("train")[:1]
    member = Variant(index=0, seed=9)
    _, _, container = call_worker(module_emu, shared, member, tasks, 1, update_log(shared, "runs/x/es", reference.updates))
    rewound = [reference.updates[1], reference.updates[0]]  # same count, another history
    got, out, again = call_worker(module_emu, shared, member, tasks, 1, update_log(shared, "runs/x/es", rewound))
    assert again == container and out["replayed"] == 2
    assert _key(got) == _key(local_sample(build(BASE), rewound, tasks, member, 1))


# -- the worker through ModalPolicy -----------------------------------------------------------------------


def test_es_members_are_one_call_each_and_stream_as_they_finish(module_emu, shared, tmp_path):
    """One sample() of the Modal policy makes one worker call per member; each member's completions arrive
    as its own batch, tagged with the member's index, in the order the containers finished them."""
    import cloudpickle

    from vrl.types import Result, Verdict

    cfg = modal_cfg(tmp_path, "stream")
    policy = shared.policy(cfg, HostNeeds("perturbations"))
    es = ES(cfg.es, seed=cfg.seed, base={"model": "tiny", "revision": None})
    es.setup(policy)
    tasks = LettersEnvironment().tasks("train")[:2]
    finished: list[int] = []  # members, as their containers finished them

    def member_done(function, input, **_):  # noqa: A002 - the emulator's keyword
        if function == "sample" and input.ok:
            finished.append(cloudpickle.loads(input.blob)[0][0]["index"])

    module_emu.on("input_finished", member_done)
    try:
        for iteration in range(2):
            finished.clear()
            variants = es.ask()
            batches = list(policy.sample(tasks, variants, seed=iteration))
            # One batch per member call, each one member's; the order they stream in is the calls' finishing
            # order (ModalCaller's unit test pins that; two containers may finish too close to order here).
            assert sorted(next(iter({c.variant for c in b})) for b in batches) == sorted(finished)
            assert all(len({c.variant for c in b}) == 1 and len(b) == 2 for b in batches)
            assert sorted(finished) == list(range(len(variants)))
            assert policy.calls == (iteration + 1) * len(variants)
            es.tell([Result(task=tasks[i % 2], completion=c, verdict=Verdict.ok(), reward=float(c.variant))
                     for b in batches for i, c in enumerate(b)])
        assert len(policy.updates) == 2 and all(policy.updates)
        policy.close()
    finally:
        module_emu.hooks["input_finished"].remove(member_done)


def test_low_rank_members_share_a_worker_call_and_sample_what_one_per_call_does(module_emu, shared, tmp_path):
    """Issue 25 item 4: with es.noise=lowrank a worker call samples several members (one engine pass on
    vllm), as many as share runtime.modal.max_containers; the completions are those of one member per call.
    (The run's setting says two containers; the shared app runs the calls in its one.)"""
    tasks = LettersEnvironment().tasks("train")[:2]
    got = {}
    for per_call in (0, 1):
        cfg = modal_cfg(tmp_path, f"lr{per_call}", {"es": {"noise": "lowrank", "rank": 2}}, members_per_call=per_call,
                        max_containers=2)
        policy = shared.policy(cfg, HostNeeds("perturbations"))
        es = ES(cfg.es, seed=cfg.seed, base={"model": "tiny", "revision": None})
        es.setup(policy)
        variants = es.ask()
        assert len(variants) == 4
        batches = list(policy.sample(tasks, variants, seed=3))
        assert sorted(c.variant for b in batches for c in b[:1]) == [v.index for v in variants]
        got[per_call] = (policy.calls, sorted(_key([c for b in batches for c in b])))
        policy.close()
    assert got[0][0] == 2 and got[1][0] == 4  # two members per call by default (two containers)
    assert got[0][1] == got[1][1]


def test_the_modal_policy_keeps_no_weights_and_refuses_snapshots(shared, tmp_path):
    """The orchestrator's side only: refusals before any worker call."""
    cfg = modal_cfg(tmp_path, "refusals")
    policy = shared.policy(cfg, HostNeeds("perturbations"))
    with pytest.raises(RuntimeError, match="perturbations"):
        next(policy.sample(LettersEnvironment().tasks("train")[:1], [Variant(index=0, seed=1)]))
    es = ES(cfg.es, seed=cfg.seed, base={"model": "tiny", "revision": None})
    es.setup(policy)
    assert es.history.base.dtype == "float32" and policy._trainable is None
    with pytest.raises(Unsupported, match="keeps the weights on its workers"):
        policy.state()
    snap = modal_cfg(tmp_path, "refusals", {"es": {"snapshot_every": 2}})
    with pytest.raises(ValueError, match="es.snapshot_every=0"):
        ES(snap.es, base={"model": "tiny"}).setup(shared.policy(snap, HostNeeds("perturbations")))


def test_grpo_shards_match_local_generation_before_and_after_publishing(module_emu, shared, tmp_path):
    """GRPO: shards of the tasks on the workers give what local generation gives, and after `publish`
    (uploaded to the Volume from here) the workers reload it and sample the new weights."""
    import modal

    cfg = modal_cfg(tmp_path, "g", {"optimizer": "grpo", "sampling": {"batch_size": 2, "max_new_tokens": 10}})
    policy = shared.policy(cfg, HostNeeds("trained"))
    trained = policy.trainable().model
    local = HFGenerator.from_config(cfg)
    tasks = LettersEnvironment().tasks("train")[:5]

    def same(a, b):  # shards come back as their containers finish them: compared by task and sample
        def rows(cs):
            return sorted((c.task_id, c.sample, c.text, c.token_ids, c.prompt_token_ids) for c in cs)
        return rows(a) == rows(b)

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
    weights = [e.path for e in modal.Volume.from_name("vrl").listdir("runs/g/weights")]
    assert weights == ["runs/g/weights/v000001.safetensors"]
    assert same(after, local.generate(tasks, n=1, seed=9))
    assert not same(before, after)  # the shard workers really loaded the new weights
    policy.close()


def test_an_iteration_longer_than_the_scaledown_window_warns_once(shared, tmp_path, caplog):
    """Issue 25 item 4: workers that scale down between iterations start cold every iteration; the run
    says so (once), with the setting to raise, unless min_containers keeps them. (The orchestrator's
    side only: no worker call.)"""
    import logging

    cfg = modal_cfg(tmp_path, "window", scaledown_window_s=2)
    policy = shared.policy(cfg)
    with caplog.at_level(logging.WARNING, logger="vrl.runtime.modal.runtime"):
        policy._check_warm()  # the first iteration: nothing to compare
        policy._last_sample = time.monotonic() - 5
        policy._check_warm()
        policy._last_sample = time.monotonic() - 5
        policy._check_warm()
    warnings_ = [r.getMessage() for r in caplog.records if "scaledown_window_s" in r.getMessage()]
    assert len(warnings_) == 1 and "min_containers" in warnings_[0]
    kept = modal_cfg(tmp_path, "window", scaledown_window_s=2, min_containers=1)
    policy = shared.policy(kept)
    caplog.clear()
    policy._check_warm()
    policy._last_sample = time.monotonic() - 5
    policy._check_warm()
    assert not [r for r in caplog.records if "scaledown_window_s" in r.getMessage()]


# -- plain functions (no Modal function involved) ---------------------------------------------------------


def test_a_completion_crosses_the_wire_whole():
    """Every field of a completion comes back from a worker, those samples.jsonl leaves out included
    (token ids, log-probs, an episode's token mask: GRPO trains on them); session 23 found the mask
    missing. A field added later and left out of the JSON crosses too."""
    from vrl.types import Completion, Episode, Turn

    fields = Completion.model_fields
    c = Completion(task_id="t", text="4", variant=1, sample=2, finish_reason="length", prompt_token_ids=[5, 6],
                   token_ids=[7, 8, 9], logprobs=[-0.5, 0.0, -0.25], token_mask=[1, 0, 1], weights_version=3,
                   episode=Episode(turns=[Turn(role="assistant", content="4", tokens=1)]))
    assert all(getattr(c, name) not in (None, fields[name].default) for name in fields if fields[name].exclude)
    wire = json.loads(json.dumps(workers.completion_to_wire(c)))  # what crosses is JSON
    assert workers.completion_from_wire(wire) == c


def test_a_member_call_carries_only_the_newest_update():
    """Issue 25 defect 9: the ES state a call carries is the newest update and digests, whatever the
    iteration count (before: every update since the base, in every call). `UpdateLog` is the
    orchestrator's own bookkeeping (no Modal function runs): tested in this process."""
    from vrl.weights.update import FullRankUpdate

    log = workers.UpdateLog("runs/r/es", lambda files: None)
    sizes = []
    for i in range(50):
        log.append(FullRankUpdate(tuple((10**6 + 10 * i + j, 0.5 + j) for j in range(8))).to_wire())
        sizes.append(len(json.dumps(log.head())))
    assert len(log.head()["recent"]) == 1 and log.head()["count"] == 50
    assert max(sizes[1:]) - min(sizes[1:]) <= 1  # from the second update on: a digit of the count, nothing more


def test_an_environment_made_in_code_is_refused_for_modal_episodes(tmp_path):
    """The workers build the run's environment from its plugin and options: one that is not the plugin's
    (made in code and handed to the Trainer) is refused in one line, by the preflight and before any call;
    the plugin's own is sent as its plugin and options."""
    from vrl.envs.guess import GuessEnvironment
    from vrl.episodes import Episodes
    from vrl.runtime.modal.runtime import ModalPolicy

    cfg = modal_cfg(tmp_path, "game", GAME)
    policy = ModalPolicy(None, None, cfg, SimpleNamespace(run="game"))

    class MyGame(LettersEnvironment):
        multi_turn = True

    from vrl.errors import UsageError
    from vrl.preflight import check_episodes
    from vrl.runtime.modal.runtime import ModalRuntime

    for refuse in (lambda: policy.episodes(Episodes(MyGame())), lambda: check_episodes(cfg, MyGame(), ModalRuntime)):
        with pytest.raises(UsageError, match=r"^the Modal workers build their environment from the run's config "
                                             r"\(plugin 'guess'\), but this run's is a MyGame made in code: .*"
                                             r"--set runtime.kind=local$"):
            refuse()
    assert policy.environment is None
    policy.episodes(Episodes(GuessEnvironment(turns=3)))
    assert policy.environment == {"plugin": "guess", "env_options": {"turns": 3}}


def test_a_cancellation_while_a_warm_worker_applies_an_update_is_caught(reference):
    """Issue 54 item 6. Modal cancels an input by raising InputCancellation wherever its code is (SIGUSR1's
    handler, modal/_container_entrypoint.py): here just after a warm worker's weights took the newest update
    and before the worker counted it. The worker kept its warm model believing it held one update fewer, and
    the next call applied that update again: θ out of step with the run's history, unnoticed. Now the next
    call sees that the last one stopped while the weights changed and loads the model again, then replays:
    θ equals the local host's after the same updates. The worker's body in this process (no container)."""
    from vrl.runtime.modal.workers import _WARM

    class Cancelled(BaseException):  # what modal.exception.InputCancellation is: not an Exception
        pass

    cfg = build(BASE)
    tasks = LettersEnvironment().tasks("train")[:1]
    member = Variant(index=0, seed=7)
    wire = [u.to_wire() for u in reference.updates]
    args = {"config": workers.engine_config(cfg), "tasks": workers.tasks_to_wire(tasks), "seed": 1,
            "spec": workers.spec_to_wire(_spec(cfg))}
    try:
        workers.sample(workers.variant_to_wire(member), 0, 1, updates=wire[:1], **args)
        host = _WARM.host
        applied = host.update

        def cancelled_after_the_tensors(update):
            applied(update)
            raise Cancelled("Input was cancelled by user")

        host.update = cancelled_after_the_tensors
        with pytest.raises(Cancelled):
            workers.sample(workers.variant_to_wire(member), 0, 1, updates=wire, **args)
        host.update = applied
        got = workers.sample(workers.variant_to_wire(member), 0, 1, updates=wire, **args)
        local = make_generator(cfg, HostNeeds("perturbations", _spec(cfg)))
        try:
            local.perturbations(_spec(cfg))
            for u in reference.updates:
                local.update(u)
            assert _WARM.host.checksum() == local.checksum()
        finally:
            local.close()
        assert _key([workers.completion_from_wire(c) for c in got]) == \
            _key(local_sample(cfg, reference.updates, tasks, member, 1))
    finally:
        if _WARM.host is not None:
            _WARM.host.close()
        _WARM.host = _WARM.key = None


def test_repair_episodes_are_refused_on_modal_before_anything_starts(tmp_path, monkeypatch):
    """Issue 54 item 4. `-o turns=2` of the lean and python-tests plugins: every turn is judged by the
    environment's verifier, and on Modal the workers run the episodes, with no verifier there (Lean:
    every repair step errored and episodes silently stayed one turn; python-tests: the worker could not
    build its sandbox, or with unsafe-local ran model code in a GPU container that mounts the Volume).
    Refused in one line by the preflight and by `vrl train --detach` before any app is built; a
    multi-turn environment whose turns need no verifier (guess) is not."""
    from vrl.errors import UsageError
    from vrl.runtime.modal import app as app_module
    from vrl.runtime.modal.launch import launch_detached
    from vrl.runtime.modal.runtime import ModalRuntime

    def built(config):
        raise AssertionError("the app was built")

    monkeypatch.setattr(app_module, "build_app", built)
    for plugin in ("python-tests", "lean"):
        cfg = modal_cfg(tmp_path, "repair", {"plugin": plugin, "env_options": {"turns": 2}})
        detached = modal_cfg(tmp_path, "repair", {"plugin": plugin, "env_options": {"turns": 2}}, detach=True)
        for refuse in (functools.partial(ModalRuntime.check, cfg), functools.partial(launch_detached, detached)):
            with pytest.raises(UsageError, match=rf"^environment '{plugin}' judges every turn of its episodes with its "
                                                 r"verifier \(-o turns=2: repair\).*runtime.kind=local for repair$"):
                refuse()
    ModalRuntime.check(modal_cfg(tmp_path, "game", GAME))
    ModalRuntime.check(modal_cfg(tmp_path, "one", {"plugin": "python-tests"}))


def test_a_resumed_orchestrator_rebuilds_its_es_state_without_torch(reference, tmp_path, monkeypatch):
    """A detached orchestrator that resumes (restarted, continued, `vrl modal resume`) rebuilds the ES state
    of a `ModalPolicy`, which keeps no weights: the history's updates, logged for the workers. It needs no
    torch for that (1-2 CPU-s of the container's start): with torch unimportable the log is the local run's.
    The orchestrator's own side only (no Modal function runs): tested in this process."""
    import sys

    from vrl.runtime.modal.runtime import ModalPolicy

    cfg = modal_cfg(tmp_path, "resumed-here")
    policy = ModalPolicy(None, None, cfg, SimpleNamespace(run="resumed-here"))
    es = ES(cfg.es, seed=cfg.seed, base={"model": "tiny", "revision": None})
    es.setup(policy)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    es.load(reference.dir, 2)
    monkeypatch.undo()
    expected = workers.UpdateLog("runs/resumed-here/es", lambda files: None)
    for update in reference.updates:
        expected.append(update.to_wire())
    assert policy.log.head() == expected.head() and es.history.iterations == reference.history.iterations


def test_prepare_finds_the_model_in_the_volumes_cache_and_downloads_nothing(module_emu, tmp_path):
    """`vrl modal prepare` (the `prepare_model` function, in its container) on a Volume that already holds
    the model's HF cache: it loads by model id with the Hub off and downloads nothing. The environment
    the GPU workers get (`volume_env`) points the Hub at that cache, offline."""
    import shutil

    from vrl.generate import tiny
    from vrl.runtime.modal.launch import prepare

    cache = tmp_path / "hf" / "models--acme--tiny"
    tiny.build_model().save_pretrained(cache / "snapshots" / ("0" * 40))
    tiny.build_tokenizer().save_pretrained(cache / "snapshots" / ("0" * 40))
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("0" * 40)
    shutil.copytree(tmp_path / "hf", module_emu.volume("vrl") / "hf", dirs_exist_ok=True)  # as a past prepare left it
    info = prepare(modal_cfg(tmp_path, "prepare"), "acme/tiny")
    assert info["downloaded"] is False and "model.safetensors" in info["files"] and info["bytes"] > 0
    assert info["path"].startswith(f"{workers.VOLUME_ROOT}/hf/")  # the container's mount, not this machine's
    assert workers.volume_env(tmp_path) == {"HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
                                            "TRANSFORMERS_OFFLINE": "1"}


def test_a_cancellation_is_held_while_the_worker_imports_loads_or_catches_up():
    """Issue 54 item 6. Modal's cancellation (SIGUSR1, whose handler raises InputCancellation wherever the code
    is) once landed in a worker's first collection of the plugin registry on the emulator, and every later
    call of that container failed ("unknown generator backend 'hf'; installed: none"). Inside the worker's
    set-up it is held and raised once the set-up is done; outside Modal (no handler) nothing changes."""
    import os
    import signal

    from vrl.runtime.modal.workers import _cancellation_held

    class Cancelled(BaseException):
        pass

    steps: list[str] = []

    def modal_handler(signum, frame):
        raise Cancelled("Input was cancelled by user")

    before = signal.signal(signal.SIGUSR1, modal_handler)
    try:
        with pytest.raises(Cancelled):
            with _cancellation_held():
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.05)  # the handler would run here, mid-step
                steps.append("the step ran to its end")
        assert steps == ["the step ran to its end"]
        assert signal.getsignal(signal.SIGUSR1) is modal_handler
    finally:
        signal.signal(signal.SIGUSR1, before)
    with _cancellation_held():  # no Modal handler: nothing is held
        steps.append("plain")
