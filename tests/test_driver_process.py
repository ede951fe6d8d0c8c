"""Engines driven from processes of their own (`runtime.local.driver_processes`, `vrl.runtime.driver`):
a pool of two process-driven hf engines on this CPU samples and updates exactly as one in-process engine
does, a child's error is raised here as the same one-line error, and a child that dies ends the call with
a line naming its engine and leaves no process behind. The children are real (forked by multiprocessing's
fork server, which imported torch and transformers once, then each loads the tiny model), so the module
shares one pool. On a machine with 2 GPUs and vLLM (`pytest -m gpu`), two vLLM engines in driver processes
are compared with the same two engines driven in-process, and the fork server is checked to hold no CUDA."""

from __future__ import annotations

import importlib.util
import io
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from vrl import reaper
from vrl.config import build
from vrl.envs.letters import LettersEnvironment
from vrl.errors import UsageError
from vrl.generate.hf import HFGenerator
from vrl.optim.es import ES, ESHistory
from vrl.policy import HostNeeds, PerturbationSpec, Variant, WeightStream
from vrl.runtime.driver import DriverDied, DriverHost
from vrl.runtime.local import LocalRuntime
from vrl.runtime.pool import HostPool
from vrl.trainer import Trainer
from vrl.types import Result, Verdict
from vrl.weights.update import LowRankUpdate

BASE = {"plugin": "letters", "seed": 3, "tasks_per_iteration": 5, "model": "tiny",
        "sampling": {"max_new_tokens": 6, "temperature": 1.0, "batch_size": 2},
        "generator": {"device": "cpu", "dtype": "float32"},
        "es": {"population_size": 4, "sigma": 0.2, "alpha": 0.3, "antithetic": True},
        "runtime": {"local": {"engines": 2, "driver_processes": True}}}


def _key(batches) -> list:
    return sorted((c.variant, c.task_id, c.sample, c.text, tuple(c.token_ids)) for b in batches for c in b)


def _server(pids) -> tuple[int, int]:
    """The fork server that started the driver processes `pids` (their parent, not this process): it imported the
    modules every child needs (torch's library is mapped) and never initialised CUDA (it holds no NVIDIA
    device file open, as CUDA's initialisation leaves it: a child forked after that would inherit a
    broken CUDA state)."""
    [parent] = {reaper._stat(pid)[0] for pid in pids}
    assert parent != os.getpid()
    assert "libtorch" in Path(f"/proc/{parent}/maps").read_text()
    opened = [os.readlink(fd) for fd in Path(f"/proc/{parent}/fd").iterdir() if fd.is_symlink()]
    assert not [f for f in opened if f.startswith("/dev/nvidia")], opened
    return parent, reaper._stat(parent)[1]


def _gone(identity: tuple[int, int]) -> bool:
    deadline = time.monotonic() + 10
    while reaper.alive(identity) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not reaper.alive(identity)


@pytest.fixture(scope="module")
def pool():
    """Two hf engines in driver processes, built by the local runtime as `vrl train` builds them."""
    host = LocalRuntime().policy(build(BASE))
    yield host
    host.close()


def _iterations(host, cfg, tasks, iterations: int) -> tuple[list, ESHistory]:
    """`iterations` ES iterations on `host` (rewards made up from the completions); every
    iteration's completions and the history."""
    es = ES(cfg.es, seed=cfg.seed, base={"model": "tiny"})
    es.setup(host)
    seen = []
    for it in range(iterations):
        variants = es.ask()
        completions = [c for b in host.sample(tasks, variants, seed=10 + it) for c in b]
        seen.append(_key([completions]))
        by_id = {t.id: t for t in tasks}
        es.tell([Result(task=by_id[c.task_id], completion=c, verdict=Verdict.ok(), reward=float(sum(c.token_ids) % 7))
                 for c in completions])
    return seen, es.history


@pytest.mark.slow  # two children start (13-20 s on the loaded 2-core machine)
def test_two_driven_engines_sample_and_update_as_one_in_process_engine(pool):
    """Full-rank, then low-rank ES, two iterations each: the same completions, the same updates and θ
    bit for bit; a child's errors come back as the same errors."""
    assert isinstance(pool, HostPool) and [type(h) for h in pool.hosts] == [DriverHost, DriverHost]
    assert len({h.pid for h in pool.hosts} | {os.getpid()}) == 3
    _server([h.pid for h in pool.hosts])
    tasks = LettersEnvironment().tasks()[:5]
    # The child's own error, raised here with its type and message (and its traceback as a note).
    with pytest.raises(RuntimeError) as err:
        list(pool.hosts[1].sample(tasks, [Variant(index=0, seed=1)]))
    assert str(err.value) == "hf: call perturbations(spec) before sampling seeded variants"  # one line, as in-process
    assert "raised in the driver process of engine 1" in "".join(err.value.__notes__)
    one = HFGenerator.from_config(build(BASE))
    for noise in ("full", "lowrank"):
        cfg = build(BASE, {"es": {"noise": noise, **({"rank": 2} if noise == "lowrank" else {})}})
        got, want = _iterations(pool, cfg, tasks, 2), _iterations(one, cfg, tasks, 2)
        assert got[0] == want[0] and len({c[0] for c in got[0][0]}) == 4  # every member, both iterations
        assert got[1].iterations == want[1].iterations and any(z != 0 for z in got[1].iterations[0].z)
        mine = one.state()
        for host in pool.hosts:  # θ crosses back through shared memory
            theirs = host.state()
            assert theirs.keys() == mine.keys() and all(torch.equal(theirs[n], mine[n]) for n in mine)
    assert isinstance(pool.counters(), dict)
    # A full-rank spec refuses a low-rank update in the child: the same ValueError/TypeError here.
    pool.perturbations(PerturbationSpec(("*",), (), 0.1))
    with pytest.raises(Exception, match="lowrank") as refused:
        pool.update(LowRankUpdate(rank=2, coeff=1.0, terms=((7, 1.0),)))
    assert type(refused.value) is not DriverDied
    from vrl.episodes import Episodes

    class MyGame(LettersEnvironment):  # made in code: a child cannot build it from the run's config
        multi_turn = True

    with pytest.raises(UsageError, match=r"^driver processes build their environment from the run's config \(plugin "
                                         r"'letters'\), but this run's is a MyGame made in code: .*driver_processes=false$"):
        pool.episodes(Episodes(MyGame()))  # one line in the CLI, before any child is asked


@pytest.mark.slow  # the module's pool (two children)
def test_trained_weights_reach_the_driven_engines_in_shared_memory(pool):
    """GRPO's side: the model trains in this process; `publish` (the module, or a `WeightStream` in
    buckets) makes both children sample what an in-process engine given the same weights samples. The
    parameters crossed in shared memory, not copied through the pipe; a bucket the engine refuses is its
    error, raised here, and the rest of the stream is not drawn."""
    tasks = LettersEnvironment().tasks()[:4]
    model = pool.trainable().model
    assert pool.trainable().model is model and pool.trainable().separate
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    pool.publish(model)
    assert all(p.is_shared() for p in model.parameters())
    ref = HFGenerator.from_config(build(BASE))
    ref.publish(model)
    v = [Variant(index=0, samples_per_task=2)]
    assert _key(pool.sample(tasks, v, seed=1)) == _key(ref.sample(tasks, v, seed=1))
    drawn = []

    def buckets(weights):
        for name, t in weights:
            drawn.append(name)
            yield [(name, t)]

    halved = [(n, p.detach() * 0.5) for n, p in model.named_parameters()]
    pool.publish(WeightStream(buckets(halved)))  # lockstep over both engines, one tensor per bucket
    assert drawn == [n for n, _ in halved]
    ref.publish(dict(halved))
    assert _key(pool.sample(tasks, v, seed=2)) == _key(ref.sample(tasks, v, seed=2))
    drawn.clear()
    with pytest.raises(ValueError) as err:
        pool.hosts[1].publish(WeightStream(buckets([("nope", torch.zeros(1)), *halved])))
    assert str(err.value) == "published weights do not match the model: unknown ['nope']" and drawn == ["nope"]


class _Engine:
    """A host whose stream yields `batches` batches of one large completion each (more than the pipe
    holds), recording how far its engine got and whether its stream was closed."""

    def __init__(self, batches: int, fail_at: int | None = None):
        self.batches, self.fail_at, self.made, self.closed, self.done = batches, fail_at, 0, False, threading.Event()

    def sample(self, tasks, variants, seed=None):
        try:
            for i in range(self.batches):
                if i == self.fail_at:
                    raise ValueError(f"engine failed at batch {i}")
                self.made += 1
                yield [{"batch": i, "text": "x" * 4_000_000}]
            self.done.set()
        finally:
            self.closed = True


def _child_stream(engine: _Engine):
    """`driver._stream` as the child runs it, over a real pipe, in a thread; returns (the parent's end,
    the thread, what `_stream` returned)."""
    from vrl.runtime import driver

    parent, child = multiprocessing.Pipe()
    returned = []
    thread = threading.Thread(target=lambda: returned.append(driver._stream(child, engine, [], [], None)), daemon=True)
    thread.start()
    return parent, thread, returned


def test_a_child_keeps_its_engine_going_while_the_parent_is_slow_to_read_and_stops_it_when_asked(caplog):
    """The child draws its engine's stream into a queue in a thread of its own: every batch is made
    while the parent has read none (each batch is larger than the pipe holds, so a child that sent as
    it drew would wait on the first); the parent then gets them all, in order, and the end. Asked to
    stop after the first batch, the child closes the engine's stream and ends with ("end",); an engine
    that fails mid-stream ends it with its error."""
    engine = _Engine(3)
    caplog.set_level("DEBUG", logger="vrl.runtime.driver")
    parent, thread, returned = _child_stream(engine)
    assert engine.done.wait(30), f"the engine made {engine.made} of 3 batches while the parent did not read"
    time.sleep(0.2)  # the parent reads late: the child's record says so
    got = [parent.recv() for _ in range(4)]
    thread.join(30)
    [record] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sample: ")]
    late = float(record.rsplit("last ", 1)[1].split(" s", 1)[0])
    assert record.startswith("sample: 3 batches;") and late >= 0.2, record
    assert [(k, v[0]["batch"] if k == "batch" else v) for k, v in got] == [
        ("batch", 0), ("batch", 1), ("batch", 2), ("end", None)]
    assert returned == [False] and engine.closed

    engine = _Engine(1000)
    parent, thread, returned = _child_stream(engine)
    assert parent.recv()[0] == "batch"
    parent.send(("abort", ()))
    while (message := parent.recv())[0] == "batch":  # as DriverHost.sample drains after an abort
        pass
    thread.join(30)
    assert message == ("end", None) and returned == [False] and engine.closed and engine.made < 1000

    engine = _Engine(3, fail_at=1)  # the engine's error, after what it made, is the stream's last message
    parent, thread, returned = _child_stream(engine)
    got = [parent.recv() for _ in range(2)]
    thread.join(30)
    assert got[0][0] == "batch" and got[1][0] == "err" and returned == [False] and engine.closed
    from vrl.runtime.driver import _raised

    assert str(_raised(got[1][1], "engine 0")) == "engine failed at batch 1"


def test_settings_a_driver_process_cannot_serve_are_refused_before_an_engine_starts(monkeypatch):
    LocalRuntime.check(build(BASE, {"optimizer": "grpo"}))  # hf and vllm engines sample weights trained here
    cfg = build(BASE, {"optimizer": "grpo", "generator": {"backend": "vllm"}})
    LocalRuntime.check(cfg)
    from vrl.generate.vllm import VLLMGenerator
    from vrl.optim.grpo import GRPO

    # The LoRA adapter alone is written from the trained module, which a driver process does not have.
    lora = build(cfg.model_dump(), {"grpo": {"use_peft": True}, "generator": {"vllm": {"weight_transfer": "adapter"}}})
    with pytest.raises(UsageError, match=r"weight_transfer=adapter .* driver process .*driver_processes=false$"):
        VLLMGenerator.check_fits(lora, GRPO.from_config(lora).needs(), None)
    VLLMGenerator.check_fits(build(lora.model_dump(), {"runtime": {"local": {"driver_processes": False}}}),
                             GRPO.from_config(lora).needs(), None)

    monkeypatch.setattr(VLLMGenerator, "trains_elsewhere", False)  # as a backend that cannot
    for refuse in (lambda: LocalRuntime.check(cfg), lambda: LocalRuntime().policy(cfg, HostNeeds("trained"))):
        with pytest.raises(UsageError, match=r"optimizer=grpo trains weights that generator backend 'vllm' can take "
                                             r"only in the training process .*driver_processes=false$"):
            refuse()
    for engines, gpus in ((2, [0]), (3, [0, 1])):  # each child would size its engine as if alone on the GPU
        shared = build(BASE, {"runtime": {"local": {"engines": engines, "gpus": gpus, "driver_processes": True}}})
        with pytest.raises(UsageError, match=f"{engines} engines would share runtime.local.gpus="):
            LocalRuntime.check(shared)
    apart = build(BASE, {"runtime": {"local": {"engines": 2, "gpus": [0, 1, 0], "driver_processes": True}}})
    if torch.cuda.device_count() >= 2:
        LocalRuntime.check(apart)  # placed apart: accepted
    else:  # placed apart: on to the next check, whether the GPUs exist
        with pytest.raises(UsageError, match=r"names GPU \d, but this machine has"):
            LocalRuntime.check(apart)


@pytest.mark.slow  # two children start (13-20 s on the loaded 2-core machine)
def test_a_killed_child_ends_the_iteration_naming_its_engine_and_close_leaves_nothing(pool, monkeypatch):
    """SIGKILL to engine 1's process mid-sample: the pool's call ends with `DriverDied` naming engine 1;
    engine 0's stream is stopped and stays usable (and samples decoupled as in-process); close() ends the rest. (Last in the module: it
    breaks the shared pool.)"""
    tasks = LettersEnvironment().tasks()[:8]
    variants = [Variant(index=i, samples_per_task=8) for i in range(8)]  # long enough to be killed mid-way
    victim = pool.hosts[1]
    identities = {(h.pid, reaper._stat(h.pid)[1]) for h in pool.hosts}
    stream = pool.sample(tasks, variants, seed=2)
    next(stream)
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(DriverDied, match=r"driver process of engine 1 \(pid \d+\) was killed by signal SIGKILL during sample"):
        for _ in stream:
            pass
    # Engine 0 read its aborted stream to its end: it samples on, as one in-process host does.
    # Decoupled (asynchronous GRPO), it reports sampling log-probs as an in-process engine does.
    alone = HFGenerator.from_config(build(BASE))
    for host in (pool.hosts[0], alone):
        host.publish(pool.trainable().model)
        host.decouple()
    v = [Variant(index=0, samples_per_task=2)]
    got = [c for b in pool.hosts[0].sample(tasks[:3], v, seed=4) for c in b]
    want = [c for b in alone.sample(tasks[:3], v, seed=4) for c in b]
    assert _key([got]) == _key([want]) and [c.logprobs for c in got] == [c.logprobs for c in want]
    assert all(c.logprobs and len(c.logprobs) == len(c.token_ids) for c in got)
    pool.close()
    assert all(_gone(i) for i in identities)
    # An engine that cannot start: its error, raised here, and its child ended.
    started = []
    init = DriverHost.__init__
    monkeypatch.setattr(DriverHost, "__init__", lambda self, *a: init(self, *a) or started.append(self.pid))
    with pytest.raises(RuntimeError, match=r"^cannot load model '/nonexistent/model'"):
        DriverHost.start(build(BASE, {"model": "/nonexistent/model"}), None, [None])
    assert len(started) == 1 and not reaper.identities(started)


@pytest.mark.slow
def test_vrl_train_in_driver_processes_and_a_killed_parent_leaves_no_child(tmp_path: Path):
    """`vrl train`'s loop with two driven engines writes what one in-process engine writes (samples,
    metrics; low-rank ES's history; GRPO, trained here and published to the children, on the multi-turn
    guess game: each child builds the run's environment from its plugin and plays whole episodes, whose
    token masks the update reads); and a parent killed with SIGKILL leaves none of its engines behind, even
    children stopped (SIGSTOP) so that they cannot end by themselves (vrl.reaper ends them), nor the fork
    server that started them."""
    for optimizer, extra in (("es", {"es": {"noise": "lowrank", "rank": 2}}),
                             ("grpo", {"plugin": "guess", "env_options": {"turns": 2},
                                       "grpo": {"num_generations": 3, "learning_rate": 1e-2,
                                                "lr_scheduler_type": "constant"}})):
        rows = {}
        for name, local in (("one", {"engines": 1, "driver_processes": False}), ("driven", {})):
            cfg = build(BASE, extra, {"optimizer": optimizer, "iterations": 2,
                                      "runtime": {"local": {**BASE["runtime"]["local"], **local}},
                                      "logging": {"runs_dir": str(tmp_path), "name": f"{optimizer}-{name}"}})
            Trainer(cfg, runtime=LocalRuntime(), console=Console(file=io.StringIO())).run()
            run = tmp_path / f"{optimizer}-{name}"
            metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
            for sample in samples:  # wall-clock times
                sample["verdict"]["elapsed_s"] = None
                if sample.get("episode"):
                    sample["episode"]["metrics"].pop("env_step_s")
                    for turn in sample["episode"]["turns"]:
                        turn.pop("seconds")
            rows[name] = ([{k: r[k] for k in ("reward_mean", "tokens", "completions", "grpo/loss") if k in r}
                           for r in metrics],
                          sorted(json.dumps(s, sort_keys=True) for s in samples),
                          ESHistory.read(run / "es_history.json").iterations if optimizer == "es" else None)
            if optimizer == "grpo":
                assert any(len(s["episode"]["turns"]) == 3 for s in samples)  # the game answered, the model again
        assert rows["one"] == rows["driven"], optimizer

    script = textwrap.dedent(f"""
        import sys, time
        from vrl import reaper
        from vrl.config import build
        from vrl.runtime.driver import DriverHost
        from vrl.runtime.local import LocalRuntime
        if __name__ == "__main__":
            reaper.GRACE_S = 1.0  # the watchdog's SIGKILL follows its SIGTERM after 1 s
            # A first child starts the fork server, and its close releases the server from the watchdog:
            # the pool's children, the server's and not this process's, must be registered by themselves.
            DriverHost.start(build({BASE!r}), None, [None])[0].close()
            pool = LocalRuntime().policy(build({BASE!r}))
            print(" ".join(str(h.pid) for h in pool.hosts), flush=True)
            time.sleep(600)
    """)
    (tmp_path / "parent.py").write_text(script)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py")], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        identities = {(p, reaper._stat(p)[1]) for p in pids} | {_server(pids)}  # the fork server ends too
        for pid in pids:  # children that cannot end by themselves when the parent's pipe closes (a hung engine)
            os.kill(pid, signal.SIGSTOP)
        parent.kill()
        parent.wait()
        assert all(_gone(i) for i in identities)
    finally:
        parent.kill()


def _vllm_config(model_dir: str, optimizer: str, local: dict, batch_size: int = 4, **sections):
    """A GPU test's run: `model_dir` on eager bf16 vLLM engines placed by `local` (runtime.local)."""
    return build({"model": model_dir, "optimizer": optimizer, "seed": 3, **sections,
                  "sampling": {"temperature": 1.0, "max_new_tokens": 16, "batch_size": batch_size},
                  "generator": {"backend": "vllm", "dtype": "bfloat16", "vllm": {
                      "enforce_eager": True, "gpu_memory_utilization": 0.2, "max_model_len": 256}},
                  "runtime": {"local": local}})


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'vrl-core[vllm]')")
@pytest.mark.parametrize("noise", ["full", "lowrank"])
def test_vllm_engines_in_driver_processes_sample_what_the_in_process_pool_samples(small_qwen2_dir, noise):
    """Two vLLM engines, one per GPU, driven from processes of their own, give the completions and ES
    updates the same two engines give driven from this process (same placement, so the same batches),
    over two iterations of full-rank or low-rank members (engines in bf16, eager)."""
    from vrl.types import Task

    es = {"population_size": 4, "sigma": 0.05, "alpha": 0.05, "antithetic": True, "noise": noise,
          **({"rank": 2, "exclude": ["lm_head*"]} if noise == "lowrank" else {"exclude": ["*norm*"]})}
    tasks = [Task(id=f"t{i}", prompt=p) for i, p in enumerate(["Hello there", "2 + 2 =", "def f(x):", "abc", "Q:"])]
    seen = {}
    for drivers in (False, True):
        cfg = _vllm_config(small_qwen2_dir, "es", {"engines": 2, "gpus": [0, 1], "driver_processes": drivers}, es=es)
        LocalRuntime.check(cfg)
        host = LocalRuntime().policy(cfg, ES.from_config(cfg).needs())
        try:
            assert [type(h) is DriverHost for h in host.hosts] == [drivers, drivers]
            seen[drivers] = _iterations(host, cfg, tasks, 2)
        finally:
            host.close()
    assert seen[True][0] == seen[False][0] and seen[True][1].iterations == seen[False][1].iterations


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'vrl-core[vllm]')")
def test_a_vllm_engine_in_a_driver_process_samples_the_weights_grpo_trains_here(small_qwen2_dir):
    """GRPO on vLLM through a driver process: the model trains in this process (GPU 0); `publish` sends
    its weights to the child as CUDA IPC handles, and the child pushes them on with the transport an
    engine beside the trainer would use: on GPU 0 by vLLM's CUDA IPC from a copy (torch will not hand on
    a received CUDA tensor), on GPU 1 (with 2 GPUs) by vLLM's NCCL broadcast straight from the received
    tensors. After a push of the module and one of a `WeightStream` in buckets, the child's engine
    samples what the same engine driven in this process samples given the same weights (same seed),
    with the sampler's log-probs, and both differ from the unpushed weights' samples."""
    from vrl.optim.grpo import GRPO
    from vrl.types import Task
    from vrl.weights.export import weights_for_engine

    tasks = [Task(id=f"t{i}", prompt=p) for i, p in enumerate(["Hello there", "2 + 2 =", "def f(x):", "Q:"])]
    v = [Variant(index=0, samples_per_task=2)]

    def nudge(model, seed: int) -> None:
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed * 1000 + i))
                p.add_(0.02 * noise.to(p.device, p.dtype))

    def buckets(model):
        weights = weights_for_engine(model)
        for i in range(0, len(weights), 3):
            yield weights[i:i + 3]

    for gpu in [0, 1][:torch.cuda.device_count()]:
        seen = {}
        for drivers in (True, False):
            cfg = _vllm_config(small_qwen2_dir, "grpo", {"engines": 1, "gpus": [gpu], "driver_processes": drivers})
            LocalRuntime.check(cfg)
            host = LocalRuntime().policy(cfg, GRPO.from_config(cfg).needs())
            try:
                assert (type(host) is DriverHost) == drivers
                model = host.trainable().model
                assert next(model.parameters()).device == torch.device("cuda", 0)
                unpushed = _key(host.sample(tasks, v, seed=1))
                nudge(model, 1)
                host.publish(model)
                first = [c for b in host.sample(tasks, v, seed=1) for c in b]
                nudge(model, 2)
                host.publish(WeightStream(buckets(model)))
                second = _key(host.sample(tasks, v, seed=2))
                assert host.counters()["sync_s"] > 0
                assert all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids) for c in first)
                seen[drivers] = (_key([first]), second)
                assert seen[drivers][0] != unpushed
            finally:
                host.close()
        assert seen[True] == seen[False], f"GPU {gpu}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'vrl-core[vllm]')")
def test_both_driven_engines_of_a_grpo_pool_report_sampling_logprobs(small_qwen2_dir):
    """GRPO with two vLLM engines in driver processes (GPUs 0 and 1): the pool's first host hands out the
    trained copy and the other is told it samples that copy's weights, so the completions of both engines
    carry sampling log-probs, before and after a push. Before, only the first engine's did, and GRPO
    dropped the sampling correction on every batch (session 22's 4-GPU benchmark warned of it each iteration)."""
    from vrl.optim.grpo import GRPO
    from vrl.policy import deal
    from vrl.types import Task

    tasks = [Task(id=f"t{i}", prompt=p) for i, p in enumerate(["Hello there", "2 + 2 =", "def f(x):", "Q:"])]
    v = [Variant(index=0, samples_per_task=2)]
    assert all(deal(tasks, v, 1, 2, granule=2))  # each engine samples a share
    cfg = _vllm_config(small_qwen2_dir, "grpo", {"engines": 2, "gpus": [0, 1], "driver_processes": True}, batch_size=2)
    LocalRuntime.check(cfg)
    pool = LocalRuntime().policy(cfg, GRPO.from_config(cfg).needs())
    try:
        assert isinstance(pool, HostPool) and all(type(h) is DriverHost for h in pool.hosts)
        model = pool.trainable().model
        before = [c for b in pool.sample(tasks, v, seed=1) for c in b]
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(p.device, p.dtype))
        pool.publish(model)
        after = [c for b in pool.sample(tasks, v, seed=1) for c in b]
        for got in (before, after):
            assert len(got) == 8
            assert all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids) for c in got)
        assert _key([before]) != _key([after])  # the push took effect
    finally:
        pool.close()
