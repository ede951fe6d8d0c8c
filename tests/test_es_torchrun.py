"""ES under torchrun on CPU ranks (gloo, hf backend, the tiny local model), launched with the real
`torchrun`, against one process: the same rewards, samples, history and θ, bit for bit.

Every run is the real `vrl train` with tests/es_torchrun_patches.py held around it, which also writes each
rank's θ checksum after every update (and can kill a rank, or nudge one rank's update), counts in each
verdict the rank that judged it, and has the verifier raise on member 1's attempts (a verifier's own bug,
here always on a rank > 0 under torchrun, which verifies its own share). Several nodes are emulated as the
GRPO tests do: torchrun agents of one process each (`--nnodes N --node-rank i`) on this machine, sharing
its filesystem; only the hosts are absent. The vLLM test needs 2 GPUs (skipped here).

A launch costs every rank its interpreter, torch and transformers: the jobs of one world size run in one
launch (tests/torchrun_jobs.py, in order, a job meant to fail last), and the one-process runs run in this
process through `vrl.cli.main` (click's runner). One process here is what one process of `vrl train` is:
these runs ask nothing of the process but its exit status and output, which the runner returns; its
torch threads are 1, as in the ranks (tests/conftest.py), so the arithmetic is the same.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests import es_torchrun_patches, torchrun_jobs
from tests.torchrun_jobs import split
from vrl.cli import main

HERE = Path(__file__).parent
JOBS = str(HERE / "torchrun_jobs.py")
# 5 members over 2 or 3 ranks: dealt unevenly; sigma large enough that the members' rewards differ.
SETTINGS = ["tasks_per_iteration=3", "es.population_size=5", "sampling.max_new_tokens=8", "sampling.temperature=1.0",
            "es.sigma=0.05", "logging.samples_per_iteration=15",
            "es.max_lost_share=0.2"]  # member 1, whose every attempt the test's verifier fails, has no fitness (issue 56)
LOWRANK = ("es.noise=lowrank", "es.rank=2")

pytestmark = pytest.mark.slow  # about 2 minutes of launches on the 2-core machine


def job(runs: Path, iterations: int, resume: Path | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """`vrl train` arguments of an ES run on the toy environment named "es" under `runs` (or its resume)."""
    if resume is not None:
        return ["train", "--resume", str(resume), "--iterations", str(iterations)]
    sets = [a for s in [f"logging.runs_dir={runs}", *SETTINGS, *extra] for a in ("--set", s)]
    return ["train", "--plugin", "letters", "--optimizer", "es", "--iterations", str(iterations), "--name", "es", *sets]


def one_process(args: list[str], checksums: Path, env: dict[str, str] | None = None):
    """`vrl train args` as one process (this one), instrumented as the ranks are; its exit status must be 0.
    Returns click's result (its `stderr` is the console's)."""
    checksums.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as mp, es_torchrun_patches.patched():
        for k, v in {"VRL_TEST_CHECKSUMS": str(checksums), "VRL_TEST_VERIFIER_ERROR": "1", **(env or {})}.items():
            mp.setenv(k, v)
        done = CliRunner().invoke(main, args, catch_exceptions=False)
    assert done.exit_code == 0, done.output[-6000:]
    return done


def launch(jobs: list[tuple[list[str], Path, dict[str, str]]], ranks: int, nodes: int = 1,
           check: bool = True, then: dict[int, str] | None = None) -> tuple[int, list[str]]:
    """`jobs` (arguments, checksum folder, the job's own variables; `then`: {job index: "continue"} for a
    job that fails on rank 0 alone, tests/torchrun_jobs.py) one after another in one process
    (`ranks=1`) or one torchrun launch: `ranks` processes on one node, or `nodes` agents of `ranks // nodes` processes each (as on `nodes`
    hosts). Returns node 0's agent's exit status and rank 0's output (stdout and stderr) of each job run."""
    spec = {"patch": "tests.es_torchrun_patches",
            "jobs": [{"args": args, "env": {"VRL_TEST_CHECKSUMS": str(sums), **extra}, "then": (then or {}).get(i)}
                     for i, (args, sums, extra) in enumerate(jobs)]}
    for _, sums, _ in jobs:
        sums.mkdir(parents=True, exist_ok=True)
    spec_file = jobs[0][1].parent / f"jobs-{len(list(jobs[0][1].parent.glob('jobs-*.json')))}.json"
    spec_file.write_text(json.dumps(spec))
    cmds, env = torchrun_jobs.commands(JOBS, str(spec_file), ranks=ranks, nodes=nodes,
                                       env={"VRL_TEST_VERIFIER_ERROR": "1"})
    if ranks == 1:  # one process of its own, without torchrun (an engine that must not share this one's GPU)
        cmds = [[sys.executable, JOBS, str(spec_file)]]
    done = torchrun_jobs.agents(cmds, env, timeout=300 * len(jobs))
    if check:
        for p in done:
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return done[0].returncode, [o + e for o, e in zip(split(done[0].stdout), split(done[0].stderr))]


def record(run: Path, checksums: Path) -> dict:
    """What a run wrote, per iteration (rewards, member rewards, samples, history), every rank's θ
    checksums by iteration ({rank: {iteration: checksum}}), and how many verdicts each rank's verifier
    counted in each iteration ({iteration: {rank: n}}, from the verifier's summed counters)."""
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    sums: dict[str, dict[int, str]] = {}
    for f in sorted(checksums.glob("rank*.txt")):
        for line in f.read_text().splitlines():
            it, s = line.split()
            sums.setdefault(f.stem, {})[int(it)] = s
    return {"rewards": [(m["iteration"], m["reward_mean"], m["es/member_reward_mean"], m["es/member_reward_std"],
                         m["es/member_reward_max"]) for m in metrics],
            "samples": [(s["iteration"], s["task_id"], s.get("variant"), s["completion"]) for s in samples],
            "history": json.loads((run / "es_history.json").read_text())["iterations"],
            "checksums": sums,
            "verified": {m["iteration"]: {k.removeprefix("test/verified_by_"): v for k, v in m.items()
                                          if k.startswith("test/verified_by_")} for m in metrics}}


def verifier_error_line(stderr: str) -> str:
    """Rank 0's console line reporting the verifier's error on member 1's attempts (once per launch)."""
    lines = [x for x in stderr.splitlines() if "verifier error on" in x]
    assert len(lines) == 1, stderr[-3000:]
    return re.sub(r"^\[[0-9:]+\] ", "", lines[0])  # without its timestamp


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process run of 5 iterations, everything later launches are compared with."""
    tmp = tmp_path_factory.mktemp("es_one")
    done = one_process(job(tmp / "runs", 5), tmp / "sums")
    ref = record(tmp / "runs" / "es", tmp / "sums")
    assert len(ref["rewards"]) == 5 and all(r[3] > 0 for r in ref["rewards"])  # members' rewards differ
    ref["error_line"] = verifier_error_line(done.stderr)
    assert ref["error_line"].startswith("verifier error on 3 of 15 attempts (crashed verdicts with no reward: GRPO "
                                        "leaves them out of its statistics and update, ES out of the member's fitness; "
                                        "reported once): "
                                        "RuntimeError: the test's verifier fails on member 1 (")
    assert ref["verified"] == {i: {"rank0": 12} for i in range(5)}  # members 0, 2, 3, 4 (1's raised)
    return ref


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The module's two launches, their jobs' folders and outputs. On two nodes of one process each: the
    first 3 iterations of the resumed run ("resumed"), then the run whose rank 1 is killed in its second
    iteration ("killed"; the launch ends there). On 3 ranks of one node: "resumed" continued to its 4th
    iteration, the low-rank run of 2 iterations whose rank 2 misapplies the last update ("drift_last"; it
    fails on rank 0, the ranks go on), then the low-rank run whose rank 2 drifts ("drift"; the run ends there)."""
    tmp = tmp_path_factory.mktemp("es_launches")
    dirs = {name: (tmp / name / "runs", tmp / name / "sums") for name in ("resumed", "killed", "drift", "drift_last")}
    (runs, sums), (killed_runs, killed_sums) = dirs["resumed"], dirs["killed"]
    code, (resumed, killed) = launch([(job(runs, 3), sums, {}),
                                      (job(killed_runs, 3), killed_sums, {"VRL_TEST_KILL": "1:1"})],
                                     ranks=2, nodes=2, check=False)
    out = {"resumed": [resumed], "killed": (code, killed)}
    (drift_runs, drift_sums), (last_runs, last_sums) = dirs["drift"], dirs["drift_last"]
    code, (resumed, drift_last, drift) = launch(
        [(job(runs, 4, resume=runs / "es"), sums, {}),
         (job(last_runs, 2, extra=LOWRANK), last_sums, {"VRL_TEST_DRIFT": "2:1"}),
         (job(drift_runs, 3, extra=LOWRANK), drift_sums, {"VRL_TEST_DRIFT": "2:1"})],
        ranks=3, check=False, then={1: "continue"})
    out["resumed"].append(resumed)
    out["drift"] = (code, drift)
    out["drift_last"] = drift_last
    return dirs, out


def prefix(ref: dict, n: int) -> dict:
    """The reference's first `n` iterations."""
    return {"rewards": ref["rewards"][:n], "samples": [s for s in ref["samples"] if s[0] < n],
            "history": ref["history"][:n]}


def test_two_ranks_on_two_nodes_then_three_ranks_then_one_process_equal_one_process(reference, launches):
    """2 ranks as two nodes (two torchrun agents) for 3 iterations, resumed on 3 ranks of one node for the
    4th and on one process for the 5th: every iteration's rewards, samples and history equal the
    one-process run's, every rank's θ equals its θ after every update, and rank 0 alone spoke. Each rank
    verified the attempts of its own members (member i on rank i mod K), the verifier's counters are summed
    over the ranks, and the error of rank 1's verifier reaches rank 0's console as the one-process line."""
    dirs, out = launches
    runs, sums = dirs["resumed"]
    two_nodes, three_ranks = out["resumed"]
    assert two_nodes.count("vrl train run") == 1, two_nodes[-3000:]  # one console: rank 0's
    assert verifier_error_line(two_nodes) == reference["error_line"]
    run = runs / "es"
    assert verifier_error_line(three_ranks) == reference["error_line"]
    got = record(run, sums)
    assert {k: got[k] for k in ("rewards", "samples", "history")} == prefix(reference, 4)
    assert all(got["verified"][i] == {"rank0": 9, "rank1": 3} for i in range(3))  # rank 1: members 1 (raised) and 3
    assert got["verified"][3] == {"rank0": 6, "rank1": 3, "rank2": 3}
    assert sorted(got["checksums"]) == ["rank0", "rank1", "rank2"]  # node 1's agent wrote to the same folder
    one_process(job(runs, 5, resume=run), sums)
    got = record(run, sums)
    assert got["verified"][4] == {"rank0": 12}
    assert {k: got[k] for k in ("rewards", "samples", "history")} == prefix(reference, 5)
    want = reference["checksums"]["rank0"]
    for rank, by_iteration in got["checksums"].items():
        assert by_iteration == {i: want[i] for i in by_iteration}, rank
    assert sorted(got["checksums"]["rank1"]) == [1, 2, 3, 4] and sorted(got["checksums"]["rank2"]) == [4]
    assert sorted(got["checksums"]["rank0"]) == [1, 2, 3, 4, 5]


def test_a_rank_killed_mid_iteration_ends_the_launch_naming_it_and_the_run_resumes(reference, launches):
    """Rank 1 of 2 (on a node of its own) dies (SIGKILL) when asked for its share of the second iteration:
    the launch ends, rank 0 names rank 1 in one line, the first iteration stays recorded (metrics and
    es_history.json), and the run resumes on one process to the same results as the one-process run."""
    dirs, out = launches
    runs, sums = dirs["killed"]
    code, output = out["killed"]
    assert code != 0
    assert "rank 1 of 2 stopped answering" in output, output[-4000:]
    run = runs / "es"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["iterations_completed"] == 1, summary
    assert "rank 1 of 2 stopped answering" in summary["error"]
    assert len(json.loads((run / "es_history.json").read_text())["iterations"]) == 1
    shutil.rmtree(sums)
    one_process(job(runs, 2, resume=run), sums)
    got = record(run, sums)
    assert {k: got[k] for k in ("rewards", "samples", "history")} == prefix(reference, 2)
    assert got["checksums"]["rank0"] == {2: reference["checksums"]["rank0"][2]}


def test_a_rank_whose_weights_drift_stops_the_run_in_one_line_naming_it(launches, tmp_path):
    """Low-rank members (es.noise=lowrank: each rank batches its dealt members in one pass) on 3 ranks: the
    first two iterations equal one process's. Rank 2 applies the second update with one member's weight
    nudged by 1e-4: the fingerprint of its θ comes with its share of the third iteration, and rank 0 stops
    the run with one line naming rank 2 before that iteration is recorded (es_history.json holds two:
    rank 0's record of the second is right; only rank 2 applied it wrongly)."""
    dirs, out = launches
    one_process(job(tmp_path / "one", 2, extra=LOWRANK), tmp_path / "sums-one")
    one = record(tmp_path / "one" / "es", tmp_path / "sums-one")
    code, output = out["drift"]
    assert code != 0
    got = drifted(dirs["drift"], output, "rank 2's weights differ from rank 0's after iteration 1", one)
    assert got["checksums"]["rank1"][1] == got["checksums"]["rank2"][1] == one["checksums"]["rank0"][1]
    # The same nudge on a run of 2 iterations: its last update, which no share follows, is compared once the
    # run has trained them all (`Optimizer.finish`), and the run is recorded as failed with the same line.
    drifted(dirs["drift_last"], out["drift_last"], "rank 2's weights differ from rank 0's after iteration 1, the run's last",
            one)


def drifted(folders: tuple[Path, Path], output: str, line: str, one: dict) -> dict:
    """A run whose rank 2 misapplied its second update (of the launch's `folders`: runs, checksums): `line`
    on rank 0's console and in its failed summary, its two iterations equal `one`'s, and after the second
    update rank 1's θ is one's while rank 2's is not. Returns the run's record."""
    runs, sums = folders
    assert line in output, output[-4000:]
    summary = json.loads((runs / "es" / "summary.json").read_text())
    assert summary["status"] == "failed" and line in summary["error"] and summary["iterations_completed"] == 2
    got = record(runs / "es", sums)
    assert {k: got[k] for k in ("rewards", "samples", "history")} == prefix(one, 2)
    assert got["checksums"]["rank1"][2] == one["checksums"]["rank0"][2] != got["checksums"]["rank2"][2]
    return got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_ranks_on_two_gpus_with_vllm_equal_one_engine(tmp_path):
    """The same job on vLLM: one engine in one process, against 2 ranks with an engine each on its own GPU
    (LOCAL_RANK): the same rewards, samples and history, and every rank's θ checksum (computed inside the
    engines' workers) equal to the one engine's after every update. (Not run on the CPU machine.)"""
    vllm = ("generator.backend=vllm", "generator.vllm.enforce_eager=true", "generator.vllm.gpu_memory_utilization=0.3")
    launch([(job(tmp_path / "one", 3, extra=vllm), tmp_path / "sums-one", {})], ranks=1)
    one = record(tmp_path / "one" / "es", tmp_path / "sums-one")
    launch([(job(tmp_path / "two", 3, extra=vllm), tmp_path / "sums-two", {})], ranks=2)
    two = record(tmp_path / "two" / "es", tmp_path / "sums-two")
    assert {k: two[k] for k in ("rewards", "samples", "history")} == {k: one[k] for k in ("rewards", "samples", "history")}
    assert two["checksums"]["rank0"] == two["checksums"]["rank1"] == one["checksums"]["rank0"]
