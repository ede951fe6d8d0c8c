"""Asynchronous GRPO rollouts: iterations per hour with grpo.max_staleness 0 (synchronous) vs 1 (generate and
verify iteration k+1 while training on k), with a verifier as slow as generation and with an instant one.

    python benchmarks/grpo_async.py --out result.json [--iterations 8] [--repeats 3] [--model tiny]
        [--backend hf] [--tasks 4] [--generations 8] [--new-tokens 32] [--env letters|countdown]
        [--bench-model PATH] [--set KEY=VALUE ...]

The real `Trainer` runs in this process on the chosen environment; its verifier is wrapped so each verify
call (one per `verifier.batch_size` attempts, one at a time) first sleeps a fixed delay. A calibration run
(synchronous, instant verifier) measures the median generation time per iteration, and the delay is set
so that an iteration's verification takes that long: a delay-padded verifier standing in for Lean's
seconds per batch. Jobs (`verifier` × `max_staleness`) run interleaved `--repeats` times; each job's
iterations per hour is (iterations − 1) / (time of the last row − time of the first) · 3600 (the first
iteration, which has nothing to overlap with, is left out); the report gives the medians and the ratio.
On the CPU machine use the defaults (vrl's tiny model, hf backend). On one GPU, once the vLLM host
implements `decouple` (docs/grpo.md), the issue's setting is::

    python benchmarks/grpo_async.py --out grpo_async_h100.json --bench-model /tmp/vrl-bench-model \
        --backend vllm --env countdown --tasks 64 --generations 8 --new-tokens 1024 --verify-batch 64 \
        --set generator.vllm.max_model_len=1280 --set grpo.gradient_checkpointing=true

(`--bench-model` writes a Qwen2.5-1.5B-shaped model with random bf16 weights there, as the other GPU
benchmarks do; `--set` passes any config field). On two GPUs the jobs can be split over two processes
sharing one calibration (the synchronous instant-verifier run, which is also instant/0's first repeat):
`--jobs instant/0 slow/0 --calibration c.json` on one GPU, `--jobs instant/1 slow/1 --calibration c.json`
on the other (its slow job waits for c.json).
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from vrl.config import build, merge, parse_override
from vrl.plugins import registry
from vrl.trainer import Trainer


class Delayed:
    """A verifier whose every `verify` call first sleeps `delay` seconds, then judges as `real` does."""

    def __init__(self, real, delay: float):
        self.real, self.delay = real, delay

    async def verify(self, attempts):
        await asyncio.sleep(self.delay)
        return await self.real.verify(attempts)

    def __getattr__(self, name):  # check_ready, aclose, check, ...: the real verifier's
        return getattr(self.real, name)


def delayed(env, delay: float):
    """`env` with its verifier wrapped in `Delayed`."""
    verifier_of = env.verifier
    env.verifier = lambda: Delayed(verifier_of(), delay)
    return env


def run(args, runs: Path, name: str, staleness: int, delay: float) -> list[dict]:
    layer = {
        "plugin": args.env, "optimizer": "grpo", "model": args.model, "iterations": args.iterations,
        "tasks_per_iteration": args.tasks,
        "sampling": {"max_new_tokens": args.new_tokens, "temperature": 1.0, "batch_size": args.tasks},
        "generator": {"backend": args.backend},
        "verifier": {"batch_size": args.verify_batch, "concurrency": 1},
        "grpo": {"num_generations": args.generations, "learning_rate": 1e-5, "micro_batch_size": args.generations,
                 "max_staleness": staleness},
        "logging": {"runs_dir": str(runs), "name": name},
    }
    for item in args.set:
        layer = merge(layer, parse_override(item))
    env = delayed(registry().environment(args.env), delay)
    trainer = Trainer(build(layer), environment=env, console=Console(file=io.StringIO()))
    summary = trainer.run()
    if summary["status"] != "finished":
        raise RuntimeError(f"{name}: {summary}")
    return trainer.run_dir.metrics()


JOBS = ("slow/0", "slow/1", "instant/0", "instant/1")  # verifier / max_staleness
ROW_KEYS = ("iteration", "time", "generation_s", "verification_s", "update_s", "loop_s", "grpo/staleness/max",
            "grpo/sampling_kl", "time/wait_for_rollouts_s", "time/wait_for_trainer_s", "time/publish_wait_s")


def per_hour(rows: list[dict]) -> float:
    return (len(rows) - 1) / (rows[-1]["time"] - rows[0]["time"]) * 3600


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--backend", default="hf")
    ap.add_argument("--env", default="letters")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--verify-batch", type=int, default=8, help="attempts per verify call")
    ap.add_argument("--bench-model", metavar="PATH", help="write a Qwen2.5-1.5B-shaped random model here and use it")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config field, as `vrl train`")
    ap.add_argument("--jobs", nargs="+", default=list(JOBS), choices=JOBS,
                    help="run these jobs only (to split them over GPUs: see --calibration)")
    ap.add_argument("--calibration", metavar="PATH",
                    help="share the calibration between processes: read generation_s from this JSON (waiting for it "
                         "to appear), or, with instant/0 among --jobs, write it there from that run")
    args = ap.parse_args()
    if args.bench_model:
        sys.path.insert(0, str(Path(__file__).parent))
        from vllm_generation import build_model

        build_model(args.bench_model, small=False)
        args.model = args.bench_model
    runs = Path(tempfile.mkdtemp(prefix="vrl-async-"))
    calls = -(-args.tasks * args.generations // args.verify_batch)
    jobs = {job: [] for job in args.jobs}  # in the order given
    result = {"args": vars(args), "verify_calls": calls, "runs": {}}
    first = None
    if not args.calibration or "instant/0" in jobs:  # calibrate here: a synchronous run, instant verifier
        first = run(args, runs, "calibration", 0, 0.0)  # also instant/0's first repeat
        result["generation_s"] = statistics.median(r["generation_s"] for r in first[1:])
        if args.calibration:
            Path(args.calibration).write_text(json.dumps({"generation_s": result["generation_s"]}))

    def delay() -> float:
        """Each verify call's sleep: the calibration's generation time over the calls (waits for another
        process's calibration the first time a slow job needs it)."""
        if "generation_s" not in result:
            path = Path(args.calibration)
            while not path.exists():
                time.sleep(1)
            result["generation_s"] = json.loads(path.read_text())["generation_s"]
        result["delay_s"] = result["generation_s"] / calls
        return result["delay_s"]

    for repeat in range(args.repeats):
        for job, rates in jobs.items():  # interleaved: a slow minute of the machine hits every job
            verifier, staleness = job.split("/")
            if job == "instant/0" and repeat == 0 and first is not None:
                rows = first  # the calibration run is this job's first repeat
            else:
                rows = run(args, runs, f"{verifier}-{staleness}-{repeat}", int(staleness),
                           delay() if verifier == "slow" else 0.0)
            rates.append(per_hour(rows))
            print(f"repeat {repeat} verifier {verifier} max_staleness {staleness}: {rates[-1]:.0f} it/h "
                  f"(generation {statistics.median(r['generation_s'] for r in rows):.3f} s, update "
                  f"{statistics.median(r['update_s'] for r in rows):.3f} s)", flush=True)
            result["runs"][job] = {"iterations_per_hour": rates, "median": statistics.median(rates),
                                   "rows": [{k: r.get(k) for k in ROW_KEYS} for r in rows]}
            Path(args.out).write_text(json.dumps(result, indent=2))  # a run cut short keeps what finished
    for verifier in ("slow", "instant"):
        if f"{verifier}/0" not in result["runs"] or f"{verifier}/1" not in result["runs"]:
            continue  # the other half ran in another process: compare the two outputs
        ratio = result["runs"][f"{verifier}/1"]["median"] / result["runs"][f"{verifier}/0"]["median"]
        result[f"speedup_{verifier}"] = ratio
        print(f"verifier {verifier}: max_staleness 1 / 0 = {ratio:.2f}x "
              f"({result['runs'][f'{verifier}/0']['median']:.0f} -> {result['runs'][f'{verifier}/1']['median']:.0f} it/h)")
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
