"""ES under torchrun on CPU ranks (gloo, hf backend, the tiny local model), launched with the real
`torchrun`, against one process: the same rewards, samples, history and θ, bit for bit.

Every launch runs tests/es_torchrun_cli.py: the real `vrl train`, which also writes each rank's θ checksum
after every update (and can kill a rank, or nudge one rank's update), counts in each verdict the rank that
judged it, and has the verifier raise on member 1's attempts (a verifier's own bug, here always on a
rank > 0 under torchrun, which verifies its own share). Several nodes are emulated as the
GRPO tests do: torchrun agents of one process each (`--nnodes N --node-rank i`) on this machine, sharing
its filesystem; only the hosts are absent. The vLLM test needs 2 GPUs (skipped here).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
CLI = str(HERE / "es_torchrun_cli.py")
# 5 members over 2 or 3 ranks: dealt unevenly; sigma large enough that the members' rewards differ.
SETTINGS = ["tasks_per_iteration=3", "es.population_size=5", "sampling.max_new_tokens=8", "sampling.temperature=1.0",
            "es.sigma=0.05", "logging.samples_per_iteration=15"]

pytestmark = pytest.mark.slow  # about 2 minutes of launches on the 2-core machine


def job(runs: Path, iterations: int, resume: Path | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """`vrl train` arguments of an ES run on the toy environment named "es" under `runs` (or its resume)."""
    if resume is not None:
        return ["train", "--resume", str(resume), "--iterations", str(iterations)]
    sets = [a for s in [f"logging.runs_dir={runs}", *SETTINGS, *extra] for a in ("--set", s)]
    return ["train", "--plugin", "letters", "--optimizer", "es", "--iterations", str(iterations), "--name", "es", *sets]


def launch(args: list[str], checksums: Path, ranks: int = 1, nodes: int = 1, env: dict[str, str] | None = None,
           check: bool = True) -> subprocess.CompletedProcess:
    """`args` as one process (`ranks=1`), or under torchrun: `ranks` processes on one node, or `nodes` agents
    of `ranks // nodes` processes each (as on `nodes` hosts). Returns node 0's agent's output."""
    path = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "VRL_TEST_CHECKSUMS": str(checksums),
           "VRL_TEST_VERIFIER_ERROR": "1", **(env or {})}
    checksums.mkdir(parents=True, exist_ok=True)
    if ranks == 1:
        cmds = [[sys.executable, CLI, *args]]
    else:
        with socket.socket() as s:  # a free port: two test sessions on one machine must not meet
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks // nodes)]
        if nodes == 1:
            cmds = [[*run, "--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", CLI, *args]]
        else:
            cmds = [[*run, "--nnodes", str(nodes), "--node-rank", str(i), "--master-addr", "127.0.0.1",
                     "--master-port", str(port), CLI, *args] for i in range(nodes)]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parent)
             for c in cmds]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    if check:
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, out[-3000:] + err[-6000:]
    return subprocess.CompletedProcess(cmds[0], procs[0].returncode, *outs[0])


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
    done = launch(job(tmp / "runs", 5), tmp / "sums")
    ref = record(tmp / "runs" / "es", tmp / "sums")
    assert len(ref["rewards"]) == 5 and all(r[3] > 0 for r in ref["rewards"])  # members' rewards differ
    ref["error_line"] = verifier_error_line(done.stderr)
    assert ref["error_line"].startswith("verifier error on 3 of 15 attempts (scored as crashed; reported once): "
                                        "RuntimeError: the test's verifier fails on member 1 (")
    assert ref["verified"] == {i: {"rank0": 12} for i in range(5)}  # members 0, 2, 3, 4 (1's raised)
    return ref


def prefix(ref: dict, n: int) -> dict:
    """The reference's first `n` iterations."""
    return {"rewards": ref["rewards"][:n], "samples": [s for s in ref["samples"] if s[0] < n],
            "history": ref["history"][:n]}


def test_two_ranks_on_two_nodes_then_three_ranks_then_one_process_equal_one_process(reference, tmp_path):
    """2 ranks as two nodes (two torchrun agents) for 3 iterations, resumed on 3 ranks of one node for the
    4th and on one process for the 5th: every iteration's rewards, samples and history equal the
    one-process run's, every rank's θ equals its θ after every update, and rank 0 alone spoke. Each rank
    verified the attempts of its own members (member i on rank i mod K), the verifier's counters are summed
    over the ranks, and the error of rank 1's verifier reaches rank 0's console as the one-process line."""
    runs, sums = tmp_path / "runs", tmp_path / "sums"
    done = launch(job(runs, 3), sums, ranks=2, nodes=2)
    assert done.stderr.count("vrl train run") == 1, done.stderr[-3000:]  # one console: rank 0's
    assert verifier_error_line(done.stderr) == reference["error_line"]
    run = runs / "es"
    two = record(run, sums)
    assert {k: two[k] for k in ("rewards", "samples", "history")} == prefix(reference, 3)
    assert two["verified"] == {i: {"rank0": 9, "rank1": 3} for i in range(3)}  # rank 1: members 1 (raised) and 3
    assert sorted(two["checksums"]) == ["rank0", "rank1"]  # node 1's agent wrote to the same folder
    done = launch(job(runs, 4, resume=run), sums, ranks=3)
    assert verifier_error_line(done.stderr) == reference["error_line"]
    launch(job(runs, 5, resume=run), sums)
    got = record(run, sums)
    assert got["verified"][3] == {"rank0": 6, "rank1": 3, "rank2": 3} and got["verified"][4] == {"rank0": 12}
    assert {k: got[k] for k in ("rewards", "samples", "history")} == prefix(reference, 5)
    want = reference["checksums"]["rank0"]
    assert set(got["checksums"]) == {"rank0", "rank1", "rank2"}
    for rank, by_iteration in got["checksums"].items():
        assert by_iteration == {i: want[i] for i in by_iteration}, rank
    assert sorted(got["checksums"]["rank1"]) == [1, 2, 3, 4] and sorted(got["checksums"]["rank2"]) == [4]
    assert sorted(got["checksums"]["rank0"]) == [1, 2, 3, 4, 5]


def test_a_rank_killed_mid_iteration_ends_the_launch_naming_it_and_the_run_resumes(reference, tmp_path):
    """Rank 1 of 2 dies (SIGKILL) when asked for its share of the second iteration: the launch ends, rank 0
    names rank 1 in one line, the first iteration stays recorded (metrics and es_history.json), and the run
    resumes on one process to the same results as the one-process run."""
    runs, sums = tmp_path / "runs", tmp_path / "sums"
    done = launch(job(runs, 3), sums, ranks=2, env={"VRL_TEST_KILL": "1:1"}, check=False)
    assert done.returncode != 0
    assert "rank 1 of 2 stopped answering" in done.stdout + done.stderr, done.stderr[-4000:]
    run = runs / "es"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["iterations_completed"] == 1, summary
    assert "rank 1 of 2 stopped answering" in summary["error"]
    assert len(json.loads((run / "es_history.json").read_text())["iterations"]) == 1
    shutil.rmtree(sums)
    launch(job(runs, 2, resume=run), sums)
    got = record(run, sums)
    assert {k: got[k] for k in ("rewards", "samples", "history")} == prefix(reference, 2)
    assert got["checksums"]["rank0"] == {2: reference["checksums"]["rank0"][2]}


def test_a_rank_whose_weights_drift_stops_the_run_in_one_line_naming_it(tmp_path):
    """Low-rank members (es.noise=lowrank: each rank batches its dealt members in one pass) on 3 ranks: the
    first two iterations equal one process's. Rank 2 applies the second update with one member's weight
    nudged by 1e-4: the fingerprint of its θ comes with its share of the third iteration, and rank 0 stops
    the run with one line naming rank 2 before that iteration is recorded (es_history.json holds two:
    rank 0's record of the second is right; only rank 2 applied it wrongly)."""
    lowrank = ("es.noise=lowrank", "es.rank=2")
    launch(job(tmp_path / "one", 2, extra=lowrank), tmp_path / "sums-one")
    one = record(tmp_path / "one" / "es", tmp_path / "sums-one")
    runs, sums = tmp_path / "runs", tmp_path / "sums"
    done = launch(job(runs, 3, extra=lowrank), sums, ranks=3, env={"VRL_TEST_DRIFT": "2:1"}, check=False)
    assert done.returncode != 0
    line = "rank 2's weights differ from rank 0's after iteration 1"
    assert line in done.stdout + done.stderr, done.stderr[-4000:]
    summary = json.loads((runs / "es" / "summary.json").read_text())
    assert summary["status"] == "failed" and line in summary["error"] and summary["iterations_completed"] == 2
    got = record(runs / "es", sums)
    assert {k: got[k] for k in ("rewards", "samples", "history")} == prefix(one, 2)
    assert got["checksums"]["rank1"][1] == got["checksums"]["rank2"][1] == one["checksums"]["rank0"][1]
    assert got["checksums"]["rank1"][2] == one["checksums"]["rank0"][2] != got["checksums"]["rank2"][2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_ranks_on_two_gpus_with_vllm_equal_one_engine(tmp_path):
    """The same job on vLLM: one engine in one process, against 2 ranks with an engine each on its own GPU
    (LOCAL_RANK): the same rewards, samples and history, and every rank's θ checksum (computed inside the
    engines' workers) equal to the one engine's after every update. (Not run on the CPU machine.)"""
    vllm = ("generator.backend=vllm", "generator.vllm.enforce_eager=true", "generator.vllm.gpu_memory_utilization=0.3")
    launch(job(tmp_path / "one", 3, extra=vllm), tmp_path / "sums-one")
    one = record(tmp_path / "one" / "es", tmp_path / "sums-one")
    launch(job(tmp_path / "two", 3, extra=vllm), tmp_path / "sums-two", ranks=2)
    two = record(tmp_path / "two" / "es", tmp_path / "sums-two")
    assert {k: two[k] for k in ("rewards", "samples", "history")} == {k: one[k] for k in ("rewards", "samples", "history")}
    assert two["checksums"]["rank0"] == two["checksums"]["rank1"] == one["checksums"]["rank0"]
