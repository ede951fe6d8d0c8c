"""Asynchronous GRPO rollouts (grpo.max_staleness, `vrl.rollouts`) with the real Trainer, the tiny model
and the hf backend on CPU. vLLM cannot run here; the hf backend's decoupled mode (a training copy,
weights that change only by `publish`, sampling log-probs) is what a vLLM engine is by construction.

Orderings are checked with events recorded by the threads themselves, never with wall-clock bounds.
"""

from __future__ import annotations

import io
import threading

import pytest
import torch
from rich.console import Console

from vrl import rollouts
from vrl.config import SamplingConfig, build
from vrl.envs.letters import LettersEnvironment
from vrl.errors import UsageError
from vrl.generate import tiny
from vrl.generate.hf import HFGenerator
from vrl.optim import grpo as grpo_mod
from vrl.optim.grpo import GRPO
from vrl.optim.logprobs import completion_logprobs, pack
from vrl.policy import Variant
from vrl.rundir import RunDir
from vrl.runtime.local import LocalRuntime
from vrl.trainer import Trainer
from vrl.types import Task

TIMING = ("time", "loop_s", "generation_s", "verification_s", "verify_wait_s", "update_s", "save_s", "tokens_per_s")


def config(tmp_path, name: str, iterations: int = 4, extra: dict | None = None, **grpo):
    grpo = {"num_generations": 4, "learning_rate": 1e-2, "micro_batch_size": 6, "lr_scheduler_type": "constant", **grpo}
    return build({"plugin": "letters", "optimizer": "grpo", "iterations": iterations, "tasks_per_iteration": 3,
                  "sampling": {"max_new_tokens": 12, "temperature": 1.0, "batch_size": 2}, "grpo": grpo,
                  "logging": {"runs_dir": str(tmp_path), "name": name}}, extra or {})


def quiet() -> Console:
    return Console(file=io.StringIO())


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("time/")} for r in rows]


def producer_alive() -> bool:
    return any(t.name == "vrl-rollouts" and t.is_alive() for t in threading.enumerate())


class Watched(LocalRuntime):
    """The local runtime; its hf generator records, per sampling pass, a fingerprint of the sampled weights at
    every forward call, and the order in which passes end and updates return (`events`)."""

    def __init__(self, fail_in_pass: int | None = None):
        super().__init__()
        self.fail_in_pass = fail_in_pass
        self.passes: list[list[float]] = []  # fingerprints seen by each pass's forward calls
        self.events: list[tuple[str, int]] = []
        self.gen: HFGenerator | None = None

    def policy(self, config, needs=None):
        gen = super().policy(config, needs)
        self.gen = gen
        original = gen.sample

        def fingerprint(module, args):
            if self.passes and module is gen.model:  # (a training copy deep-copies this hook)
                self.passes[-1].append(sum(float(p.double().sum()) for p in gen.model.parameters()))

        gen.model.register_forward_pre_hook(fingerprint)

        def sample(tasks, variants, seed=None):
            index = len(self.passes)
            self.passes.append([])
            for i, batch in enumerate(original(tasks, variants, seed)):
                if index == self.fail_in_pass and i == 1:
                    raise RuntimeError("the engine died mid-pass")
                yield batch
            self.events.append(("pass_end", index))

        gen.sample = sample
        return gen


def observe_tells(monkeypatch, events: list[tuple[str, int]]) -> list[list]:
    """Record each update's results, and when it returns."""
    seen, tell = [], GRPO.tell

    def spy(self, results):
        seen.append(list(results))
        out = tell(self, results)
        events.append(("tell_end", self.iteration - 1))
        return out

    monkeypatch.setattr(GRPO, "tell", spy)
    return seen


# -- max_staleness = 0: today's loop --------------------------------------------------------------------
def test_max_staleness_0_is_the_synchronous_loop(tmp_path, monkeypatch):
    """0 (the default, or given) runs the trainer's own loop: same numbers as a run that never heard of the
    field, no producer, the generator trains its own module in place, no sampling log-probs."""

    def no_pipeline(*args, **kwargs):
        raise AssertionError("max_staleness=0 went through vrl.rollouts")

    plain = Trainer(config(tmp_path, "plain", 3), environment=LettersEnvironment(), console=quiet())
    assert plain.run()["status"] == "finished"
    monkeypatch.setattr(rollouts.Rollouts, "__init__", no_pipeline)
    monkeypatch.setattr(rollouts.VersionedHost, "__init__", no_pipeline)
    runtime = Watched()
    zero = Trainer(config(tmp_path, "zero", 3, max_staleness=0), environment=LettersEnvironment(), runtime=runtime,
                   console=quiet())
    assert zero.run()["status"] == "finished"
    a, b = plain.run_dir.metrics(), zero.run_dir.metrics()
    assert untimed(a) == untimed(b) and len(a) == 3
    assert not any(k.startswith(("grpo/staleness", "grpo/sampling", "time/")) for k in b[0])
    assert runtime.gen.trainable().model is runtime.gen.model


# -- max_staleness = 1 --------------------------------------------------------------------------------------
def test_max_staleness_1_pipelines_within_the_bound_and_corrects(tmp_path, monkeypatch):
    runtime = Watched()
    seen = observe_tells(monkeypatch, runtime.events)
    weights = []
    loss = grpo_mod.grpo_loss

    def loss_spy(*args, **kw):
        weights.append(kw.get("sampling_weight"))
        return loss(*args, **kw)

    monkeypatch.setattr(grpo_mod, "grpo_loss", loss_spy)
    trainer = Trainer(config(tmp_path, "one", 4, max_staleness=1), environment=LettersEnvironment(), runtime=runtime,
                      console=quiet())
    assert trainer.run()["status"] == "finished"
    assert not producer_alive()
    rows = trainer.run_dir.metrics()
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]

    # Every trained batch is within the bound; after the first, exactly one update old (pipelined).
    assert [r["grpo/staleness/max"] for r in rows] == [0, 1, 1, 1]
    assert [r["grpo/staleness/mean"] for r in rows] == [0, 1, 1, 1]
    for k, results in enumerate(seen):
        assert {k - r.completion.weights_version for r in results} == {min(k, 1)}
    # The pass of iteration k+1 ended before the update of iteration k returned: they overlapped.
    ev = runtime.events
    for k in range(3):
        assert ev.index(("pass_end", k + 1)) < ev.index(("tell_end", k)), ev

    # No pass saw its weights change; the weights did change between passes (they were published).
    assert len(runtime.passes) == 4 and all(p for p in runtime.passes)
    for prints in runtime.passes:
        assert len(set(prints)) == 1, prints
    firsts = [p[0] for p in runtime.passes]
    assert firsts[0] == firsts[1] and len(set(firsts[1:])) == 3  # passes 0 and 1 sampled version 0

    # The sampler's log-probs came with every completion and the correction weighted the loss.
    for results in seen:
        assert all(r.completion.logprobs is not None and len(r.completion.logprobs) == len(r.completion.token_ids)
                   for r in results)
    assert weights and all(w is not None for w in weights)
    assert runtime.gen.trainable().model is not runtime.gen.model  # trained on a separate copy
    for r in rows:
        assert {"grpo/sampling_kl", "grpo/sampling/importance_sampling_ratio/mean", "time/wait_for_rollouts_s",
                "time/wait_for_trainer_s", "time/publish_wait_s"} <= set(r)
        assert min(r["time/wait_for_rollouts_s"], r["time/wait_for_trainer_s"], r["time/publish_wait_s"]) >= 0
    # Fresh weights: the sampler and the trainer agree (up to float rounding); stale ones: they do not.
    assert rows[0]["grpo/sampling_kl"] < 1e-6
    assert min(r["grpo/sampling_kl"] for r in rows[1:]) > 1e-4


def test_max_staleness_2_is_respected_and_the_run_is_reproducible(tmp_path):
    runs = []
    for name in ("a", "b"):
        trainer = Trainer(config(tmp_path, name, 5, max_staleness=2), environment=LettersEnvironment(), console=quiet())
        assert trainer.run()["status"] == "finished"
        runs.append(trainer.run_dir.metrics())
    assert [r["grpo/staleness/max"] for r in runs[0]] == [0, 1, 2, 2, 2]
    assert untimed(runs[0]) == untimed(runs[1])  # the schedule, not thread timing, decides what is sampled


# -- failures and stops ----------------------------------------------------------------------------------
def test_an_error_in_the_producer_stops_the_run_with_that_error(tmp_path, monkeypatch):
    """Pass 2 (iteration 2, sampled while iteration 1 trains) fails mid-pass: the update waiting to publish
    raises the producer's error, the run fails with it, keeps iterations 0 and 1, and no thread is left."""
    runtime = Watched(fail_in_pass=2)
    trainer = Trainer(config(tmp_path, "boom", 4, max_staleness=1), environment=LettersEnvironment(), runtime=runtime,
                      console=quiet())
    with pytest.raises(RuntimeError, match="the engine died mid-pass"):
        trainer.run()
    assert not producer_alive()
    run = RunDir.open(trainer.run_dir.path)
    assert run.summary()["status"] == "failed" and "engine died" in run.summary()["error"]
    assert run.completed_iterations() == 1  # iteration 1's update could not publish: it is not finished


def test_ctrl_c_drains_the_producer_and_a_resume_restarts_the_pipeline(tmp_path):
    def stop_after_two(metrics):
        if metrics["iteration"] == 1:
            raise KeyboardInterrupt

    runtime = Watched()
    cfg = config(tmp_path, "stop", 5, max_staleness=1)
    first = Trainer(cfg, environment=LettersEnvironment(), runtime=runtime, console=quiet(), on_iteration=stop_after_two)
    assert first.run()["status"] == "interrupted"
    assert not producer_alive()
    assert first.run_dir.completed_iterations() == 2
    assert len(runtime.passes) <= 4  # passes 0..2 made, at most one more started before the stop was seen

    second = Trainer(cfg, run_dir=RunDir.open(first.run_dir.path), environment=LettersEnvironment(), console=quiet())
    assert second.start_iteration == 2 and second.run()["status"] == "finished"
    rows = second.run_dir.metrics()
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4]
    # The pipeline restarts from the checkpoint: the first batch after the resume is fresh.
    assert [r["grpo/staleness/max"] for r in rows] == [0, 1, 0, 1, 1]


# -- the hf backend's decoupled mode ----------------------------------------------------------------------
def make_generator(top_p: float = 1.0) -> HFGenerator:
    sampling = SamplingConfig(temperature=0.7, top_p=top_p, max_new_tokens=10, batch_size=4)
    return HFGenerator(tiny.build_model(), tiny.build_tokenizer(), sampling)


TASKS = [Task(id=f"t{i}", prompt=f"Task {i}: write letters.\n") for i in range(3)]


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_hf_sampling_logprobs_are_those_of_the_distribution_sampled(top_p):
    """Decoupled, the hf backend reports vLLM's `processed_logprobs`: log-softmax of logits / T, cut to the
    top-p nucleus and renormalised. With top_p = 1 that is exactly GRPO's training log-prob."""
    gen = make_generator(top_p)
    gen.decouple()
    comps = gen.generate(TASKS, n=3, seed=5)
    assert all(len(c.logprobs) == len(c.token_ids) > 0 for c in comps)
    with torch.no_grad():
        for c in comps:
            ids = torch.tensor([c.prompt_token_ids + c.token_ids])
            logits = gen.model(input_ids=ids).logits[0, len(c.prompt_token_ids) - 1 : -1].double() / 0.7
            probs = logits.softmax(-1)
            ordered, order = probs.sort(-1, descending=True)
            before = ordered.cumsum(-1) - ordered  # mass of the tokens ranked above each token
            keep = torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, before < top_p)
            expected = torch.where(keep, probs, 0.0)
            expected = (expected / expected.sum(-1, keepdim=True)).log()
            expected = expected.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=1e-5)
    if top_p == 1.0:
        with torch.no_grad():
            trained = completion_logprobs(gen.model, pack([c.prompt_token_ids for c in comps],
                                                          [c.token_ids for c in comps], gen.tokenizer.pad_token_id), 0.7)
        for row, c in enumerate(comps):
            torch.testing.assert_close(trained[row, : len(c.logprobs)], torch.tensor(c.logprobs), atol=1e-5, rtol=1e-5)
    again = gen.generate(TASKS, n=3, seed=5)
    assert [c.token_ids for c in again] == [c.token_ids for c in comps]  # seeded per row, not by the global RNG


def test_decoupled_hf_trains_a_copy_that_reaches_sampling_only_by_publish():
    gen = make_generator()
    gen.decouple()
    model = gen.trainable().model
    assert model is not gen.model and gen.trainable().model is model
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    first = next(gen.model.parameters())
    assert not torch.equal(first, next(model.parameters()))
    gen.publish(model)
    assert all(torch.equal(a, b) for a, b in zip(gen.model.parameters(), model.parameters()))
    with pytest.raises(RuntimeError, match="before trainable"):
        gen.decouple()


def test_publish_waits_for_the_pass_in_flight():
    """A publish that arrives mid-pass waits for the pass to end; the pass's completions carry the version it
    sampled, and the next pass samples the published weights."""
    gen = make_generator()
    host = rollouts.VersionedHost(gen, lead=1)
    trained = host.trainable().model
    with torch.no_grad():
        next(trained.parameters()).mul_(1.5)
    stream = host.sample(TASKS, [Variant(index=0, samples_per_task=2)], seed=3)
    first = next(stream)  # the pass holds the weights until the stream ends
    published = threading.Event()
    thread = threading.Thread(target=lambda: (host.publish(trained), published.set()))
    thread.start()
    thread.join(0.5)
    assert not published.is_set() and host.version == 0
    rest = [c for batch in stream for c in batch]  # the pass runs to its end on the old weights
    thread.join(60)
    assert published.is_set() and host.version == 1
    assert {c.weights_version for c in first + rest} == {0}
    assert all(torch.equal(a, b) for a, b in zip(gen.model.parameters(), trained.parameters()))
    later = [c for batch in host.sample(TASKS[:1], [Variant(index=0)], seed=3) for c in batch]
    assert {c.weights_version for c in later} == {1}


# -- refusals -------------------------------------------------------------------------------------------------
def test_what_cannot_run_asynchronously_is_refused_in_one_line(tmp_path, monkeypatch):
    es = build({"plugin": "letters", "optimizer": "es", "grpo": {"max_staleness": 1},
                "logging": {"runs_dir": str(tmp_path), "name": "es"}})
    with pytest.raises(UsageError, match=r"optimizer=es .* leave grpo.max_staleness at 0") as err:
        Trainer(es, environment=LettersEnvironment(), console=quiet())
    assert "\n" not in str(err.value) and not (tmp_path / "es").exists()
    grpo = config(tmp_path, "x", max_staleness=1)
    rollouts.check(grpo)  # the hf backend, one process: fine
    with pytest.raises(UsageError, match="vllm_importance_sampling_mode is 'sequence_mask'; set it to token_truncate"):
        GRPO.check_fits(config(tmp_path, "x", loss_type="vespo", max_staleness=1), None)  # a decoupled host reports log-probs
    from vrl.generate import generator_class
    from vrl.policy import PolicyHost

    rollouts.check(config(tmp_path, "x", extra={"generator": {"backend": "vllm"}}, max_staleness=1))  # it decouples
    monkeypatch.setattr(generator_class("vllm"), "decouple", PolicyHost.decouple)  # a backend that cannot
    with pytest.raises(UsageError, match="generator.backend=vllm cannot sample while the policy trains"):
        rollouts.check(config(tmp_path, "x", extra={"generator": {"backend": "vllm"}}, max_staleness=1))
    # What the vLLM host still refuses (its settings, checked in the same place).
    monkeypatch.undo()
    for setting, words in (({"sampling_logprobs": False, "sync_every": 1}, "sampling_logprobs=true"),
                           ({"sleep": True}, "sleep=true"), ({"sync_every": 2}, "sync_every=2")):
        cfg = config(tmp_path, "x", extra={"generator": {"backend": "vllm", "vllm": setting}}, max_staleness=1)
        with pytest.raises(UsageError, match=words):
            rollouts.check(cfg)


def test_a_pool_of_engines_samples_asynchronously_and_every_engine_gets_the_weights(tmp_path):
    """runtime.local.engines=2: each engine is decoupled, the first one's training copy is trained, and every
    publish reaches both sampling copies."""
    runtime = LocalRuntime()
    policy = runtime.policy
    hosts = []

    def keep(config, needs=None):
        pool = policy(config, needs)
        hosts.extend(pool.hosts)
        return pool

    runtime.policy = keep
    cfg = config(tmp_path, "pool", 3, extra={"runtime": {"local": {"engines": 2}}}, max_staleness=1)
    trainer = Trainer(cfg, environment=LettersEnvironment(), runtime=runtime, console=quiet())
    assert trainer.run()["status"] == "finished"
    assert [r["grpo/staleness/max"] for r in trainer.run_dir.metrics()] == [0, 1, 1]
    trained = hosts[0].trainable().model
    assert all(h.model is not trained for h in hosts)
    for h in hosts:
        assert all(torch.equal(a, b) for a, b in zip(h.model.parameters(), trained.parameters()))
