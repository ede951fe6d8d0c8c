"""Dynamic sampling and the pass-rate curriculum on the CPU: generation tokens to reach a pass rate of 0.5 on
the sometimes-solved tasks of `letters -o mix=true` (issue 58 item 6).

    python benchmarks/curriculum_letters.py --out result.json [--seeds 0 1 2 3 4 5 6] [--arms ...]
        [--size 16] [--tasks 4] [--grpo-iterations 60] [--es-iterations 60] [--window 32] [--target 0.5]

`letters -o mix=true` (vrl/envs/letters.py) is a stand-in for a prover's data under a binary reward: of
every 4 tasks one is sometimes solved (learnable: at least 1/8 of the characters in a-p), one always and
two never, whatever the model writes. The real `Trainer` runs each arm in this process on vrl's tiny random
model (hf backend), `tasks_per_iteration` tasks per iteration, the environment's suggested steps
(`vrl.envs.TINY_MODEL_STEPS`: GRPO G=8 at lr 1e-2; ES N=16, sigma 0.2 on lm_head), 16 new tokens:

- grpo/baseline: every drawn group trains;
- grpo/filter: `grpo.filter_groups=true`, `gen_batch_multiplier=2`, `max_num_gen_batches=4`,
  `filter_groups_exhausted=train` (an iteration that finds fewer than `tasks_per_iteration` informative
  groups in 4 batches trains on those found);
- grpo/curriculum: `curriculum.kind=pass_rate` with its defaults (band 0-1, 2 observations, EMA, 5 %
  re-admission);
- grpo/both: the two together;
- es/baseline and es/curriculum: ES, without and with the curriculum (ES has no group filter).

The figure, per run: the generation tokens (every completion token sampled, kept or discarded:
metrics.jsonl's `tokens`, summed) up to the first iteration at which the sometimes-solved tasks pass at
`--target` or more, their attempts pooled over the latest iterations that hold at least `--window` of them
(`letters/sometimes_attempts` / `_passed`); beside it the updates (iterations) and the wall time (the
iterations' `loop_s`, summed: generation, verification, update). Token counts do not depend on the
machine's load; the load average is recorded around every run. A run that never gets there within its
iterations counts as not reached. A run that stops early
because an iteration found nothing informative (the filter at its bound with no group found) or nothing
left to draw (every task retired) ends there, with the error recorded (`stopped`). Arms run interleaved per seed. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console

import vrl
from vrl.config import merge, parse_override
from vrl.errors import UsageError
from vrl.trainer import Trainer

FILTER = {"filter_groups": True, "gen_batch_multiplier": 2.0, "max_num_gen_batches": 4,
          "filter_groups_exhausted": "train"}
CURRICULUM = {"kind": "pass_rate"}
ARMS = {
    "grpo/baseline": ("grpo", {}, {}),
    "grpo/filter": ("grpo", FILTER, {}),
    "grpo/curriculum": ("grpo", {}, CURRICULUM),
    "grpo/both": ("grpo", FILTER, CURRICULUM),
    "es/baseline": ("es", {}, {}),
    "es/curriculum": ("es", {}, CURRICULUM),
}
ROW_KEYS = ("iteration", "tokens", "tokens_discarded", "loop_s", "pass_rate", "letters/sometimes_attempts",
            "letters/sometimes_passed", "filter/gen_batches", "filter/informative_frac", "filter/trained_groups",
            "filter/exhausted", "grpo/frac_reward_zero_std", "curriculum/active", "curriculum/retired_low",
            "curriculum/retired_high", "curriculum/readmitted")


def run(args, runs: Path, arm: str, seed: int) -> tuple[list[dict], str | None]:
    optimizer, section, curriculum = ARMS[arm]
    fields = {
        "plugin": "letters", "env_options": {"mix": True, "size": args.size}, "optimizer": optimizer, "seed": seed,
        "iterations": args.grpo_iterations if optimizer == "grpo" else args.es_iterations,
        "tasks_per_iteration": args.tasks,
        "logging": {"runs_dir": str(runs), "name": f"{arm.replace('/', '-')}-{seed}"},
    }
    if section:
        fields[optimizer] = section
    if curriculum:
        fields["curriculum"] = curriculum
    for item in args.set:
        fields = merge(fields, parse_override(item))
    trainer = Trainer(vrl.TrainConfig(**fields), console=Console(file=io.StringIO()))
    try:
        summary = trainer.run()
    except UsageError as err:  # nothing informative (or nothing active) left to draw: the run ends there
        return trainer.run_dir.metrics(), str(err)
    if summary["status"] != "finished":
        raise RuntimeError(f"{arm} seed {seed}: {summary}")
    return trainer.run_dir.metrics(), None


def reached(rows: list[dict], window: int, target: float) -> dict | None:
    """The first iteration whose pooled sometimes-solved pass rate (the latest iterations holding at least
    `window` attempts) is at least `target`: its index, the tokens and wall time up to it, the updates."""
    tokens = wall = 0.0
    for i, row in enumerate(rows):
        tokens += row["tokens"]
        wall += row["loop_s"]
        attempts = passed = 0.0
        for back in reversed(rows[: i + 1]):
            attempts += back.get("letters/sometimes_attempts", 0.0)
            passed += back.get("letters/sometimes_passed", 0.0)
            if attempts >= window:
                break
        if attempts >= window and passed / attempts >= target:
            return {"iteration": row["iteration"], "updates": i + 1, "tokens": tokens, "wall_s": wall,
                    "pass_rate": passed / attempts, "attempts_pooled": attempts}
    return None


def columns(rows: list[dict]) -> dict[str, list]:
    """The runs' metrics worth keeping (`ROW_KEYS`), one list per key over the iterations (None where an
    iteration has no such entry), floats to 4 decimals: the JSON stays small."""
    return {k: [round(r[k], 4) if isinstance(r.get(k), float) else r.get(k) for r in rows]
            for k in ROW_KEYS if any(k in r for r in rows)}


def write(path: str, result: dict) -> None:
    """`result` as indented JSON with every list of numbers on one line."""
    text = json.dumps(result, indent=2)
    text = re.sub(r"\[\s+([-0-9.eE+, \nnul]+?)\s+\]", lambda m: "[" + ", ".join(
        x.strip() for x in m.group(1).split(",")) + "]", text)
    Path(path).write_text(text + "\n")


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def summarize(result: dict) -> None:
    """Per arm: how many runs reached the target, and the median and range over seeds of the tokens, updates and
    wall time to it; `tokens_vs_baseline`: each seed's tokens over its baseline's (the same rule, the same seed).
    Printed, and set in `result`."""
    summary = {}
    for arm, entries in result["runs"].items():
        hits = [e["reached"] for e in entries if e["reached"]]
        base = {e["seed"]: e["reached"] for e in result["runs"].get(f"{arm.split('/')[0]}/baseline", [])}
        paired = [e["reached"]["tokens"] / base[e["seed"]]["tokens"] for e in entries
                  if e["reached"] and base.get(e["seed"])]
        summary[arm] = {"reached": f"{len(hits)}/{len(entries)}",
                        "tokens": spread([h["tokens"] for h in hits]),
                        "updates": spread([h["updates"] for h in hits]),
                        "wall_s": spread([h["wall_s"] for h in hits]),
                        "tokens_vs_baseline": spread(paired)}
        t, v = summary[arm]["tokens"], summary[arm]["tokens_vs_baseline"]
        print(f"{arm:16s} reached {summary[arm]['reached']}: tokens median {t.get('median', float('nan')):.0f} "
              f"({t.get('min', float('nan')):.0f}-{t.get('max', float('nan')):.0f}), "
              f"x{v.get('median', float('nan')):.2f} the baseline ({v.get('min', float('nan')):.2f}-"
              f"{v.get('max', float('nan')):.2f}), updates {summary[arm]['updates'].get('median', float('nan'))}, "
              f"wall {summary[arm]['wall_s'].get('median', float('nan')):.1f} s")
    result["summary"] = summary
    result["load_range"] = [min(e["load_before"] for es in result["runs"].values() for e in es),
                            max(e["load_after"] for es in result["runs"].values() for e in es)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5, 6])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--size", type=int, default=16, help="tasks in the split (-o size)")
    ap.add_argument("--tasks", type=int, default=4, help="tasks_per_iteration")
    ap.add_argument("--grpo-iterations", type=int, default=60)
    ap.add_argument("--es-iterations", type=int, default=60)
    ap.add_argument("--window", type=int, default=32, help="sometimes-solved attempts pooled for the pass rate")
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any config field, as `vrl train` (every arm)")
    ap.add_argument("--summarize", action="store_true",
                    help="only recompute the summary of the runs already in --out (and write it back)")
    args = ap.parse_args()
    if args.summarize:
        result = json.loads(Path(args.out).read_text())
        summarize(result)
        write(args.out, result)
        return
    runs = Path(tempfile.mkdtemp(prefix="vrl-curriculum-"))
    result: dict = {"args": vars(args), "cpus": os.cpu_count(), "runs": {arm: [] for arm in args.arms}}
    for seed in args.seeds:
        for arm in args.arms:  # interleaved: a slow minute of the machine hits every arm
            load_before, start = os.getloadavg()[0], time.perf_counter()
            rows, stopped = run(args, runs, arm, seed)
            hit = reached(rows, args.window, args.target)
            entry = {"seed": seed, "reached": hit, "iterations": len(rows), "stopped": stopped,
                     "tokens_total": sum(r["tokens"] for r in rows), "run_s": time.perf_counter() - start,
                     "load_before": load_before, "load_after": os.getloadavg()[0],
                     "rows": columns(rows)}
            result["runs"][arm].append(entry)
            said = (f"tokens {hit['tokens']:.0f}, {hit['updates']} updates, {hit['wall_s']:.1f} s" if hit
                    else f"not reached in {len(rows)} iterations")
            print(f"seed {seed} {arm}: {said} (load {load_before:.1f})", flush=True)
            write(args.out, result)  # a run cut short keeps what finished
    summarize(result)
    write(args.out, result)


if __name__ == "__main__":
    main()
