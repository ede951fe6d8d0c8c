"""ES under torchrun on CPU ranks: where rank 0's iteration goes, with a verifier that takes time.

    python benchmarks/es_torchrun_cpu.py --out r.json
    # the same against another checkout of vrl (e.g. the code before a change), interleaved launches:
    python benchmarks/es_torchrun_cpu.py --out r.json --code new=. --code old=/tmp/vrl-old

Each launch is the real `vrl train` (built-in `letters` environment, the tiny local model, hf backend,
full-rank members) on 1 process and under `torchrun --nproc-per-node 2` (gloo), with the letters
verifier made to sleep `--verify-ms` per attempt (a Lean server or a test sandbox answering: time that
costs no CPU, so the split shows even on a loaded machine). Every rank records, per iteration, the time
its process spent in the group's `gather` (rank 0: waiting for the other rank's share, then, in code
that agrees after each update, for its θ checksum) and in `ES._agree` (since the checksums ride with
the shares, only on resuming); metrics.jsonl gives rank 0's sampling (`generation_s`, which holds the
wait for the share), its wait for the verdicts after sampling (`verify_wait_s`), the verifier's busy
time (`verification_s`) and the update (`update_s`, which holds the reading of θ's checksum).

Launches are interleaved: for each repeat, each code, 1 then 2 ranks. Reported per (code, ranks):
medians over the measured iterations (the first of each launch is dropped: start-up) of each part, and
the 2-rank / 1-rank ratio of iterations per hour. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rank_main(argv: list[str], verify_s: float, timings: Path) -> None:
    """One rank of one launch: `vrl train argv` with the verifier's cost and the timers in place."""
    import threading

    from vrl.cli import main
    from vrl.envs.letters import LettersVerifier
    from vrl.optim import es as es_module
    from vrl.optim.grpo_dist import Group

    rank = int(os.environ.get("RANK", "0"))
    spent: dict[str, float] = {"gather_share_s": 0.0, "gather_checksum_s": 0.0, "agree_s": 0.0}
    phase = threading.local()
    check, gather, agree, apply = LettersVerifier.check, Group.gather, es_module.ES._agree, es_module.ES._apply

    def slow_check(self, attempt):
        time.sleep(verify_s)
        return check(self, attempt)

    def timed_gather(self, value):
        t0 = time.perf_counter()
        try:
            return gather(self, value)
        finally:
            key = "gather_checksum_s" if getattr(phase, "agreeing", False) else "gather_share_s"
            spent[key] += time.perf_counter() - t0

    def timed_agree(self, when):
        phase.agreeing = True
        t0 = time.perf_counter()
        try:
            agree(self, when)
        finally:
            phase.agreeing = False
            spent["agree_s"] += time.perf_counter() - t0

    def recorded_apply(self, record):  # the end of an iteration on every rank: write what it spent
        apply(self, record)
        with open(timings / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"iteration": len(self.history.iterations) - 1, **spent}) + "\n")
        for k in spent:
            spent[k] = 0.0

    LettersVerifier.check, Group.gather = slow_check, timed_gather
    es_module.ES._agree, es_module.ES._apply = timed_agree, recorded_apply
    sys.argv = ["vrl", *argv]
    main()


def launch(code: Path, ranks: int, args: argparse.Namespace, work: Path) -> list[dict]:
    """One launch of `vrl train` from `code` on `ranks` processes; rank 0's rows, one per iteration."""
    work.mkdir(parents=True)
    train = ["train", "--plugin", "letters", "--optimizer", "es", "--iterations", str(args.iterations), "--name", "r",
             *[a for s in [f"logging.runs_dir={work}", f"tasks_per_iteration={args.tasks}",
                           f"es.population_size={args.members}", f"sampling.max_new_tokens={args.new_tokens}",
                           f"sampling.batch_size={args.batch_size}", "sampling.temperature=1.0"] for a in ("--set", s)]]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from es_torchrun import command

    cmd = command([str(Path(__file__).resolve()), "--rank-worker", str(args.verify_ms), "--timings", str(work), "--",
                   *train], ranks)
    path = os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=work)
    if done.returncode != 0:
        raise SystemExit(f"launch of {code} on {ranks} rank(s) failed:\n{done.stderr[-4000:]}")
    metrics = [json.loads(x) for x in (work / "r" / "metrics.jsonl").read_text().splitlines()]
    spent = {json.loads(x)["iteration"]: json.loads(x) for x in (work / "rank0.jsonl").read_text().splitlines()}
    keys = ("loop_s", "generation_s", "verify_wait_s", "verification_s", "update_s")
    return [{**{k: m[k] for k in keys}, **{k: v for k, v in spent[m["iteration"]].items() if k != "iteration"},
             "iteration": m["iteration"]} for m in metrics]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--code", action="append", help="NAME=PATH of a vrl checkout to measure (default: this one)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--verify-ms", type=float, default=20.0, help="the verifier's sleep per attempt")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=4, help="per launch; the first is dropped")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--rank-worker", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--timings", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker is not None:
        rank_main(args.rest[1:] if args.rest[:1] == ["--"] else args.rest, args.rank_worker / 1000, Path(args.timings))
        return
    if not args.out:
        ap.error("--out is required")
    codes = dict(c.split("=", 1) for c in args.code or [f"this={Path(__file__).resolve().parents[1]}"])
    res: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("rank_worker", "timings", "rest")},
                 "loadavg_start": os.getloadavg(), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name, path in codes.items():
                for ranks in args.ranks:
                    rows = launch(Path(path).resolve(), ranks, args, Path(tmp) / f"{rep}-{name}-{ranks}")
                    res["rows"] += [{"repeat": rep, "code": name, "ranks": ranks, **r} for r in rows if r["iteration"] > 0]
                    print(json.dumps({"repeat": rep, "code": name, "ranks": ranks,
                                      "loop_s": statistics.median(r["loop_s"] for r in rows[1:])}), flush=True)
    res["loadavg_end"] = os.getloadavg()
    summary = {}
    for name in codes:
        base = None
        for ranks in args.ranks:
            rows = [r for r in res["rows"] if (r["code"], r["ranks"]) == (name, ranks)]
            parts = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_s")}
            base = base or parts["loop_s"]
            summary[f"{name},ranks={ranks}"] = {**parts, "vs_first_ranks": base / parts["loop_s"], "iterations": len(rows)}
    res["summary"] = summary
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
