"""GRPO checkpoint overhead: the share of a run's wall time spent on checkpoints, `vrl train` as a user
runs it (a subprocess) on countdown with a Qwen2.5-1.5B-shaped model (random bf16 weights) on vllm.

    python benchmarks/grpo_checkpoint_overhead.py --out result.json [--iterations 20] [--repeats 3]
        [--only default every_iteration_sync] [--small]

Jobs, run interleaved `--repeats` times:
- `default`: the default cadence (grpo.save_interval_s=600, no count cadence, grpo.save_last=auto: the
  policy alone after the last iteration for a model this size), written in the background;
- `last_full`: as `default`, with a whole checkpoint after the last iteration (grpo.save_last=full);
- `every_iteration_async`: grpo.save_every=1, in the background;
- `every_iteration_sync`: grpo.save_every=1, grpo.async_save=false (the old default: the loop waits).

Checkpoint time = Σ `save_s` (what each iteration waited for: the copy to host memory, or the whole
write when synchronous) + `checkpoint_wait_s` (the run's wait, at its end, for the last checkpoint
being written). Reported per job with its share of the run's wall time (the goal: under 5% with the
defaults), the medians over repeats, and the size of a checkpoint. `--small` uses vrl's tiny model
(a CPU smoke run with the hf backend). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOBS = {
    "default": [],
    "last_full": ["--set", "grpo.save_last=full"],
    "every_iteration_async": ["--set", "grpo.save_every=1"],
    "every_iteration_sync": ["--set", "grpo.save_every=1", "--set", "grpo.async_save=false"],
}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--path", default="/tmp/vrl-bench-model")
    ap.add_argument("--small", action="store_true", help="vrl's tiny model on the hf backend (a CPU smoke run)")
    ap.add_argument("--only", nargs="*", choices=sorted(JOBS), help="run only these jobs")
    args = ap.parse_args()
    model = "tiny"  # vrl's built-in tiny model: a CPU smoke run
    if not args.small:
        sys.path.insert(0, str(Path(__file__).parent))
        from vllm_generation import build_model

        build_model(args.path, small=False)
        model = args.path
    runs = Path(tempfile.mkdtemp(prefix="vrl-ckpt-"))
    common = ["--optimizer", "grpo", "--model", model, "--iterations", str(args.iterations),
              "--set", f"logging.runs_dir={runs}", "--set", f"sampling.max_new_tokens={args.new_tokens}",
              "--set", "tasks_per_iteration=8", "--set", "grpo.num_generations=8"]
    if not args.small:
        common += ["--set", "generator.backend=vllm", "--set", "generator.vllm.max_model_len=1024",
                   "--set", "generator.vllm.sleep=true", "--set", "grpo.gradient_checkpointing=true"]
    jobs = {k: v for k, v in JOBS.items() if not args.only or k in args.only}
    result: dict = {"iterations": args.iterations, "new_tokens": args.new_tokens, "small": args.small,
                    "runs": {k: [] for k in jobs}}
    for repeat in range(args.repeats):
        for name, extra in jobs.items():  # interleaved: a slow minute of the machine hits every job
            run = f"{name}-{repeat}"
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "vrl.cli", "train", "--name", run, *common, *extra],
                                  capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode:
                result["runs"][name].append({"error": proc.stderr[-3000:]})
                continue
            rows = [json.loads(line) for line in (runs / run / "metrics.jsonl").read_text().splitlines()]
            summary = json.loads((runs / run / "summary.json").read_text())
            saves = sum(r["save_s"] for r in rows)
            waited = summary.get("checkpoint_wait_s", 0.0)
            kept = sorted((runs / run / "grpo").iterdir())
            result["runs"][name].append({
                "wall_s": wall, "loop_s": sum(r["loop_s"] for r in rows), "save_s": saves,
                "checkpoint_wait_s": waited, "checkpoint_share": (saves + waited) / wall,
                "checkpoint_bytes": _size(kept[-1]), "checkpoints": [p.name for p in kept],
            })
            shutil.rmtree(runs / run / "grpo", ignore_errors=True)  # ~21 GB each on the full model
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    result["median_checkpoint_share"] = {
        name: statistics.median(r["checkpoint_share"] for r in rs if "error" not in r)
        for name, rs in result["runs"].items() if any("error" not in r for r in rs)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
