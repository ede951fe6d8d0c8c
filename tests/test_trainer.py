"""The fixed loop: overlap of generation and verification, and a run directory that survives Ctrl-C."""

import asyncio
import itertools
import json
import os
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from vrl.config import build
from vrl.envs.letters import LettersEnvironment, LettersVerifier
from vrl.errors import PluginError, RunDirError, UsageError
from vrl.rundir import RunDir
from vrl.runtime.local import LocalRuntime
from vrl.trainer import Trainer
from vrl.types import Verdict


def small_config(tmp_path, **overrides):
    layer = {
        "iterations": 3,
        "tasks_per_iteration": 4,
        "sampling": {"max_new_tokens": 8, "batch_size": 4},
        "es": {"population_size": 2},
        "logging": {"runs_dir": str(tmp_path), "name": "run"},
    }
    return build(layer, overrides)


class SlowChars(LettersEnvironment):
    """The toy environment with a verifier that takes `delay` seconds per batch (like a Lean server)
    and sets `verified` once its first batch is judged."""

    def __init__(self, delay):
        super().__init__()
        self.delay = delay
        self.verified = threading.Event()

    def verifier(self):
        delay, verified = self.delay, self.verified

        class Slow(LettersVerifier):
            async def verify(self, attempts):
                await asyncio.sleep(delay)
                verdicts = [self.check(a) for a in attempts]
                verified.set()
                return verdicts

        return Slow()


class WatchedSampling(LocalRuntime):
    """The local runtime, whose sampling stream, once the trainer has taken its first batch, waits for
    `verified` before it makes the next one and records whether it came (`overlapped`). A loop that
    verifies only after generation never sets it while the stream is open: the wait runs out."""

    def __init__(self, verified: threading.Event):
        super().__init__()
        self.verified = verified
        self.overlapped: list[bool] = []

    def policy(self, config, needs=None):
        host = super().policy(config, needs)
        original = host.sample

        def sample(tasks, variants, seed=None):
            inner = original(tasks, variants, seed=seed)
            try:
                for i, batch in enumerate(inner):
                    yield batch
                    if i == 0:  # the trainer handed batch 0 on and asks for batch 1
                        self.overlapped.append(self.verified.wait(120))  # generous: only a serial loop runs out
            finally:
                inner.close()

        host.sample = sample
        return host


@pytest.mark.slow
def test_verification_overlaps_generation(tmp_path):
    """A batch is judged while later batches are still being generated (an ordering, not a timing)."""
    cfg = small_config(
        tmp_path,
        iterations=1,
        tasks_per_iteration=8,
        sampling={"max_new_tokens": 48, "batch_size": 2},
        es={"population_size": 4},
        verifier={"batch_size": 2, "concurrency": 1},
    )
    delay = 0.05  # per batch of 2 attempts, like a remote checker; 16 batches -> 0.8 s of verification
    env = SlowChars(delay)
    runtime = WatchedSampling(env.verified)
    trainer = Trainer(cfg, environment=env, runtime=runtime)
    trainer.run()
    assert runtime.overlapped == [True]  # batch 0 was judged before batch 1 was generated
    m = trainer.run_dir.metrics()[0]
    assert m["completions"] == 32
    assert m["verification_s"] >= 16 * delay * 0.95, m  # the verifier's busy time is measured (a lower bound)


def test_metrics_samples_and_summary(tmp_path):
    cfg = small_config(tmp_path, logging={"samples_per_iteration": 3})
    summary = Trainer(cfg, environment=LettersEnvironment()).run()
    run = RunDir.open(tmp_path / "run")
    rows = run.metrics()
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["completions"] == 4 * 2  # tasks x members
        assert 0 <= r["reward_mean"] <= r["reward_max"] <= 1
        assert r["tokens"] > 0 and r["generation_s"] > 0 and r["loop_s"] >= r["generation_s"]
        assert sum(r[f"status/{s}"] for s in ("passed", "failed", "timeout", "crashed", "rejected")) == 8
    samples = [json.loads(line) for line in (run.path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 9 and {"completion", "verdict", "reward", "prompt"} <= set(samples[0])
    assert summary["status"] == "finished" and summary["iterations_completed"] == 3
    assert json.loads((run.path / "summary.json").read_text())["reward_last"] == rows[-1]["reward_mean"]
    assert json.loads((run.path / "config.json").read_text())["es"]["population_size"] == 2
    assert "torch" in json.loads((run.path / "versions.json").read_text())


def test_task_schedule_is_deterministic_and_covers_the_pool(tmp_path):
    trainer = Trainer(small_config(tmp_path), environment=LettersEnvironment(size=6))
    pool = trainer._task_pool()
    first_epoch = [t.id for i in range(3) for t in trainer.tasks_for(pool, i)][:6]
    assert sorted(first_epoch) == sorted(t.id for t in pool)
    assert [t.id for t in trainer.tasks_for(pool, 4)] == [t.id for t in trainer.tasks_for(pool, 4)]


class SharedIds(LettersEnvironment):
    """Letters whose second and fifth tasks carry one id (different prompts and answers)."""

    def tasks(self, split="train", limit=None):
        tasks = super().tasks(split, limit)
        return [t.model_copy(update={"id": tasks[1].id}) if i == 4 else t for i, t in enumerate(tasks)]


def test_tasks_that_share_an_id_are_refused_before_the_run_starts(tmp_path):
    """Completions are joined to their tasks by id: two tasks under one id would be judged against each other's
    answers, so the trainer refuses the split in one line naming the id, and writes no run."""
    env = SharedIds(size=6)
    shared = env.tasks()[1].id
    with pytest.raises(UsageError, match=rf"split 'train': 1 task id\(s\) are used by more than one task "
                                         rf"\(e.g. '{shared}', 2 times\)"):
        Trainer(small_config(tmp_path), environment=env)
    assert not (tmp_path / "run").exists()


def test_ctrl_c_between_iterations_keeps_finished_work(tmp_path):
    def stop_after_two(metrics):
        if metrics["iteration"] == 1:
            raise KeyboardInterrupt

    summary = Trainer(small_config(tmp_path, iterations=5), environment=LettersEnvironment(), on_iteration=stop_after_two).run()
    run = RunDir.open(tmp_path / "run")
    assert summary["status"] == "interrupted"
    assert run.completed_iterations() == 2
    assert [r["iteration"] for r in run.metrics()] == [0, 1]
    assert json.loads((run.path / "summary.json").read_text())["status"] == "interrupted"
    assert json.loads((run.path / "es_history.json").read_text())


def test_ctrl_c_mid_iteration_loses_only_that_iteration(tmp_path):
    class InterruptingEnv(LettersEnvironment):
        calls = 0

        def shaper(self):
            base = super().shaper()

            def shape(task, completion, verdict):
                InterruptingEnv.calls += 1
                if InterruptingEnv.calls > 8 + 3:  # inside the second iteration
                    raise KeyboardInterrupt
                return base(task, completion, verdict)

            return shape

    summary = Trainer(small_config(tmp_path), environment=InterruptingEnv()).run()
    run = RunDir.open(tmp_path / "run")
    assert summary["status"] == "interrupted"
    assert run.completed_iterations() == 1 and len(run.metrics()) == 1
    for name in ("config.json", "summary.json", "state.json", "versions.json"):
        json.loads((run.path / name).read_text())  # every file is whole


class SignalsWhileVerifying(LettersEnvironment):
    """The toy environment whose verifier, once `armed`, sends this process SIGTERM half a second into a
    batch and then takes ten minutes (cancelled when the run stops)."""

    def __init__(self):
        super().__init__()
        self.armed = threading.Event()

    def verifier(self):
        armed = self.armed

        class Stalls(LettersVerifier):
            async def verify(self, attempts):
                if armed.is_set():
                    await asyncio.sleep(0.5)  # the trainer is waiting for this verdict by now
                    os.kill(os.getpid(), signal.SIGTERM)
                    await asyncio.sleep(600)
                return [self.check(a) for a in attempts]

        return Stalls()


def as_rank_0_of_a_launch(monkeypatch) -> None:
    """This process is told it is rank 0 of a 2-process torchrun launch (`vrl.distributed.world_size`),
    while the process group the update rule starts (ES under torchrun: `grpo_dist.Group`) is a real gloo
    group of this one process: the stop logic sees a launch, the collectives have no one to wait for."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("vrl.distributed.world_size", lambda: 2)


@pytest.mark.parametrize("world", [1, 2])
def test_sigterm_while_verifying_stops_at_once(tmp_path, monkeypatch, world):
    """SIGTERM while an iteration waits for its verifier interrupts it at once: on one process, and as rank 0
    of a torchrun launch (world 2: the stop logic is told so, ES's process group is this process alone; rank 0 makes no collective call while it
    samples or verifies, so it need not finish the iteration). Iteration 0 is kept, iteration 1 dropped."""
    env = SignalsWhileVerifying()
    trainer = Trainer(small_config(tmp_path, iterations=4), environment=env, on_iteration=lambda m: env.armed.set())
    if world == 2:
        as_rank_0_of_a_launch(monkeypatch)
    summary = trainer.run()
    assert summary["status"] == "interrupted"
    assert RunDir.open(tmp_path / "run").completed_iterations() == 1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back


@pytest.mark.parametrize("world", [1, 2])
def test_sigterm_during_the_update_waits_for_it_only_under_torchrun(tmp_path, monkeypatch, world):
    """SIGTERM inside the update: one process drops the iteration at once (as Ctrl-C does); rank 0 of a
    torchrun launch (world 2, as above) lets it end, since the other ranks are inside its collectives, and
    stops before the next one, with that iteration kept."""
    from vrl.optim.es import ES

    tell = ES.tell

    def tell_then_signal(self, results):
        os.kill(os.getpid(), signal.SIGTERM)
        return tell(self, results)

    monkeypatch.setattr(ES, "tell", tell_then_signal)
    trainer = Trainer(small_config(tmp_path, iterations=4), environment=LettersEnvironment())
    if world == 2:
        as_rank_0_of_a_launch(monkeypatch)
    summary = trainer.run()
    assert summary["status"] == "interrupted"
    assert RunDir.open(tmp_path / "run").completed_iterations() == (1 if world == 2 else 0)


def test_sigterm_inside_a_finalizer_stops_the_run_at_the_iterations_end_without_a_traceback(tmp_path, monkeypatch):
    """SIGTERM that lands while a `__del__` runs (seen in a `regex` object's, during a real `vrl train`):
    raised there, the KeyboardInterrupt was printed as "Exception ignored in ... __del__" with a traceback
    and dropped. Now the run finishes that iteration and stops before the next: interrupted, the
    iteration kept, nothing reported as unraisable."""
    from vrl.optim.es import ES

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    tell = ES.tell

    class SignalsWhenCollected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # the handler runs here, inside __del__

    def tell_collecting(self, results):
        SignalsWhenCollected()  # collected at once: its __del__ runs inside the update
        return tell(self, results)

    monkeypatch.setattr(ES, "tell", tell_collecting)
    summary = Trainer(small_config(tmp_path, iterations=4), environment=LettersEnvironment()).run()
    assert summary["status"] == "interrupted"
    assert RunDir.open(tmp_path / "run").completed_iterations() == 1
    assert unraisable == []


def test_exception_marks_run_failed_and_propagates(tmp_path):
    def explode(metrics):
        if metrics["iteration"] == 1:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        Trainer(small_config(tmp_path), environment=LettersEnvironment(), on_iteration=explode).run()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "disk full" in summary["error"]
    assert summary["iterations_completed"] == 2


def test_crashing_verifier_scores_crashed_without_losing_the_iteration(tmp_path):
    """A verifier whose `verify` raises on one batch costs that batch's verdicts (`crashed`), not the run."""

    class Broken(LettersEnvironment):
        def verifier(self):
            class Boom(LettersVerifier):
                calls = 0

                async def verify(self, attempts):
                    Boom.calls += 1
                    if Boom.calls == 1:
                        raise ConnectionError("server went away")
                    return await super().verify(attempts)

            return Boom()

    summary = Trainer(small_config(tmp_path, iterations=1, verifier={"batch_size": 2}), environment=Broken()).run()
    assert summary["status"] == "finished"
    m = RunDir.open(tmp_path / "run").metrics()[0]
    assert m["status/crashed"] == 2 and m["completions"] == 8
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    details = [s["verdict"]["detail"] for s in samples if s["verdict"]["status"] == "crashed"]
    assert details and all("ConnectionError: server went away" in d for d in details)


# -- a broken plugin stops the run before its first update (issue 26) -----------------------------


class TypoInCheck(LettersVerifier):
    """A plugin's check with a typo: `completion.txt` for `completion.text` raises on every attempt."""

    def check(self, attempt):
        return Verdict.ok() if attempt.completion.txt else Verdict.fail("failed", "empty")


def counting_tell(monkeypatch) -> list[int]:
    """Count the optimizer's updates (`ES.tell`)."""
    from vrl.optim.es import ES

    told: list[int] = []
    original = ES.tell

    def tell(self, results):
        told.append(len(results))
        return original(self, results)

    monkeypatch.setattr(ES, "tell", tell)
    return told


def test_a_check_that_always_raises_stops_at_iteration_0_before_the_update(tmp_path, monkeypatch):
    told = counting_tell(monkeypatch)

    class Env(LettersEnvironment):
        def verifier(self):
            return TypoInCheck()

    trainer = Trainer(small_config(tmp_path), environment=Env())
    with pytest.raises(PluginError) as info:
        trainer.run()
    message = str(info.value)
    assert "\n" not in message
    for fragment in ("environment 'letters'", "its verifier raised on all 8 attempts of iteration 0",
                     "AttributeError: 'Completion' object has no attribute 'txt'", "test_trainer.py:",
                     "in check)", "stopped before this iteration's update"):
        assert fragment in message, message
    assert told == []  # the optimizer never learnt from the crashes
    assert not (tmp_path / "run").exists()  # a new run that finished no iteration leaves nothing


def test_a_verifier_that_breaks_later_stops_there_keeping_finished_iterations(tmp_path, monkeypatch):
    """The rule holds for every iteration: the one whose verdicts are all verifier errors is never told."""
    told = counting_tell(monkeypatch)

    class BreaksAfterOne(LettersVerifier):
        calls = 0

        def check(self, attempt):
            BreaksAfterOne.calls += 1
            if BreaksAfterOne.calls > 8:  # every attempt from iteration 1 on
                raise KeyError("answer")
            return super().check(attempt)

    class Env(LettersEnvironment):
        def verifier(self):
            return BreaksAfterOne()

    with pytest.raises(PluginError, match=r"all 8 attempts of iteration 1 .*the first: KeyError: 'answer'"):
        Trainer(small_config(tmp_path, iterations=3), environment=Env()).run()
    assert told == [8]
    run = RunDir.open(tmp_path / "run")
    assert [m["iteration"] for m in run.metrics()] == [0]
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["status"] == "failed" and "PluginError" in summary["error"] and summary["iterations_completed"] == 1
    assert len(json.loads((run.path / "es_history.json").read_text())["iterations"]) == 1


def test_a_verify_that_always_raises_stops_the_run(tmp_path, monkeypatch):
    told = counting_tell(monkeypatch)

    class Env(LettersEnvironment):
        def verifier(self):
            class Boom(LettersVerifier):
                async def verify(self, attempts):
                    raise ConnectionError("server went away")

            return Boom()

    with pytest.raises(PluginError, match=r"the first: verifier 'letters' raised ConnectionError: server went away \("):
        Trainer(small_config(tmp_path), environment=Env()).run()
    assert told == []


def test_a_check_that_raises_on_some_attempts_does_not_stop_the_run(tmp_path):
    checks = itertools.count()

    class SometimesRaises(LettersVerifier):
        def check(self, attempt):
            if next(checks) % 2:  # every other attempt: 4 of the 8 of each iteration
                raise ValueError("cannot parse this one")
            return super().check(attempt)

    class Env(LettersEnvironment):
        def verifier(self):
            return SometimesRaises()

    summary = Trainer(small_config(tmp_path), environment=Env()).run()
    assert summary["status"] == "finished" and summary["iterations_completed"] == 3
    rows = RunDir.open(tmp_path / "run").metrics()
    assert sum(r["status/crashed"] for r in rows) > 0
    assert all(r["status/crashed"] < r["completions"] for r in rows)


def test_most_attempts_raising_stops_the_run_and_fewer_are_reported_once_per_kind(tmp_path, monkeypatch):
    """Issue 26 item 1: more than verifier.max_error_fraction (0.5) of an iteration's verdicts being the
    verifier's own errors stops the run before the update; at or under the setting the run goes on and
    each kind of error (type and place) is reported once on the console, however often it recurs."""
    import io

    from rich.console import Console

    told = counting_tell(monkeypatch)

    def raising(every: int):
        checks = itertools.count()

        class MostlyRaises(LettersVerifier):
            def check(self, attempt):
                n = next(checks)
                if every and n % every == 5:  # a second kind of error, from another line (once per iteration)
                    raise KeyError("missing")
                if n % 4 != 0:  # 3 of every 4 attempts: 6 of the 8 of an iteration
                    raise ValueError("cannot parse this one")
                return super().check(attempt)

        class Env(LettersEnvironment):
            def verifier(self):
                return MostlyRaises()

        return Env()

    with pytest.raises(PluginError, match=r"raised on 6 of 8 attempts of iteration 0 \(verifier.max_error_fraction=0.5\); "
                                          r"the first: ValueError: cannot parse this one"):
        Trainer(small_config(tmp_path), environment=raising(every=0)).run()
    assert told == []
    out = io.StringIO()
    console = Console(file=out, width=300)
    # Each member keeps one judged attempt per iteration (the verifier's errors have no reward, issue 56: a member
    # with none would be lost).
    cfg = small_config(tmp_path / "tolerant", verifier={"max_error_fraction": 1.0})
    summary = Trainer(cfg, environment=raising(every=8), console=console).run()
    assert summary["status"] == "finished" and told == [8, 8, 8]
    reports = [line for line in out.getvalue().splitlines() if "reported once" in line]
    assert len(reports) == 2, reports  # ValueError and KeyError, each once over three iterations
    assert any("ValueError: cannot parse this one" in r for r in reports)
    assert any("KeyError: 'missing'" in r for r in reports)


def test_a_share_verified_where_it_was_sampled_keeps_its_verdicts_and_its_verifier_failures_stop_the_run(
        tmp_path, monkeypatch):
    """Issue 44: under torchrun a rank > 0 verifies its own share (`grpo_dist.sample_calls` with its own pool
    of the run's verifier) and rank 0's loop takes the `Verified` verdicts as they are (`share_batches`).
    Emulated in one process (tests/test_es_torchrun.py launches the real ranks): the host's batches are
    judged by a second pool, while the loop's own verifier never fails and judges nothing.
    - That pool's verifier raises on 6 of 8 attempts: the run stops before the update with the very line
      of a run whose own verifier raises.
    - It is down (every batch fails, `check_ready` says so) while the loop's is up: the run stops with
      a `VerifierUnavailable` naming the rank, instead of scoring that rank's members 0."""
    from vrl.optim.grpo_dist import sample_calls, share_batches
    from vrl.runtime.base import VerificationPool
    from vrl.verifier import VerifierUnavailable

    told = counting_tell(monkeypatch)

    class MostlyRaises(LettersVerifier):
        def __init__(self):
            self.checks = itertools.count()

        def check(self, attempt):
            if next(self.checks) % 4 != 0:
                raise ValueError("cannot parse this one")
            return super().check(attempt)

    class Down(LettersVerifier):
        async def verify(self, attempts):
            raise ConnectionError("server went away")

        async def check_ready(self):
            raise VerifierUnavailable("the letters server does not answer; start it")

    class Raising(LettersEnvironment):
        def verifier(self):
            return MostlyRaises()

    with pytest.raises(PluginError) as here:
        Trainer(small_config(tmp_path / "one"), environment=Raising()).run()

    judged_by_the_loop = []

    class Counting(LettersVerifier):
        def check(self, attempt):
            judged_by_the_loop.append(attempt)
            return super().check(attempt)

    class Env(LettersEnvironment):
        def verifier(self):
            return Counting()

    class Follower(LocalRuntime):
        """Its host's batches come back as rank 1 sends its share: sampled and verified there."""

        def __init__(self, verifier):
            super().__init__()
            self.share_pool = VerificationPool(verifier)

        def policy(self, config, needs=None):
            host = super().policy(config, needs)
            own = SimpleNamespace(sample=host.sample)

            def sample(tasks, variants, seed=None):
                yield from share_batches(1, sample_calls(own, [(tasks, list(variants), seed)], self.share_pool))

            host.sample = sample
            return host

        def close(self):
            self.share_pool.close()
            super().close()

    with pytest.raises(PluginError) as there:
        Trainer(small_config(tmp_path / "two"), environment=Env(), runtime=Follower(MostlyRaises())).run()
    assert "raised on 6 of 8 attempts of iteration 0" in str(here.value)
    assert str(there.value) == str(here.value)
    with pytest.raises(VerifierUnavailable, match=r"^rank 1's share: 8 of 8 verdicts crashed and the verifier is "
                                                  r"down: the letters server does not answer; start it$"):
        Trainer(small_config(tmp_path / "three"), environment=Env(), runtime=Follower(Down())).run()
    assert judged_by_the_loop == [] and told == []


def test_a_shaper_that_raises_stops_the_run_before_the_update(tmp_path, monkeypatch):
    told = counting_tell(monkeypatch)

    class Env(LettersEnvironment):
        def shaper(self):
            def shape(task, completion, verdict):
                return verdict.scor  # a typo for `score`

            return shape

    with pytest.raises(PluginError, match=r"environment 'letters': its reward shaper raised AttributeError: "
                                          r"'Verdict' object has no attribute 'scor' \(.*test_trainer.py:\d+ in shape\) "
                                          r"on task 'train-\d+' \(verdict \w+\); fix the shaper"):
        Trainer(small_config(tmp_path, iterations=1), environment=Env()).run()
    assert told == []
    assert not (tmp_path / "run").exists()


def test_a_shaper_that_returns_nan_stops_the_run(tmp_path, monkeypatch):
    told = counting_tell(monkeypatch)

    class Env(LettersEnvironment):
        def shaper(self):
            return lambda task, completion, verdict: float("nan")

    with pytest.raises(PluginError, match="its reward shaper returned nan on task .*a reward must be a finite number"):
        Trainer(small_config(tmp_path, iterations=1), environment=Env()).run()
    assert told == []


def test_hanging_verifier_becomes_timeouts(tmp_path):
    """`verifier.timeout_s` cuts a hanging batch: the batch is cancelled and scores `timeout`."""
    calls, cancelled = [], []

    class Hangs(LettersEnvironment):
        def verifier(self):
            class Hang(LettersVerifier):
                async def verify(self, attempts):
                    calls.append(len(attempts))
                    try:
                        await asyncio.sleep(60)  # were it not cut, a wrong-length answer after 60 s: crashed
                    except asyncio.CancelledError:
                        cancelled.append(len(attempts))
                        raise
                    return []

            return Hang()

    Trainer(small_config(tmp_path, iterations=1, verifier={"timeout_s": 0.2}), environment=Hangs()).run()
    m = RunDir.open(tmp_path / "run").metrics()[0]
    assert m["status/timeout"] == 8 and m["reasons"] == {"timeout: verifier batch exceeded N.N s": 8}, m
    assert calls and sorted(cancelled) == sorted(calls)  # every batch was cancelled by the timeout


def test_existing_run_directory_is_not_overwritten(tmp_path):
    Trainer(small_config(tmp_path, iterations=1), environment=LettersEnvironment()).run()
    with pytest.raises(RunDirError, match="--resume"):
        Trainer(small_config(tmp_path, iterations=1), environment=LettersEnvironment())


def test_checkpoint_time_is_reported_apart_from_the_loop(tmp_path, monkeypatch):
    """`save_s` is the time spent writing the optimizer's state (a GRPO checkpoint of a 1.5B model
    takes tens of seconds), measured outside `loop_s`."""
    from vrl.optim.es import ES

    # The trainer's clock, with every save taking an hour on it: a loop_s that held a save would be >= 3600.
    hours = [0.0]
    monkeypatch.setattr("vrl.trainer.time", SimpleNamespace(time=time.time, perf_counter=lambda: time.perf_counter() + hours[0]))
    original = ES.save

    def slow_save(self, run_dir, final=False):
        hours[0] += 3600.0
        original(self, run_dir, final)

    monkeypatch.setattr(ES, "save", slow_save)
    Trainer(small_config(tmp_path, iterations=2), environment=LettersEnvironment()).run()
    rows = RunDir.open(tmp_path / "run").metrics()
    assert all(r["save_s"] >= 3600 for r in rows)
    assert all(r["loop_s"] < 3600 for r in rows)  # no save in it (the tiny loop takes seconds, not an hour)


def test_an_environment_note_reaches_the_summary_table_and_summary_json(tmp_path):
    """`Environment.summary_notes` (none by default) lands in the closing table and summary.json: how a
    plugin says a run was judged with a check turned off (lean's recheck=off)."""
    import io

    from rich.console import Console

    from vrl import console as show

    assert LettersEnvironment().summary_notes() == []
    out = io.StringIO()
    show.summary(Console(file=out, width=200), {"name": "r", "status": "finished", "notes": ["passes NOT re-checked"]},
                 tmp_path)
    assert "note" in out.getvalue() and "passes NOT re-checked" in out.getvalue()

    class Noted(LettersEnvironment):
        def summary_notes(self):
            return ["judged without a check"]

    trainer = Trainer(small_config(tmp_path, iterations=1), environment=Noted())
    assert trainer.run()["notes"] == ["judged without a check"]
    assert json.loads((trainer.run_dir.path / "summary.json").read_text())["notes"] == ["judged without a check"]
