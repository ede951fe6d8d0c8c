"""Episodes under torchrun (2 CPU ranks, gloo, the real launcher): GRPO on the multi-turn `guess` game
writes the same episodes and rewards whether rank 0 samples alone or every rank samples its share
(`grpo.sample_on_every_rank`: rank 1 runs whole episodes too). Both jobs run one after the other in one
launch (tests/torchrun_jobs.py): a launch costs every rank its interpreter, torch and transformers."""

from __future__ import annotations

import json

import pytest

from tests.test_grpo_fsdp import jobs_launch


@pytest.mark.slow
def test_every_rank_samples_whole_episodes_as_rank_0_alone_does(tmp_path):
    jobs = {}
    for name, extra in {"one": [], "every": ["grpo.sample_on_every_rank=true"]}.items():
        sets = [a for x in [f"logging.runs_dir={tmp_path / name}", "tasks_per_iteration=2", "grpo.num_generations=2",
                            "grpo.micro_batch_size=2", "sampling.batch_size=1", *extra] for a in ("--set", x)]
        jobs[name] = ["train", "--plugin", "guess", "--iterations", "2", "--name", "ep", *sets]
    jobs_launch(tmp_path, jobs)
    rows = {}
    for name in jobs:
        samples = [json.loads(x) for x in (tmp_path / name / "ep" / "samples.jsonl").read_text().splitlines()]
        metrics = [json.loads(x) for x in (tmp_path / name / "ep" / "metrics.jsonl").read_text().splitlines()]
        rows[name] = ([(s["iteration"], s["task_id"], s["sample"],
                        [(t["role"], t["content"], t["tokens"]) for t in s["episode"]["turns"]]) for s in samples],
                      [(m["reward_mean"], m["episodes/count"], m["grpo/trained_tokens"]) for m in metrics])
        assert all(m["episodes/count"] == 4 for m in metrics) and len(metrics) == 2
    assert rows["every"] == rows["one"]
