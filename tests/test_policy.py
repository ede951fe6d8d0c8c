"""The sampling contract: a host samples all of an iteration's variants in one call; a pool of
hosts deals them over engines and returns exactly what one host returns (hf engines on the CPU here;
the same pool over vLLM engines is tested on a GPU in tests/test_vllm_gpu.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from vrl.config import build
from vrl.envs.letters import LettersEnvironment
from vrl.generate.hf import HFGenerator
from vrl.optim.es import ES, ESHistory
from vrl.optim.grpo import GRPO
from vrl.policy import PerturbationSpec, PolicyHost, Unsupported, Variant
from vrl.runtime.local import LocalRuntime
from vrl.runtime.pool import HostPool
from vrl.trainer import Trainer
from vrl.types import Result, Verdict
from vrl.weights.update import FullRankUpdate

BASE = {"plugin": "letters", "seed": 3, "tasks_per_iteration": 5,
        "sampling": {"max_new_tokens": 6, "temperature": 1.0, "batch_size": 2},
        "generator": {"device": "cpu", "dtype": "float32"},
        "es": {"population_size": 5, "sigma": 0.05, "alpha": 0.05}}


def _key(batches):
    return sorted((c.variant, c.task_id, c.sample, c.text, tuple(c.token_ids)) for b in batches for c in b)


def _hosts(cfg, k):
    return [HFGenerator.from_config(cfg) for _ in range(k)]


def test_one_host_samples_every_variant_perturbed_and_restores():
    cfg = build(BASE)
    host = HFGenerator.from_config(cfg)
    tasks = LettersEnvironment().tasks()[:3]
    before = {n: p.detach().clone() for n, p in host.model.named_parameters()}
    with pytest.raises(RuntimeError, match="perturbations"):
        list(host.sample(tasks, [Variant(index=0, seed=1)]))
    host.perturbations(PerturbationSpec(("*",), (), 0.5))
    variants = [Variant(index=0), Variant(index=1, seed=7), Variant(index=2, seed=7, sign=-1), Variant(index=3, samples_per_task=2)]
    got = [c for b in host.sample(tasks, variants, seed=4) for c in b]
    assert [sum(c.variant == v.index for c in got) for v in variants] == [3, 3, 3, 6]
    texts = {v.index: [c.token_ids for c in got if c.variant == v.index] for v in variants}
    assert texts[1] != texts[0] and texts[2] != texts[1]  # the members really were perturbed, each its own way
    for v in variants:  # ... and each equals sampling that variant alone
        with host.applied(v):
            alone = host.generate(tasks, n=v.samples_per_task, variant=v.index, seed=4)
        assert [c.token_ids for c in alone] == texts[v.index]
    assert all(torch.equal(p, before[n]) for n, p in host.model.named_parameters())  # θ bit for bit
    with pytest.raises(ValueError, match="sign"):
        list(host.sample(tasks, [Variant(index=0, seed=1, sign=0)]))


def test_a_pool_deals_members_and_returns_what_one_host_returns():
    cfg = build(BASE)
    tasks = LettersEnvironment().tasks()[:5]
    spec = PerturbationSpec(("*",), (), 0.3)
    one, pool = _hosts(cfg, 1)[0], HostPool(_hosts(cfg, 2), granule=2)
    for h in (one, pool):
        info = h.perturbations(spec)
    assert info.numel > 0
    members = [Variant(index=i, seed=100 + i // 2, sign=1 if i % 2 == 0 else -1) for i in range(5)]
    work = pool.plan(tasks, members, 9)
    assert [[v.index for _, vs, _ in calls for v in vs] for calls in work] == [[0, 2, 4], [1, 3]]  # dealt round-robin
    assert _key(pool.sample(tasks, members, seed=9)) == _key(one.sample(tasks, members, seed=9))
    # An update reaches every copy: the pool's engines stay identical to the single host.
    terms = FullRankUpdate(((100, 0.01), (101, -0.02)))
    one.update(terms)
    pool.update(terms)
    a, b = one.state(), pool.hosts[1].state()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert _key(pool.sample(tasks, members, seed=9)) == _key(one.sample(tasks, members, seed=9))


def test_a_pool_shards_one_variant_over_engines_with_the_single_engine_seeds():
    cfg = build(BASE)
    tasks = LettersEnvironment().tasks()[:7]
    one, pool = _hosts(cfg, 1)[0], HostPool(_hosts(cfg, 2), granule=2)
    v = Variant(index=0, samples_per_task=3)
    work = pool.plan(tasks, [v], 5)
    assert [[(len(shard), seed) for shard, _, seed in calls] for calls in work] == [[(4, 5)], [(3, 5 + 4 * 3)]]
    assert _key(pool.sample(tasks, [v], seed=5)) == _key(one.sample(tasks, [v], seed=5))


def test_publish_reaches_every_engine_of_the_pool():
    cfg = build(BASE)
    tasks = LettersEnvironment().tasks()[:4]
    pool = HostPool(_hosts(cfg, 2), granule=2)
    model = pool.trainable().model
    assert model is pool.hosts[0].model
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    pool.publish(model)
    second = dict(pool.hosts[1].model.named_parameters())
    assert all(torch.equal(p, second[n]) for n, p in model.named_parameters())
    v = Variant(index=0, samples_per_task=2)
    assert _key(pool.sample(tasks, [v], seed=1)) == _key(HostPool(pool.hosts[:1]).sample(tasks, [v], seed=1))


def test_an_error_on_one_engine_stops_the_iteration_with_that_error():
    cfg = build(BASE)
    hosts = _hosts(cfg, 2)

    def broken(*args, **kwargs):
        raise RuntimeError("engine 1 lost its GPU")
        yield  # pragma: no cover

    hosts[1].sample = broken
    with pytest.raises(RuntimeError, match="engine 1 lost its GPU"):
        list(HostPool(hosts).sample(LettersEnvironment().tasks()[:2], [Variant(index=i) for i in range(4)]))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["es", "grpo"])
def test_vrl_train_with_two_engines_matches_one_engine(tmp_path: Path, optimizer: str):
    """The whole loop with runtime.local.engines=2 (two hf engines on this CPU) writes the same samples,
    metrics and ES history as with one engine: where a member or a shard ran does not matter."""
    rows = {}
    for engines in (1, 2):
        cfg = build(BASE, {"optimizer": optimizer, "iterations": 2, "runtime": {"local": {"engines": engines}},
                           "grpo": {"num_generations": 3, "learning_rate": 1e-2, "lr_scheduler_type": "constant"},
                           "logging": {"runs_dir": str(tmp_path), "name": f"{optimizer}-{engines}"}})
        Trainer(cfg, environment=LettersEnvironment(), runtime=LocalRuntime(), console=Console(file=io.StringIO())).run()
        run = tmp_path / f"{optimizer}-{engines}"
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        rows[engines] = [{k: r[k] for k in ("reward_mean", "tokens", "completions")} for r in metrics]
        samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
        rows[engines].append([{**r, "verdict": {**r["verdict"], "elapsed_s": None}} for r in samples])
        if optimizer == "es":
            rows[engines].append(ESHistory.read(run / "es_history.json").iterations)
    assert rows[1] == rows[2]


def test_optimizers_only_use_the_contract():
    """An optimizer works with any PolicyHost: a host that cannot train refuses GRPO with a reason."""
    cfg = build(BASE)

    class SampleOnly(HFGenerator):
        def trainable(self):
            raise Unsupported("sample-only host")

    host = SampleOnly.from_config(cfg)
    with pytest.raises(Unsupported, match="sample-only host"):
        GRPO(cfg.grpo, total_iterations=1).setup(host)
    es = ES(cfg.es, base={"model": "tiny"})
    es.setup(host)
    variants = es.ask()
    tasks = LettersEnvironment().tasks()[:2]
    results = [Result(task=next(t for t in tasks if t.id == c.task_id), completion=c, verdict=Verdict.ok(),
                      reward=float(c.variant)) for b in host.sample(tasks, variants, seed=1) for c in b]
    metrics = es.tell(results)
    assert metrics["es/member_reward_max"] == len(variants) - 1 and es.iteration == 1


def test_a_pools_weight_moves_run_on_every_host_side_by_side():
    """A pool's update (and load_state, publish) reaches its hosts at once, one thread each: the hosts
    here meet at a barrier inside `update`, which one-after-another calls could never pass. An error
    on one host is raised once every host has finished its move."""
    import threading

    class Meeting(PolicyHost):
        def __init__(self, barrier, fail=False):
            self.barrier, self.fail, self.updates = barrier, fail, []

        def sample(self, tasks, variants, seed=None):
            yield []

        def update(self, update):
            self.barrier.wait()  # both hosts must be inside update at the same time
            if self.fail:
                raise RuntimeError("engine lost")
            self.updates.append(update)

    barrier = threading.Barrier(2, timeout=60)
    hosts = [Meeting(barrier), Meeting(barrier)]
    HostPool(hosts).update("u1")
    assert [h.updates for h in hosts] == [["u1"], ["u1"]]
    hosts = [Meeting(barrier, fail=True), Meeting(barrier)]
    with pytest.raises(RuntimeError, match="engine lost"):
        HostPool(hosts).update("u2")
    assert hosts[1].updates == ["u2"]  # the healthy host finished its move


def test_one_engine_placed_on_a_gpu_is_that_engine_so_a_streamed_push_stays_streamed(monkeypatch):
    """`runtime.local.gpus=[2]` with one engine (under torchrun: rank 0's engine on a GPU of its own)
    gives the engine itself, not a pool of one: a pool draws a `WeightStream` into one whole copy before
    publishing, which is the memory the streamed push exists to avoid. Engines are recorded, not started
    (no GPU here); two engines still form a pool."""
    import vrl.runtime.local as local_mod
    from vrl.policy import WeightStream

    placed, published = [], []

    class Engine(PolicyHost):
        name = "recorded"

        def sample(self, tasks, variants, seed=None):
            yield from ()

        def publish(self, model):
            published.append(model)

    class Backend:
        @classmethod
        def engines(cls, config, needs, gpus):
            placed.append(list(gpus))
            return [Engine() for _ in gpus]

    monkeypatch.setattr(local_mod, "generator_class", lambda backend: Backend)
    host = LocalRuntime().policy(build(BASE, {"runtime": {"local": {"gpus": [2]}}}))
    assert placed == [["2"]] and isinstance(host, Engine)
    stream = WeightStream(iter([[("w", torch.zeros(1))]]))
    host.publish(stream)
    assert published == [stream]  # handed over as the stream, bucket by bucket
    pool = LocalRuntime().policy(build(BASE, {"runtime": {"local": {"engines": 2, "gpus": [0, 1]}}}))
    assert placed[-1] == ["0", "1"] and isinstance(pool, HostPool)


def test_pooled_engines_are_sized_for_the_members_each_one_is_dealt(monkeypatch):
    """A pool of K engines asks each for ⌈N/K⌉ variants per call (vLLM reserves a LoRA slot per low-rank
    member and runs its LoRA kernels over every slot), and `deal` never gives one engine more than that
    in a call, for any population and pool size (the invariant the sizing rests on)."""
    import vrl.runtime.local as local_mod
    from vrl.policy import HostNeeds, deal

    asked = []

    class Backend:
        @classmethod
        def engines(cls, config, needs, gpus):
            asked.append(needs.variants)
            return [HFGenerator.from_config(config) for _ in gpus]

    monkeypatch.setattr(local_mod, "generator_class", lambda backend: Backend)
    cfg = build(BASE, {"runtime": {"local": {"engines": 2}}})
    LocalRuntime().policy(cfg, HostNeeds("seeded", variants=30)).close()
    LocalRuntime().policy(build(BASE, {"runtime": {"local": {"engines": 4}}}), HostNeeds("seeded", variants=30)).close()
    LocalRuntime().policy(build(BASE), HostNeeds("seeded", variants=30)).close()  # one engine: not through a pool
    assert asked == [15, 8]
    tasks = LettersEnvironment().tasks()[:3]
    for n in range(1, 41):
        for k in range(1, 6):
            work = deal(tasks, [Variant(index=i) for i in range(n)], 0, k)
            assert max(len(vs) for calls in work for _, vs, _ in calls) <= -(-n // k), (n, k)
            assert {v.index for calls in work for _, vs, _ in calls for v in vs} == set(range(n))  # (n < k: sharded)


def _poisoning_stream(weights, size, drawn):
    """A `WeightStream` that keeps its contract to the letter: each bucket (`size` weights, copied into
    reused buffers) is valid only until the next is drawn, after which its tensors are overwritten with
    NaN, as a gather into reused memory would leave them. `drawn` counts the draws."""
    from vrl.policy import WeightStream

    items = list(weights.items())

    def gen():
        previous = []
        for start in range(0, len(items), size):
            for t in previous:
                t.fill_(float("nan"))
            bucket = [(n, t.detach().clone()) for n, t in items[start : start + size]]
            drawn.append(start)
            previous = [t for _, t in bucket]
            yield bucket
        for t in previous:
            t.fill_(float("nan"))

    return WeightStream(gen())


def test_a_pools_trainable_is_its_first_hosts_and_every_other_host_follows_it():
    """GRPO trains the copy the pool's first host hands out and publishes it to every host; each other host
    is told so (`follow_trained`), and loads no copy of its own. Without that, a pool of vLLM engines
    returned sampling log-probs from its first engine only, and GRPO dropped its sampling correction on
    every batch (tests/test_vllm_gpu.py and tests/test_driver_process.py check the engines' log-probs on a GPU)."""

    class Recording(PolicyHost):
        def __init__(self):
            self.calls = []

        def sample(self, tasks, variants, seed=None):
            yield []

        def trainable(self):
            self.calls.append("trainable")
            return f"copy of host {id(self)}"

        def follow_trained(self):
            self.calls.append("follow_trained")

    hosts = [Recording() for _ in range(3)]
    pool = HostPool(hosts)
    assert pool.trainable() == f"copy of host {id(hosts[0])}"
    assert [h.calls for h in hosts] == [["trainable"], ["follow_trained"], ["follow_trained"]]
    pool.trainable()  # told once: a later call asks the first host alone
    assert [h.calls for h in hosts] == [["trainable"] * 2, ["follow_trained"], ["follow_trained"]]


def test_a_streamed_push_reaches_every_engine_of_the_pool_bucket_by_bucket():
    """Several engines on rank 0 take FSDP2's streamed push a bucket at a time, side by side, with no
    whole copy: every engine ends with the trained weights although each bucket is poisoned as soon as
    the next is drawn (a pool that collected the stream whole, or drew ahead of an engine, ends with NaN)."""
    cfg = build(BASE)
    pool = HostPool(_hosts(cfg, 3), granule=2)
    trained = {n: p.detach() + 0.25 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
               for n, p in pool.hosts[0].model.named_parameters()}
    drawn = []
    pool.publish(_poisoning_stream(trained, 3, drawn))
    assert len(drawn) == -(-len(trained) // 3) > 2
    for host in pool.hosts:
        got = dict(host.model.named_parameters())
        assert all(torch.equal(got[n], t) for n, t in trained.items())


def test_an_engine_failing_in_a_streamed_push_leaves_the_others_whole_and_the_stream_drawn():
    """One engine fails in the middle of a streamed push: the others still get every bucket, the stream is
    drawn to its end (under torchrun every rank gathers each bucket together, so an undrawn stream would
    leave the other ranks waiting), and the engine's error is what the pool raises."""
    cfg = build(BASE)
    pool = HostPool(_hosts(cfg, 2), granule=2)
    trained = {n: p.detach() + 0.5 for n, p in pool.hosts[0].model.named_parameters()}
    broken = pool.hosts[1]
    real = broken.publish

    def fails_at_the_second_bucket(stream):
        def two():
            for i, bucket in enumerate(stream):
                if i == 1:
                    raise RuntimeError("engine 1 lost its GPU")
                yield bucket
        real(type(stream)(two()))

    broken.publish = fails_at_the_second_bucket
    drawn = []
    with pytest.raises(RuntimeError, match="engine 1 lost its GPU"):
        pool.publish(_poisoning_stream(trained, 2, drawn))
    assert len(drawn) == -(-len(trained) // 2) > 3
    got = dict(pool.hosts[0].model.named_parameters())
    assert all(torch.equal(got[n], t) for n, t in trained.items())


def test_a_stream_that_fails_ends_every_engines_push_and_its_own_error_is_raised():
    """The stream itself fails mid-push (a gather that errs): every engine's push ends (none waits for a
    bucket that will not come) and the pool raises the stream's error, not an engine's echo of it."""
    import threading

    from vrl.policy import WeightStream

    cfg = build(BASE)
    pool = HostPool(_hosts(cfg, 2), granule=2)
    items = list(pool.hosts[0].model.named_parameters())

    def gen():
        yield [(n, p.detach().clone()) for n, p in items[:2]]
        raise OSError("the gather lost rank 1")

    with pytest.raises(OSError, match="the gather lost rank 1"):
        pool.publish(WeightStream(gen()))
    assert not [t for t in threading.enumerate() if t.name.startswith("vrl-host-")]
