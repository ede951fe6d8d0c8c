"""Whole training iterations on the vllm backend: `vrl train` (the CLI, in a subprocess, as a user
runs it) on countdown with a Qwen2.5-1.5B-shaped model (random bf16 weights), ES and GRPO.

    python benchmarks/vllm_train_iteration.py --out result.json [--iterations 3] [--only JOB ...] [--repeats 1]
    python benchmarks/vllm_train_iteration.py --out r.json --only es es_2gpus grpo_colocated grpo_separate \
        grpo_colocated_async grpo_separate_async        # 2 GPUs (issue 27: loop scaling, separate-GPU GRPO)

Reports per-iteration seconds (generation, verification, update, loop, checkpoint save) from each
run's metrics.jsonl, and the start-up seconds (wall time minus loops and saves). A random model never stops
early, so every completion runs to `--new-tokens`. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--path", default="/tmp/vrl-bench-model")
    ap.add_argument("--only", nargs="*", help="run only these jobs (default: the 1-GPU ones)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each job, interleaved")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config field for every job")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from vllm_generation import build_model

    build_model(args.path, small=False)
    runs = Path(tempfile.mkdtemp(prefix="vrl-iter-"))
    common = ["--model", args.path, "--iterations", str(args.iterations), "--set", f"logging.runs_dir={runs}",
              "--set", "generator.backend=vllm", "--set", "generator.vllm.max_model_len=1024",
              "--set", f"sampling.max_new_tokens={args.new_tokens}", "--set", "tasks_per_iteration=8"]
    es = ["--optimizer", "es", "--set", "es.population_size=30"]
    grpo = ["--optimizer", "grpo", "--set", "grpo.num_generations=8", "--set", "grpo.gradient_checkpointing=true"]
    # separate-GPU mode: the engine on GPU 0 (runtime.local.gpus' default), the trained copy on GPU 1
    separate = [*grpo, "--set", "generator.device=cuda:1", "--set", "generator.vllm.gpu_memory_utilization=0.5"]
    jobs = {
        "es": es,
        "grpo_colocated_sleep": ["--optimizer", "grpo", "--set", "grpo.num_generations=8",
                                 "--set", "generator.vllm.sleep=true", "--set", "grpo.gradient_checkpointing=true"],
        "grpo_colocated_sleep_save_every_3": ["--optimizer", "grpo", "--set", "grpo.num_generations=8",
                                              "--set", "generator.vllm.sleep=true", "--set", "grpo.gradient_checkpointing=true",
                                              "--set", "grpo.save_every=3"],
    }
    two_gpus = {  # issue 27: the loop's own figures on 2 GPUs against 1
        "es_2gpus": [*es, "--set", "runtime.local.engines=2", "--set", "runtime.local.gpus=[0,1]"],
        "grpo_colocated": [*grpo, "--set", "generator.vllm.gpu_memory_utilization=0.3"],
        "grpo_colocated_async": [*grpo, "--set", "generator.vllm.gpu_memory_utilization=0.3", "--set", "grpo.max_staleness=1"],
        "grpo_separate": separate,
        "grpo_separate_async": [*separate, "--set", "grpo.max_staleness=1"],
    }
    jobs = {k: v for k, v in {**jobs, **two_gpus}.items() if (k in args.only if args.only else k in jobs)}
    common += [x for kv in args.set for x in ("--set", kv)]
    result: dict = {"new_tokens": args.new_tokens, "tasks_per_iteration": 8, "set": args.set}
    for name, extra in [(f"{k}-r{r}" if args.repeats > 1 else k, v) for r in range(args.repeats) for k, v in jobs.items()]:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "vrl.cli", "train", "--name", name, *common, *extra],
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            result[name] = {"error": proc.stderr[-3000:]}
            continue
        rows = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
        keys = ("loop_s", "generation_s", "verification_s", "verify_wait_s", "update_s", "save_s", "tokens",
                "tokens_per_s", "grpo/staleness/max", "time/wait_for_rollouts_s", "time/wait_for_trainer_s",
                "time/publish_wait_s", "grpo/sampling_kl")
        result[name] = {"wall_s": wall,
                        "startup_s": wall - sum(r["loop_s"] + r.get("save_s", 0.0) for r in rows),
                        "iterations": [{k: r.get(k) for k in keys} for r in rows]}
        shutil.rmtree(runs / name / "grpo", ignore_errors=True)  # GRPO checkpoints: ~21 GB each
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
