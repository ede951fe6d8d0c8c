"""GRPO on FSDP2 across 2 CPU ranks (gloo), launched with the real `torchrun`, against one process.

Nothing is emulated: `torch.distributed.fsdp.fully_shard` shards the tiny Qwen2 model over a CPU
device mesh, gradients are reduce-scattered over gloo, AdamW steps on DTensor shards, and
checkpoints are written with `torch.distributed.checkpoint`; a LoRA adapter (`grpo.use_peft`) trains
data-parallel, its gradients all-reduced; `grpo.compile` runs dynamo and AOTAutograd on every rank. Only the
GPUs are absent (NCCL is the same code path with another backend).

A launch costs its agents a start and every rank its interpreter, torch and transformers, more than a
step: the module's facts share one launch (`launched`, tests/torchrun_jobs.py, on two nodes of one process
each): first the optimizer-level scenarios (`steps`, tests/grpo_fsdp_worker.py), then the `vrl train` jobs
(`trained`, the multi-turn episodes' among them; a push that fails on rank 0 and the launch goes on), and
last a run that SIGTERM to the agents stops, which ends the launch.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console
from safetensors.torch import load_file

from tests import torchrun_jobs
from tests.test_grpo import capture_grads, make_generator, sample_results
from tests.torchrun_jobs import split
from vrl.cli import main as cli_main
from vrl.envs.letters import LettersEnvironment
from vrl.optim.grpo import GRPO, GRPOConfig
from vrl.optim.grpo_dist import share_rows
from vrl.rundir import RunDir
from vrl.trainer import Trainer

HERE = Path(__file__).parent
VRL = ("-m", "vrl.cli")  # torchrun's module mode: `vrl` need not be installed as a script (the GPU machine)
# beta > 0 shards a frozen reference too; 12 samples in micro-batches of 5 make 2 per rank.
FIELDS = {"loss_type": "grpo", "micro_batch_size": 5, "learning_rate": 1e-3, "beta": 0.1, "num_iterations": 1,
          "lr_scheduler_type": "constant"}


def torchrun(*args: str, timeout: int = 600, nodes: int = 1, check: bool = True,
             stop_when: Callable[[], bool] | None = None) -> subprocess.CompletedProcess:
    """Two ranks on this machine, as a user starts them: one node of 2 processes (`torchrun --nnodes 1
    --nproc-per-node 2`), or `nodes=2`: two torchrun agents of one process each (`--nnodes 2 --node-rank
    i`, as on two hosts, here sharing this machine's filesystem), so rank 1 has LOCAL_RANK 0 and an
    agent of its own. Returns node 0's agent's output; with `check`, every agent must exit with 0. A
    launch still running after `timeout` seconds fails the test, its ranks killed; once `stop_when()`,
    every agent gets SIGTERM (tests/torchrun_jobs.py's `agents`)."""
    cmds, env = launch(*args, nodes=nodes)
    try:
        done = torchrun_jobs.agents(cmds, env, timeout, stop_when)
    except TimeoutError as exc:
        pytest.fail(str(exc))
    if check:
        for p in done:
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return done[0]


def launch(*args: str, nodes: int = 1) -> tuple[list[list[str]], dict[str, str]]:
    """`torchrun`'s command per node (see `torchrun`) on a free port, and their environment.
    TORCHINDUCTOR_COMPILE_THREADS=1: a rank that compiles (grpo.compile) does so in its own process, without a
    pool of compile workers that would each import torch (tests/test_grpo_compile.py says why)."""
    return torchrun_jobs.commands(*args, ranks=2, nodes=nodes, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})


BUCKET_LIMIT = 40_000  # "separate": the published weights gathered in buckets of 40 kB (the tiny model takes several)
# No LoRA dropout: its masks are drawn per micro-batch in order, and the ranks draw theirs apart.
LORA = {**FIELDS, "use_peft": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "v_proj"]}
# The worker's scenarios, all run in one job of the module's launch (`steps`): the default step, then each variation
# a test checks (and "lora_resumed", added by `step_scenarios`: the step after a one-process LoRA checkpoint).
# "compiled" comes last of them: what dynamo compiled stays in the ranks' processes (the `vrl train` jobs after
# it compile nothing). Its micro-batches of 6 give each rank one: one width, so
# each rank compiles its graphs once (a second width recompiles them with dynamic shapes; tests/test_grpo_compile.py
# covers new widths in one process). Its backend is aot_eager (`grpo.compile_backend`): dynamo captures the
# layers' graphs and AOTAutograd splits them into forward and backward on every rank, as with inductor, and
# the graphs then run unfused. Inductor's code generation (C++ on CPU, Triton on a GPU) is what
# tests/test_grpo_compile.py runs in one process; on the 2 ranks it cost about 85 CPU-seconds of the suite's
# (cold, measured in session 21) for no code a GPU rank would run.
SCENARIOS = {"default": FIELDS,
             "separate": {**FIELDS, "_separate": BUCKET_LIMIT},
             "every_rank": {**FIELDS, "sample_on_every_rank": True},
             "broken_rank": {**FIELDS, "sample_on_every_rank": True, "_break_rank_1": True},
             "paused": {**FIELDS, "ddp_timeout": 3, "_pause": 8},
             "kept_gathered": {**FIELDS, "fsdp_reshard_after_forward": False},
             "bf16": {**FIELDS, "_dtype": "bfloat16"},
             "lora": LORA,
             "compiled": {**FIELDS, "compile": True, "compile_backend": "aot_eager", "micro_batch_size": 6}}


def worker_job(tmp: Path, scenarios: dict[str, dict]) -> dict:
    """tests/grpo_fsdp_worker.py's `scenarios` as a job of the module's launch (`launched`)."""
    return {"worker": "tests.grpo_fsdp_worker",
            "args": [a for name, fields in scenarios.items()
                     for a in (str(tmp / f"{name}.pt"), str(tmp / name), json.dumps(fields))]}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The module's one launch (`jobs_launch`, two nodes of one process each): the worker's scenarios
    (`steps`), then the `vrl train` jobs (`trained`), the last of which runs until SIGTERM stops the launch."""
    tmp = tmp_path_factory.mktemp("fsdp")
    scenarios = step_scenarios(tmp)
    jobs = train_jobs(tmp / "cli")
    order = ("one", "every", "pool", "async", "async_resumed", "lora", "filter", "ep_one", "ep_every", "failing_push",
             "sigterm")
    outputs = jobs_launch(tmp, {"steps": worker_job(tmp, scenarios), **{k: jobs[k] for k in order}}, nodes=2,
                          stopped=tmp / "cli" / "sigterm" / "fsdp")
    steps = {name: (torch.load(tmp / f"{name}.pt", weights_only=False), tmp / name) for name in scenarios}
    trained = {name: (out, tmp / "cli" / name.removesuffix("_resumed") / ("ep" if name.startswith("ep_") else "fsdp"))
               for name, out in outputs.items() if name != "steps"}
    return steps, trained


def step_scenarios(tmp: Path) -> dict[str, dict]:
    """Every scenario of `SCENARIOS`, one GRPO step each on 2 ranks; before "compiled", "lora_resumed": the
    LoRA step after a one-process LoRA run's checkpoint of iteration 1 (made here first, under "lora_one";
    batch seed 7)."""
    gen = make_generator()
    first = GRPO(GRPOConfig(**LORA), seed=0, total_iterations=10)
    first.setup(gen)
    first.tell(sample_results(gen))
    first.save(tmp / "lora_one", final=True)
    first.close()
    scenarios = dict(SCENARIOS)
    compiled = scenarios.pop("compiled")
    scenarios.update(lora_resumed={**LORA, "_load": str(tmp / "lora_one"), "_seed": 7}, compiled=compiled)
    return scenarios


@pytest.fixture(scope="module")
def steps(launched):
    """Per scenario of `step_scenarios`: what rank 0 saw (tests/grpo_fsdp_worker.py's record) and its run dir."""
    return launched[0]


@pytest.fixture
def two_ranks(steps):
    """The default step on 2 ranks: what rank 0 saw, and its checkpoint."""
    return steps["default"]


def one_process_step(monkeypatch):
    grads = capture_grads(monkeypatch)
    gen = make_generator()
    opt = GRPO(GRPOConfig(**FIELDS), seed=0, total_iterations=10)
    opt.setup(gen)
    metrics = opt.tell(sample_results(gen))
    return metrics, grads, gen.model.state_dict(), opt


@pytest.mark.slow
def test_two_ranks_train_as_one_process(two_ranks, monkeypatch):
    """Loss, gradient and updated weights of a 2-rank FSDP2 step equal the one-process step's.

    Tolerances: the loss and the gradient norm to 1e-6 relative, every gradient element to 1e-6 of its
    tensor's largest (the ranks sum their micro-batches in another order: measured 3.5e-7). The weights
    differ by exactly what AdamW's first step makes of that gradient difference: the step is
    lr·ĝ/(|ĝ| + ε) of the clipped gradient ĝ, whose slope ε/(|ĝ| + ε)² turns a 1e-7 difference in a
    near-zero gradient into up to 2% of lr; each element is held to that bound (plus 4 fp32 ulps)."""
    dist, _ = two_ranks
    assert dist["world"] == 2
    metrics, grads, weights, opt = one_process_step(monkeypatch)
    assert_same_step(dist, metrics, grads)
    moved = max(float((dist["weights"][k] - make_generator().model.state_dict()[k]).abs().max()) for k in weights)
    assert moved > 0.5 * FIELDS["learning_rate"]  # the step did move them
    eps, lr = 1e-8, FIELDS["learning_rate"]
    clip = [min(1.0, 1.0 / (m["grpo/grad_norm"] + 1e-6)) for m in (metrics, dist["metrics"])]
    for name, g1, g2 in zip(opt.param_names, grads[0], dist["grads"][0]):
        g1, g2 = g1 * clip[0], g2 * clip[1]
        diff = (g1 - g2).abs()
        slope = eps / ((g1.abs() - diff).clamp(min=0) + eps) ** 2
        ulps = 4 * torch.finfo(torch.float32).eps * (weights[name].abs() + lr)  # AdamW's arithmetic, another order
        bound = lr * torch.clamp(slope * diff, max=2.0) + ulps
        assert bool(((dist["weights"][name] - weights[name]).abs() <= bound).all()), name

def load_on_one_process(run: Path, fields: dict, dist: dict):
    """Load the checkpoint of iteration 1 of `run` into one process's GRPO and check it holds what the
    ranks held (`dist`, tests/grpo_fsdp_worker.py's record) to the bit: weights, AdamW state, step, lr."""
    gen = make_generator()
    opt = GRPO(GRPOConfig(**fields), seed=0, total_iterations=10)
    opt.setup(gen)
    opt.load(run, 1)
    assert opt.iteration == 1 and opt.step == 1
    own = gen.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in dist["weights"].items())
    for name, m in zip(opt.param_names, opt.master):
        saved = dist["optim"][name]
        assert set(opt.optim.state[m]) == set(saved)
        for field, value in saved.items():
            assert torch.equal(opt.optim.state[m][field], value), (name, field)
    assert opt.optim.param_groups[0]["lr"] == fields["learning_rate"]
    return gen, opt


def assert_same_step(dist: dict, metrics: dict, grads: list) -> None:
    """The ranks' step (`dist`) against one process's: loss and gradient norm to 1e-6 relative, the KL to
    1e-5, the batch's counts exactly, each gradient element to 1e-6 of its tensor's largest."""
    assert dist["metrics"]["grpo/loss"] == pytest.approx(metrics["grpo/loss"], rel=1e-6)
    assert dist["metrics"]["grpo/kl"] == pytest.approx(metrics["grpo/kl"], rel=1e-5)
    assert dist["metrics"]["grpo/grad_norm"] == pytest.approx(metrics["grpo/grad_norm"], rel=1e-6)
    for key in ("grpo/trained_tokens", "grpo/clip_ratio/region_mean", "grpo/advantage_abs_mean", "grpo/reward_std"):
        assert dist["metrics"][key] == metrics[key], key
    assert len(dist["grads"]) == len(grads) == 1
    for a, b in zip(dist["grads"][0], grads[0]):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max())
    assert any(g.abs().sum() > 0 for g in grads[0])


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_process_exactly(two_ranks):
    """The sharded checkpoint of 2 ranks loads on one process to the same bits: weights, AdamW moments,
    step counts, learning rate; its policy folder holds the same weights."""
    dist, run = two_ranks
    ckpt = run / "grpo" / "iter-000001"
    assert sorted(p.name for p in (ckpt / "train").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    gen, opt = load_on_one_process(run, FIELDS, dist)
    policy = load_file(str(ckpt / "policy" / "model.safetensors"))
    assert all(torch.equal(policy[k], dist["weights"][k]) for k in policy)
    # and it trains on from there
    opt.tell(sample_results(gen, seed=7))
    assert opt.step == 2


@pytest.mark.slow
def test_a_separate_sampler_gets_the_weights_streamed_in_buckets_with_no_whole_copy_on_rank_0(steps):
    """Rank 0's host samples from weights of its own (decoupled, as a vLLM engine does): rank 0 shards its
    trained copy in place (no whole copy is left), and each publish gathers the weights bucket by bucket (here 40 kB
    buckets, so the tiny model takes several), every bucket under the bound unless one tensor alone is
    over it. The sampler ends holding the trained masters rounded to its dtype, to the bit, and so does
    the policy folder of the checkpoint, gathered the same way from the shards."""
    limit = BUCKET_LIMIT
    dist, run = steps["separate"]
    assert dist["trainable_sharded"]  # rank 0's trained copy was sharded in place: no whole copy is left
    sizes = {k: v.numel() * v.element_size() for k, v in dist["masters"].items()}
    buckets = dist["buckets"]
    assert dist["syncs"] == 1 and len(buckets) > 2
    assert sorted(n for b in buckets for n in b) == sorted(dist["masters"])  # every weight once
    assert all(sum(sizes[n] for n in b[:-1]) < limit for b in buckets)  # the last tensor closes a bucket
    assert any(sizes[b[-1]] < limit for b in buckets) and max(sizes.values()) > limit  # both cases occur
    initial = make_generator().model.state_dict()
    assert any(not torch.equal(dist["masters"][k], initial[k]) for k in dist["masters"])  # the step moved them
    assert all(torch.equal(dist["weights"][k], v) for k, v in dist["masters"].items())
    policy = load_file(str(run / "grpo" / "iter-000001" / "policy" / "model.safetensors"))
    assert sorted(policy) == sorted(dist["masters"])
    assert all(torch.equal(policy[k], v) for k, v in dist["masters"].items())


@pytest.mark.slow
def test_every_rank_samples_its_share_and_takes_the_trained_weights(steps):
    """`grpo.sample_on_every_rank`: rank 0 deals the batch's tasks over both ranks, rank 1 samples its
    share on its own host (an hf model here) from its command loop, and the gathered completions are
    exactly rank 0's alone with the same seed; after the step every rank's sampling model holds the
    trained masters rounded to its dtype."""
    dist, _ = steps["every_rank"]

    def key(completions):
        return sorted((c.task_id, c.sample, c.text, tuple(c.token_ids)) for c in completions)

    assert dist["pooled_counts"] == [48, 12]  # 20 tasks × 3 in shards of the sampler's batch size (8): 16 + 4 tasks
    assert key(dist["pooled"]) == key(dist["alone"])
    first, second = dist["samplers"]
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert all(torch.equal(first[k], v) for k, v in dist["masters"].items())
    initial = make_generator().model.state_dict()
    assert any(not torch.equal(first[k], initial[k]) for k in first)  # the step moved them


@pytest.mark.slow
def test_a_rank_that_fails_to_sample_is_reported_by_rank_0_in_one_line_and_the_ranks_go_on(steps):
    """Rank 1's engine fails while it samples its share: rank 0 raises one line naming the rank and the
    error (after rank 0's own share, so no collective is left half done), and every rank goes on to
    train, save and stop together."""
    dist, run = steps["broken_rank"]
    assert dist["pooled"] == ("rank 1 could not sample its share of the batch: RuntimeError: CUDA error: an illegal "
                              "memory access was encountered (rank 1's engine)")
    assert dist["metrics"]["grpo/grad_norm"] > 0 and (run / "grpo" / "iter-000001").is_dir()


LAUNCH_TIMEOUT_S = 600  # a jobs launch takes 1-3 minutes on the loaded 2-core machine


def jobs_launch(tmp: Path, jobs: dict[str, list[str] | dict], nodes: int = 1, stopped: Path | None = None
                ) -> dict[str, str]:
    """`jobs` (name: `vrl` arguments, or tests/torchrun_jobs.py's job with its "patch" or "then") one after
    another in one 2-rank launch (`torchrun`), each as `torchrun … -m vrl.cli …` runs it alone. Every job
    must succeed (a job that fails ends the launch before the next: each must have started), but one marked
    `"then": "continue"`, and `stopped`: the run folder of the last job, which runs until the launch is
    stopped: once that run has finished an iteration, every agent gets SIGTERM (node 0's agent then exits
    non-zero). Per name: rank 0's output."""
    spec = tmp / "jobs.json"
    spec.write_text(json.dumps({"jobs": [job if isinstance(job, dict) else {"args": job} for job in jobs.values()]}))
    done = torchrun(str(HERE / "torchrun_jobs.py"), str(spec), timeout=LAUNCH_TIMEOUT_S, nodes=nodes,
                    check=stopped is None and not any(isinstance(j, dict) and j.get("then") for j in jobs.values()),
                    stop_when=None if stopped is None else lambda: finished_an_iteration(stopped))
    parts = [out + err for out, err in zip(split(done.stdout), split(done.stderr))]
    assert len(parts) == len(jobs), done.stderr[-6000:]
    if stopped is not None:
        assert done.returncode != 0, done.stderr[-6000:]
    return dict(zip(jobs, parts))


def finished_an_iteration(run: Path) -> bool:
    """Whether `run` has finished an iteration: recorded in state.json, which a run writes last
    (tests/test_cli_errors.py's `sigterm_after_an_iteration` says why)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        return json.loads((run / "state.json").read_text())["iteration"] >= 1
    return False


def _rows(run: Path, *keys: str, before: int | None = None) -> tuple[list, list]:
    """A run's samples (iteration, task, sample, completion) and its metrics' `keys`, per iteration (those
    before iteration `before`, if given)."""
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    keep = (lambda r: r["iteration"] < before) if before is not None else (lambda r: True)
    return ([(r["iteration"], r["task_id"], r.get("sample"), r["completion"]) for r in samples if keep(r)],
            [tuple(m[k] for k in keys) for m in metrics if keep(m)])


def train_jobs(tmp: Path) -> dict[str, list[str] | dict]:
    """The module's `torchrun … vrl train` jobs (run in `launched`, in the order it gives): the 3-iteration
    sampling jobs ("one", rank 0 sampling; "every", `grpo.sample_on_every_rank`; "pool", two engines on rank
    0), the asynchronous job ("async", 3 iterations) and its resume to a 4th ("async_resumed"), the LoRA
    adapter's job ("lora"), dynamic sampling on every rank ("filter", `FILTER_JOB`), the multi-turn episodes'
    jobs ("ep_one", "ep_every": `EPISODE_JOBS`), the job whose rank 0 fails to take the trained weights
    ("failing_push", tests/failing_push_patches.py; the launch goes on), and the job of 1000 iterations that
    SIGTERM to the agents stops ("sigterm"), which ends the launch."""
    # sampling.batch_size=1: the 3 tasks are dealt 2 + 1 (shards start at multiples of the batch size)
    sampling = ["iterations=3", "grpo.learning_rate=0.3", "sampling.batch_size=1"]
    sets = {"one": sampling, "every": [*sampling, "grpo.sample_on_every_rank=true"],
            "pool": [*sampling, "runtime.local.engines=2"],
            "async": ["iterations=3", "grpo.learning_rate=0.3", "grpo.max_staleness=1"],
            "lora": ["grpo.use_peft=true", "grpo.lora_r=4", 'grpo.lora_target_modules=["q_proj"]']}
    jobs = {name: [*_letters_job(tmp / name), *(a for x in extra for a in ("--set", x))] for name, extra in sets.items()}
    jobs["async_resumed"] = ["train", "--resume", str(tmp / "async" / "fsdp"), "--iterations", "4"]
    failing = _letters_job(tmp / "failing_push")
    failing[failing.index("--iterations") + 1] = "4"
    jobs["failing_push"] = {"args": failing, "patch": "tests.failing_push_patches", "then": "continue"}
    jobs["sigterm"] = _letters_job(tmp / "sigterm")
    jobs["sigterm"][jobs["sigterm"].index("--iterations") + 1] = "1000"
    jobs["filter"] = [*_letters_job(tmp / "filter"), *FILTER_JOB]
    for name, extra in EPISODE_JOBS.items():
        sets = [a for x in [f"logging.runs_dir={tmp / name}", *extra] for a in ("--set", x)]
        jobs[name] = ["train", "--plugin", "guess", "--iterations", "2", "--name", "ep", *sets]
    return jobs


@pytest.fixture(scope="module")
def trained(launched):
    """Per job of `train_jobs`: (rank 0's output, the run folder)."""
    return launched[1]


@pytest.mark.slow
def test_vrl_train_sampling_on_every_rank_or_on_two_engines_writes_what_one_engine_writes(trained):
    """`torchrun … vrl train` with `grpo.sample_on_every_rank=true`, and with two engines on rank 0
    (`runtime.local.engines=2`, each taking the streamed push bucket by bucket), against the default
    launch: the same samples (text and tokens) and the same rewards in every iteration, so every engine
    sampled its share with the seeds one engine uses and with the weights trained so far. The launch runs
    on two nodes of one process each; the default job resumes on one process (`resumes_on_one_process`)."""
    rows = {name: _rows(trained[name][1], "reward_mean") for name in ("one", "every", "pool")}
    assert len(rows["one"][1]) == 3
    assert rows["every"] == rows["one"]
    assert rows["pool"] == rows["one"]
    resumes_on_one_process(trained["one"][0], trained["one"][1], iterations=3, lora=False)


@pytest.mark.slow
def test_asynchronous_rollouts_under_torchrun_sample_and_train_as_one_process(trained, tmp_path):
    """`grpo.max_staleness=1` under torchrun: rank 0 samples the next iteration in its producer thread
    while every rank trains its FSDP2 shard, and rank 0's sampler takes the streamed weights between
    passes. Against the same job on one process: the same samples and rewards in every iteration
    (iteration 2's come from the weights after update 0, which both trained to ~1e-7), the same
    staleness, and losses within 1e-5. The 2-rank run then resumes under torchrun: its sampler takes the
    checkpoint's weights before the pipeline restarts, whose first batch is fresh again.

    The one-process job runs in this process through `vrl.cli.main` (click's runner): it asks nothing of
    the process but the run it writes, and its torch threads are 1, as in the ranks (tests/conftest.py)."""
    runs = tmp_path / "runs"
    job = [*_letters_job(runs), "--set", "iterations=3", "--set", "grpo.learning_rate=0.3", "--set", "grpo.max_staleness=1"]
    done = CliRunner().invoke(cli_main, job, catch_exceptions=False)
    assert done.exit_code == 0, done.output[-3000:]
    keys = ("reward_mean", "grpo/staleness/max", "grpo/loss")
    one, two = _rows(runs / "fsdp", *keys), _rows(trained["async"][1], *keys, before=3)
    assert [stale for _, stale, _ in two[1]] == [0, 1, 1]
    assert two[0] == one[0]
    assert [m[:2] for m in two[1]] == [m[:2] for m in one[1]]
    assert [m[2] for m in two[1]] == pytest.approx([m[2] for m in one[1]], abs=1e-5)
    metrics = [json.loads(x) for x in (trained["async"][1] / "metrics.jsonl").read_text().splitlines()]
    assert [(m["iteration"], m["grpo/staleness/max"]) for m in metrics] == [(0, 0), (1, 1), (2, 1), (3, 0)]


FILTER_JOB = ["-o", "mix=true", "--set", "grpo.filter_groups=true", "--set", "grpo.gen_batch_multiplier=1",
              "--set", "grpo.max_num_gen_batches=4", "--set", "grpo.filter_groups_exhausted=train",
              "--set", "grpo.sample_on_every_rank=true", "--set", "sampling.batch_size=1", "--set", "iterations=3"]
"""Dynamic sampling under torchrun: `letters -o mix=true` (3 in 4 tasks always or never solved), 3 tasks per
generation batch, every rank sampling its share of each batch, so an iteration draws several batches."""


EPISODE_JOBS = {name: ["tasks_per_iteration=2", "grpo.num_generations=2", "grpo.micro_batch_size=2",
                       "sampling.batch_size=1", *extra]
                for name, extra in {"ep_one": [], "ep_every": ["grpo.sample_on_every_rank=true"]}.items()}
"""Episodes under torchrun: GRPO on the multi-turn `guess` game (2 iterations), rank 0 sampling alone or every
rank its share (`grpo.sample_on_every_rank`: rank 1 runs whole episodes too)."""


@pytest.mark.slow
def test_every_rank_samples_whole_episodes_as_rank_0_alone_does(trained):
    """GRPO on the multi-turn `guess` game under torchrun writes the same episodes (every turn's role, text
    and tokens) and rewards whether rank 0 samples alone or every rank samples its share (`EPISODE_JOBS`)."""
    rows = {}
    for name in EPISODE_JOBS:
        run = trained[name][1]
        samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        rows[name] = ([(s["iteration"], s["task_id"], s["sample"],
                        [(t["role"], t["content"], t["tokens"]) for t in s["episode"]["turns"]]) for s in samples],
                      [(m["reward_mean"], m["episodes/count"], m["grpo/trained_tokens"]) for m in metrics])
        assert all(m["episodes/count"] == 4 for m in metrics) and len(metrics) == 2
    assert rows["ep_every"] == rows["ep_one"]


@pytest.mark.slow
def test_dynamic_sampling_under_torchrun_draws_the_batches_and_trains_the_groups_of_one_process(trained, tmp_path):
    """`grpo.filter_groups=true` on 2 ranks, each sampling its share of every generation batch: rank 0 decides
    the groups from the whole batch and both ranks train the batch it sends, so they agree on its size (a
    disagreement would hang or fail the collectives). Against the same job on one process (this process,
    `vrl.cli.main`): the same tasks.jsonl (every drawn task: batch, attempts, passes, outcome, kept or why
    not), the same samples, the same `filter/*` metrics and rewards, losses within 1e-5; and some iteration
    drew more than one generation batch."""
    runs = tmp_path / "runs"
    done = CliRunner().invoke(cli_main, [*_letters_job(runs), *FILTER_JOB], catch_exceptions=False)
    assert done.exit_code == 0, done.output[-3000:]
    keys = ("reward_mean", "reward_mean_trained", "tokens", "tokens_discarded", "filter/gen_batches",
            "filter/trained_groups", "filter/informative_frac", "filter/exhausted", "grpo/frac_reward_zero_std")
    one, two = _rows(runs / "fsdp", *keys, "grpo/loss"), _rows(trained["filter"][1], *keys, "grpo/loss")
    assert len(two[1]) == 3 and two[0] == one[0]
    assert [m[:-1] for m in two[1]] == [m[:-1] for m in one[1]]
    assert [m[-1] for m in two[1]] == pytest.approx([m[-1] for m in one[1]], abs=1e-5)
    tasks = (trained["filter"][1] / "tasks.jsonl").read_text()
    assert tasks == (runs / "fsdp" / "tasks.jsonl").read_text()
    rows = [json.loads(x) for x in tasks.splitlines()]
    assert max(r["batch"] for r in rows) >= 1 and max(m[4] for m in two[1]) >= 2  # several generation batches
    assert {r["outcome"] for r in rows} >= {"all_pass", "all_fail"} and any(r["kept"] for r in rows)
    assert all(m[-2] == 0 for m in two[1])  # grpo/frac_reward_zero_std: only informative groups trained


@pytest.mark.slow
def test_the_other_ranks_wait_for_rank_0s_next_command_beyond_the_collective_timeout(steps):
    """Between commands rank 0 samples and verifies, which for a large Lean batch takes longer than any
    collective should wait: with `grpo.ddp_timeout` = 3 s, rank 0 pausing 8 s before it sends the batch
    still trains (the other ranks' wait for a command has no bound), and the step is the one without a
    pause."""
    paused, _ = steps["paused"]
    assert paused["world"] == 2 and paused["metrics"]["grpo/loss"] == steps["default"][0]["metrics"]["grpo/loss"]


@pytest.mark.slow
def test_keeping_layers_gathered_from_forward_to_backward_changes_nothing_but_the_gathers(steps):
    """`grpo.fsdp_reshard_after_forward=false`: the same step to the bit (the same gathered weights enter the
    same arithmetic), with fewer all-gathers (each layer's forward weights serve its backward)."""
    default, kept = steps["default"][0], steps["kept_gathered"][0]
    assert kept["metrics"]["grpo/loss"] == default["metrics"]["grpo/loss"]
    assert all(torch.equal(a, b) for a, b in zip(kept["grads"][0], default["grads"][0]))
    assert all(torch.equal(kept["weights"][k], v) for k, v in default["weights"].items())
    assert 0 < kept["gathers"] < default["gathers"]


def test_micro_batches_are_dealt_evenly():
    """Every rank gets as many micro-batches (FSDP2's collectives need it), none larger than asked,
    every row exactly once; a rank short of rows gets an empty one (trained as a zero-weight filler)."""
    for n in range(1, 40):
        for world in (1, 2, 3, 4):
            for mbs in (1, 3, 8):
                shares = [share_rows(list(range(n)), world, mbs, r) for r in range(world)]
                assert len({len(s) for s in shares}) == 1
                rows = sorted(i for s in shares for chunk in s for i in chunk)
                assert rows == list(range(n))
                assert all(len(chunk) <= mbs for s in shares for chunk in s)
                if n >= world * len(shares[0]):
                    assert all(chunk for s in shares for chunk in s)
    assert share_rows(list(range(3)), 2, 1, 0) == [[], [1]] and share_rows(list(range(3)), 2, 1, 1) == [[0], [2]]


def _letters_job(runs: Path) -> list[str]:
    """`vrl train` arguments of a 2-iteration GRPO job on the toy environment, writing under `runs`."""
    return ["train", "--plugin", "letters", "--optimizer", "grpo", "--iterations", "2", "--name", "fsdp",
            "--set", f"logging.runs_dir={runs}", "--set", "tasks_per_iteration=3", "--set", "grpo.num_generations=4",
            "--set", "sampling.max_new_tokens=8", "--set", "sampling.temperature=1.0", "--set", "grpo.micro_batch_size=4",
            "--set", "grpo.learning_rate=1e-2"]


def resumes_on_one_process(output: str, run: Path, iterations: int, lora: bool) -> None:
    """A finished `torchrun … vrl train` of `iterations` (node 0's output of it, the run `run`): rank 0 alone
    wrote the run (one metrics line per iteration, one console: its own), both ranks trained, the last
    checkpoint records 2 ranks; then `vrl train --resume` on one process continues it by one iteration."""
    assert output.count("vrl train") == 1, output[-3000:]  # one console: rank 0's
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(iterations))
    # Every step trains (LoRA's job); the sampling test's job (3 tasks, learning rate 0.3) may meet a batch whose
    # rewards are all equal, which has no gradient: there some step trains.
    assert (all if lora else any)(r["grpo/grad_norm"] > 0 for r in rows)
    ckpt = run / "grpo" / f"iter-{iterations:06d}"
    state = torch.load(ckpt / "state.pt", weights_only=True)
    assert state["world_size"] == 2 and state["iteration"] == iterations and state["config"]["use_peft"] is lora
    assert (ckpt / "policy" / ("adapter_model.safetensors" if lora else "model.safetensors")).is_file()
    trainer = Trainer(_toy_config_from(run, iterations + 1), run_dir=RunDir.open(run), environment=LettersEnvironment(),
                      console=Console(file=io.StringIO()))
    assert trainer.start_iteration == iterations
    assert trainer.run()["status"] == "finished"
    assert [r["iteration"] for r in trainer.run_dir.metrics()] == list(range(iterations + 1))


@pytest.mark.slow
def test_vrl_train_of_a_lora_adapter_under_torchrun_then_resume_on_one_process(trained):
    """`torchrun … vrl train` on the toy environment training a LoRA adapter (`grpo.use_peft`, data-parallel)
    on two nodes of one process each (the module's launch), then resumed on one process
    (`resumes_on_one_process`)."""
    output, run = trained["lora"]
    resumes_on_one_process(output, run, iterations=2, lora=True)


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_the_run_with_the_last_iteration_checkpointed(trained):
    """Stopping a launch (`kill <torchrun>`, a scheduler's stop: here SIGTERM to both nodes' agents, the module's
    launch, once its last job has finished an iteration) sends SIGTERM to every rank: rank 0 stops the run as
    Ctrl-C does, and the other ranks, which ignore it, still take part in the checkpoint of the last finished
    iteration (sharded: a collective) before rank 0 releases them. Before, they died at once and rank 0 could
    write nothing; the iterations since the last timed checkpoint were lost."""
    output, run = trained["sigterm"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted", (summary, output[-3000:])
    done = summary["iterations_completed"]
    assert 1 <= done < 1000
    state = torch.load(run / "grpo" / f"iter-{done:06d}" / "state.pt", weights_only=True)
    assert state["world_size"] == 2 and state["iteration"] == done
    trainer = Trainer(_toy_config_from(run, done + 1), run_dir=RunDir.open(run), environment=LettersEnvironment(),
                      console=Console(file=io.StringIO()))
    assert trainer.start_iteration == done  # from that checkpoint, not from scratch
    assert trainer.run()["status"] == "finished"


@pytest.mark.slow
def test_a_push_that_fails_on_rank_0_ends_the_launch_with_its_error_not_a_hang(trained):
    """Rank 0's host fails in the middle of taking the trained weights (an engine that loses its GPU):
    the run ends with that error, the iteration before it kept, and every rank goes on (the module's
    launch runs its next job, within LAUNCH_TIMEOUT_S). Before, rank 0 left the step's remaining
    collectives to go and release the other ranks, while rank 1 waited in the step's next all-reduce:
    both hung until the collective timeout (30 minutes by default)."""
    output, run = trained["failing_push"]
    assert (trained["sigterm"][1] / "metrics.jsonl").is_file()  # the next job ran on both ranks
    assert "the engine lost its GPU in the middle of the push" in output
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1  # the first iteration, whose push went through


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_torchrun_on_two_gpus_trains_over_nccl_and_resumes_on_one(tmp_path):
    """The same job on 2 GPUs: each rank on its own GPU (LOCAL_RANK), FSDP2 over NCCL, rank 0 sampling;
    the sharded checkpoint then resumes on one process."""
    runs = tmp_path / "runs"
    done = torchrun(*VRL, *_letters_job(runs))
    run = runs / "fsdp"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1] and all(r["grpo/grad_norm"] > 0 for r in rows), done.stderr[-3000:]
    state = torch.load(run / "grpo" / "iter-000002" / "state.pt", weights_only=True)
    assert state["world_size"] == 2
    trainer = Trainer(_toy_config_from(run, 3), run_dir=RunDir.open(run), environment=LettersEnvironment(),
                      console=Console(file=io.StringIO()))
    assert trainer.run()["status"] == "finished"
    assert [r["iteration"] for r in trainer.run_dir.metrics()] == [0, 1, 2]


def _toy_config_from(run: Path, iterations: int):
    from vrl.config import build

    recorded = json.loads((run / "config.json").read_text())
    recorded["iterations"] = iterations
    return build(recorded)



def test_a_torchrun_launch_refuses_what_it_cannot_train_before_writing_anything(tmp_path, monkeypatch):
    """WORLD_SIZE > 1 (what torchrun sets): ES with several engines per rank (tests/test_es_torchrun.py runs
    ES under torchrun), and sampling on every rank with asynchronous rollouts, are refused in one line before a run directory exists (GRPO with LoRA is not: the LoRA tests below);
    a rank > 0 never creates one (rank 0 owns it) and refuses the same in the same line."""
    from vrl.config import build
    from vrl.errors import UsageError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    runs = tmp_path / "runs"
    base = {"plugin": "letters", "iterations": 1, "logging": {"runs_dir": str(runs), "name": "r"}}
    every_rank_async = {"optimizer": "grpo", "grpo": {"sample_on_every_rank": True, "max_staleness": 1}}
    es_pool = {"optimizer": "es", "runtime": {"local": {"engines": 2}}}
    for fields, match in ((es_pool, "ES under torchrun runs one engine per rank"),
                          (every_rank_async, "sample_on_every_rank .* cannot run with asynchronous rollouts")):
        with pytest.raises(UsageError, match=match) as err:
            Trainer(build({**base, **fields}), environment=LettersEnvironment(), console=Console(file=io.StringIO()))
        assert "\n" not in str(err.value)
        assert not (runs / "r").exists()
    monkeypatch.setenv("RANK", "1")
    follower = Trainer(build({**base, "optimizer": "grpo"}), environment=LettersEnvironment())
    assert follower.run_dir is None and not (runs / "r").exists()
    # Rank 1 refuses with rank 0's line, at once: it neither waits for rank 0 in the process group nor
    # fails in how the CLI reports a failed run (a rank > 0 has no run directory).
    with pytest.raises(UsageError, match="sample_on_every_rank .* cannot run with asynchronous rollouts"):
        Trainer(build({**base, **every_rank_async}), environment=LettersEnvironment())
    from vrl.cli import _kept

    assert _kept(None) == ""


@pytest.mark.slow
def test_two_ranks_in_bf16_train_through_fp32_shards(steps, monkeypatch):
    """A bf16 model: FSDP2 keeps fp32 shards (the masters), computes in bf16 and reduces in fp32, as
    one process does with its fp32 masters. The gradient agrees to bf16's forward noise (2% of its
    norm, the bound tests/test_grpo.py puts on micro-batching in bf16), and rank 0's sampling model
    ends in bf16 holding the fp32 masters rounded."""
    dist, run = steps["bf16"]
    grads: list[list[torch.Tensor]] = []
    step = GRPO._apply_step
    monkeypatch.setattr(GRPO, "_apply_step", lambda self: grads.append([m.grad.clone() for m in self.master]) or step(self))
    gen = make_generator(dtype=torch.bfloat16)
    opt = GRPO(GRPOConfig(**FIELDS), seed=0, total_iterations=10)
    opt.setup(gen)
    opt.tell(sample_results(gen))
    one, two = torch.cat([g.flatten() for g in grads[0]]), torch.cat([g.flatten() for g in dist["grads"][0]])
    assert two.dtype == torch.float32 and one.abs().sum() > 0
    assert float((one - two).norm() / one.norm()) < 0.02
    assert all(w.dtype == torch.bfloat16 for w in dist["weights"].values())
    gen2 = make_generator(dtype=torch.bfloat16)
    resumed = GRPO(GRPOConfig(**FIELDS), seed=0, total_iterations=10)
    resumed.setup(gen2)
    resumed.load(run, 1)
    assert all(torch.equal(gen2.model.state_dict()[k], v) for k, v in dist["weights"].items())
    assert all(m.dtype == torch.float32 for m in resumed.master)


@pytest.mark.slow
def test_two_ranks_train_a_lora_adapter_as_one_process(steps, monkeypatch):
    """Loss, adapter gradients and updated adapter of a 2-rank LoRA step (`grpo.use_peft`: data-parallel, every
    rank holds the whole frozen base and adapter, the adapter's gradients all-reduced) equal the one-process
    step's; the frozen base does not move, both ranks hold the same adapter bits after the step, and rank
    0's sampling host got the trained adapter.

    Tolerances (as for full fine-tuning above): the loss and the gradient norm to 1e-6 relative, every
    gradient element to 1e-6 of its tensor's largest (the ranks sum their micro-batches in another order);
    each updated weight to the bound AdamW's first step puts on that gradient difference,
    lr · min(2, ε/(|g| + ε)² · |Δg|), plus 4 fp32 ulps."""
    dist, _ = steps["lora"]
    assert dist["world"] == 2
    grads = capture_grads(monkeypatch)
    gen = make_generator()
    opt = GRPO(GRPOConfig(**LORA), seed=0, total_iterations=10)
    opt.setup(gen)
    metrics = opt.tell(sample_results(gen))
    weights = gen.model.state_dict()
    assert_same_step(dist, metrics, grads)
    assert [g.shape for g in dist["grads"][0]] == [p.shape for p in opt.params]  # the adapter only, whole
    assert set(dist["weights"]) == set(weights)
    base = make_generator().model.state_dict()
    for k, v in dist["weights"].items():
        if "lora_" not in k:  # the frozen base, as loaded
            assert torch.equal(v, base[k.replace(".base_layer", "")]), k
    eps, lr = 1e-8, LORA["learning_rate"]
    clip = [min(1.0, 1.0 / (m["grpo/grad_norm"] + 1e-6)) for m in (metrics, dist["metrics"])]
    for name, p, g1, g2 in zip(opt.param_names, opt.params, grads[0], dist["grads"][0]):
        key = name.removeprefix("base_model.model.")
        assert torch.equal(p.detach(), weights[key])
        g1, g2 = g1 * clip[0], g2 * clip[1]
        diff = (g1 - g2).abs()
        slope = eps / ((g1.abs() - diff).clamp(min=0) + eps) ** 2
        ulps = 4 * torch.finfo(torch.float32).eps * (weights[key].abs() + lr)
        bound = lr * torch.clamp(slope * diff, max=2.0) + ulps
        assert bool(((dist["weights"][key] - weights[key]).abs() <= bound).all()), name
    one, two = dist["replicas"]
    assert all(torch.equal(a, b) for a, b in zip(one, two))  # the ranks never drift apart
    assert dist["syncs"] == 1  # rank 0's host was handed the trained model after the step
    trained = {k: v for k, v in dist["weights"].items() if ".lora_B." in k}
    assert trained and max(float(v.abs().max()) for v in trained.values()) > 0.5 * lr  # B starts at 0: it moved


@pytest.mark.slow
def test_two_rank_lora_checkpoint_resumes_on_one_process_exactly(steps):
    """The 2-rank LoRA checkpoint loads on one process to the same bits: adapter, AdamW moments, step
    counts, learning rate; its policy folder is the adapter (peft's files), holding the same weights."""
    dist, run = steps["lora"]
    ckpt = run / "grpo" / "iter-000001"
    assert (ckpt / "train" / ".metadata").is_file()
    gen, opt = load_on_one_process(run, LORA, dist)
    from peft import get_peft_model_state_dict

    adapter = load_file(str(ckpt / "policy" / "adapter_model.safetensors"))
    mine = get_peft_model_state_dict(opt.peft_model)
    assert set(adapter) == set(mine) and all(torch.equal(adapter[k], mine[k]) for k in adapter)
    opt.tell(sample_results(gen, seed=7))  # and it trains on from there
    assert opt.step == 2


@pytest.mark.slow
def test_a_one_process_lora_checkpoint_resumes_on_two_ranks(steps, monkeypatch):
    """The other way round: a one-process LoRA run's checkpoint loads on 2 ranks (each takes the whole
    adapter and its AdamW state from `train/`), and the next step there equals the next step of the
    checkpoint resumed on one process: loss and gradient norm to 1e-6 relative, every adapter gradient
    element to 1e-6 of its tensor's largest (the ranks sum in another order), both ranks' adapters
    identical after it. (A resume that missed the adapter would train from B = 0: gradients far apart.)"""
    dist, run = steps["lora_resumed"]
    grads = capture_grads(monkeypatch)
    gen = make_generator()
    again = GRPO(GRPOConfig(**LORA), seed=0, total_iterations=10)
    again.setup(gen)
    again.load(run.parent / "lora_one", 1)
    metrics = again.tell(sample_results(gen, seed=7))
    assert dist["metrics"]["grpo/loss"] == pytest.approx(metrics["grpo/loss"], rel=1e-6)
    assert dist["metrics"]["grpo/grad_norm"] == pytest.approx(metrics["grpo/grad_norm"], rel=1e-6)
    assert len(dist["grads"]) == len(grads) == 1
    for a, b in zip(dist["grads"][0], grads[0]):
        assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max())
    assert all(float(g.abs().max()) > 0 for g in grads[0])  # A's gradients too, now that B ≠ 0
    one, two = dist["replicas"]
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert (run / "grpo" / "iter-000002").is_dir()


@pytest.mark.slow
def test_two_fsdp2_ranks_train_compiled_layers_as_one_eager_process(steps, monkeypatch):
    """`grpo.compile` under `torchrun` with 2 CPU ranks (gloo, the real FSDP2, dynamo and AOTAutograd; the
    backend aot_eager, see SCENARIOS): layers compiled before `fully_shard` wraps the training copy; every
    rank compiles, and the step equals one eager process's step within tests/test_grpo_compile.py's
    tolerances (the ranks also sum their micro-batches in another order)."""
    from tests.test_grpo_compile import GRAD_RTOL, LR, assert_adamw_step_close

    dist, _ = steps["compiled"]
    assert len(dist["graphs"]) == 2 and all(n >= 1 for n in dist["graphs"]), dist["graphs"]
    # the graphs include the head's chunks: every layer of each rank's sharded copy runs compiled too
    assert dist["compiled_layers"] == [len(make_generator().model.model.layers)] * 2, dist["compiled_layers"]
    grads = capture_grads(monkeypatch)
    gen = make_generator()
    eager = {k: v for k, v in SCENARIOS["compiled"].items() if k not in ("compile", "compile_backend")}
    opt = GRPO(GRPOConfig(**eager), seed=0, total_iterations=10)
    opt.setup(gen)
    metrics = opt.tell(sample_results(gen))
    assert dist["world"] == 2
    assert dist["metrics"]["grpo/loss"] == pytest.approx(metrics["grpo/loss"], rel=1e-6, abs=1e-9)
    assert dist["metrics"]["grpo/grad_norm"] == pytest.approx(metrics["grpo/grad_norm"], rel=1e-5)
    for a, b in zip(grads[0], dist["grads"][0]):
        assert float((a - b).abs().max()) <= GRAD_RTOL * float(a.abs().max()) + 1e-12
    assert FIELDS["learning_rate"] == LR
    assert_adamw_step_close(opt.param_names, grads[0], dist["grads"][0], metrics, dist["metrics"],
                            gen.model.state_dict(), dist["weights"])
