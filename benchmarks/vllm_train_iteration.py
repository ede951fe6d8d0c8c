"""Whole training iterations on the vllm backend: `vrl train` (the CLI, in a subprocess, as a user
runs it) on countdown with a Qwen2.5-1.5B-shaped model (random bf16 weights), ES and GRPO.

    python benchmarks/vllm_train_iteration.py --out result.json [--iterations 3]

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
    ap.add_argument("--only", nargs="*", help="run only these jobs (es, grpo_colocated_sleep, grpo_colocated_sleep_save_every_3)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from vllm_generation import build_model

    build_model(args.path, small=False)
    runs = Path(tempfile.mkdtemp(prefix="vrl-iter-"))
    common = ["--model", args.path, "--iterations", str(args.iterations), "--set", f"logging.runs_dir={runs}",
              "--set", "generator.backend=vllm", "--set", "generator.vllm.max_model_len=1024",
              "--set", f"sampling.max_new_tokens={args.new_tokens}", "--set", "tasks_per_iteration=8"]
    jobs = {
        "es": ["--optimizer", "es", "--set", "es.population_size=30"],
        "grpo_colocated_sleep": ["--optimizer", "grpo", "--set", "grpo.num_generations=8",
                                 "--set", "generator.vllm.sleep=true", "--set", "grpo.gradient_checkpointing=true"],
        "grpo_colocated_sleep_save_every_3": ["--optimizer", "grpo", "--set", "grpo.num_generations=8",
                                              "--set", "generator.vllm.sleep=true", "--set", "grpo.gradient_checkpointing=true",
                                              "--set", "grpo.save_every=3"],
    }
    if args.only:
        jobs = {k: v for k, v in jobs.items() if k in args.only}
    result: dict = {"new_tokens": args.new_tokens, "tasks_per_iteration": 8}
    for name, extra in jobs.items():
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "vrl.cli", "train", "--name", name, *common, *extra],
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            result[name] = {"error": proc.stderr[-3000:]}
            continue
        rows = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
        keys = ("loop_s", "generation_s", "verification_s", "verify_wait_s", "update_s", "save_s", "tokens",
                "tokens_per_s")
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
