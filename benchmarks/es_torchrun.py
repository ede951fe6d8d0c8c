"""ES under torchrun: iterations per hour with 1 rank against K ranks (one engine each), full-rank and low-rank.

    # 2 GPUs, vLLM, Qwen2.5-0.5B shapes with random bf16 weights (a few minutes, most of it engine start-up)
    python benchmarks/es_torchrun.py --backend vllm --ranks 1 2 --out es_torchrun_2gpu.json
    # CPU dry run of the whole script: a 2-layer model, the hf backend, 2 ranks over gloo
    python benchmarks/es_torchrun.py --backend hf --small --ranks 1 2 --members 4 --tasks 2 4 \
        --new-tokens 8 --iterations 2 --out /tmp/r.json

For each noise mode (`--noise`) and rank count (`--ranks`), one launch: 1 rank is this script as one
process (`--torchrun-one`: torchrun with one process and OMP_NUM_THREADS=1, which torchrun sets for
K > 1 ranks only, so that both counts run in the same environment), K ranks is `torchrun --standalone --nproc-per-node K` of it.
Rank 0 builds its engine as `vrl train` does (the local runtime) and the other ranks run `vrl.launch.follow`, the real follower of a
`vrl train` launch; rank 0 then drives ES itself: per iteration `ask`, the members dealt over the ranks
and sampled (`ES.sampler`: `RankHosts`), made-up rewards, `tell` (every rank applies the update and the
ranks compare θ checksums). Inside one launch the task counts (`--tasks`) take turns for
`--iterations` rounds after a warm-up iteration of each; launches go interleaved over `--repeats`
(noise mode, then rank count). The rewards are made up, so this is the loop's GPU side, as
benchmarks/es_engines.py measures it on one host; but as in `vrl train`, every rank verifies what it
samples (the other ranks in `vrl.launch.follow`, rank 0 while it samples, in a verification pool of
the same verifier: countdown's, which refuses these random completions in microseconds).

Reported per (noise, tasks, ranks): median loop seconds (sampling and verification + update), of which rank 0's
own share of the sampling (`own_s`; the rest of `sample_s` is the wait for the other ranks' shares), iterations per hour
(3600 / loop), and the ratio to the first rank count's iterations per hour in the same run (goal ≥ 1.9
at 2 ranks; issue 44). Prompts are 64 random letters through the byte tokenizer; a random model never
stops, so every completion runs to `--new-tokens`. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def config(args: argparse.Namespace, noise: str) -> dict:
    """The `vrl train` config of every rank (as a dict for `vrl.config.build`)."""
    es = {"population_size": args.members, "noise": noise, "sigma": 1e-3}
    if noise == "lowrank":
        es.update(rank=args.rank, exclude=["lm_head*"])  # vLLM's LoRA path does not serve lm_head
    generator: dict = {"backend": args.backend}
    if args.backend == "vllm":
        generator["vllm"] = {"gpu_memory_utilization": args.memory, "max_model_len": 1024, "enforce_eager": args.eager}
    return {"model": args.path, "optimizer": "es", "seed": 1, "es": es, "generator": generator,
            "sampling": {"temperature": 1.0, "max_new_tokens": args.new_tokens, "batch_size": args.batch_size}}


def rank_main(args: argparse.Namespace) -> None:
    """One rank of one launch (under torchrun, or alone for 1 rank): rank 0 measures, the others follow."""
    from vrl import distributed, launch
    from vrl.config import build

    cfg = build(config(args, args.noise))
    if args.no_specialize:  # vLLM's default LoRA kernel grids: blocks for every slot, active or not
        import vrl.generate.vllm as vg

        plain_kwargs = vg.engine_kwargs
        vg.engine_kwargs = lambda *a, **k: {**plain_kwargs(*a, **k), "specialize_active_lora": False}
    if distributed.rank() > 0:
        launch.follow(cfg)
        return
    from vrl.optim import make_optimizer
    from vrl.plugins import registry
    from vrl.runtime.local import LocalRuntime
    from vrl.types import Attempt, Result, Task, Verdict, Verified

    distributed.start()
    t0 = time.perf_counter()
    es = make_optimizer(cfg)
    host = LocalRuntime().policy(cfg, es.needs())
    es.setup(host)
    sampler = es.sampler(host)
    own = {"s": 0.0}  # rank 0's sampling of its own share, per iteration (with K ranks; 1 rank: all of it)
    if sampler is not host:
        plain = host.sample

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                yield from plain(*a, **k)
            finally:
                own["s"] += time.perf_counter() - t

        host.sample = timed
    runtime = LocalRuntime()
    pool = runtime.verification(registry().environment(cfg.plugin).verifier(), cfg)
    startup = time.perf_counter() - t0
    rng = random.Random(0)
    tasks = [Task(id=f"p{i}", prompt="".join(rng.choice(string.ascii_letters + " ") for _ in range(64)))
             for i in range(max(args.tasks))]
    by_id = {t.id: t for t in tasks}
    runs = []

    def iteration(n_tasks: int) -> dict:
        variants = es.ask()
        own["s"] = 0.0
        t0 = time.perf_counter()
        done, pending = [], []
        for batch in sampler.sample(tasks[:n_tasks], variants, seed=7):  # rank 0 verifies its own batches
            done += batch
            pending += pool.submit([Attempt(task=by_id[c.task_id], completion=c) for c in batch],
                                   batch if isinstance(batch, Verified) else None)
        for _, verdicts in pending:
            verdicts.result()
        sample_s = time.perf_counter() - t0
        rewards = random.Random(len(es.history.iterations))
        results = [Result(task=by_id[c.task_id], completion=c, verdict=Verdict.ok(), reward=rewards.random())
                   for c in done]
        t1 = time.perf_counter()
        es.tell(results)  # made-up rewards: θ moves at random; every rank applies it, then the checksums
        update_s = time.perf_counter() - t1
        # own_s: rank 0's own share; sample_s - own_s: waiting for the other ranks' shares (and the verifier's tail)
        return {"tasks": n_tasks, "sample_s": sample_s, "own_s": own["s"] if sampler is not host else sample_s,
                "update_s": update_s, "loop_s": sample_s + update_s,
                "completions": len(done), "tokens": sum(c.completion_tokens for c in done)}

    try:
        for n in args.tasks:  # warm-up (CUDA graphs, LoRA slots, allocator)
            iteration(n)
        for rep in range(args.iterations):
            for n in args.tasks:
                runs.append({"round": rep, **iteration(n)})
    finally:
        es.close()  # releases the other ranks
        sampler.close()
        pool.close()
    # torchrun sets OMP_NUM_THREADS=1 for its ranks (their engines inherit it); one plain process does not.
    Path(args.result).write_text(json.dumps({"startup_s": startup, "runs": runs, "lora_slots": es.needs().variants,
                                             "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}))


def command(own: list[str], ranks: int, torchrun_one: bool = False) -> list[str]:
    """A script's arguments `own` as one process (1 rank, unless `torchrun_one`), or under torchrun on
    `ranks` processes of this node, meeting on a free port (two launches on one machine must not meet)."""
    if ranks == 1 and not torchrun_one:
        return [sys.executable, *own]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", *own]


def launch_once(args: argparse.Namespace, noise: str, ranks: int, result: Path) -> subprocess.CompletedProcess:
    """One launch of `rank_main` on `ranks` processes; returns it (rank 0 wrote `result`)."""
    cmd = command([str(Path(__file__).resolve()), *sys.argv[1:], "--rank-worker", noise, "--result", str(result)], ranks,
                  args.torchrun_one)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    if args.backend == "hf" or args.torchrun_one:  # torchrun sets it for K > 1 ranks only, not for one
        env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--noise", nargs="+", default=["full", "lowrank"], choices=["full", "lowrank"])
    ap.add_argument("--tasks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--members", type=int, default=30)
    ap.add_argument("--rank", type=int, default=8, help="es.rank of low-rank members")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32, help="sampling.batch_size")
    ap.add_argument("--iterations", type=int, default=3, help="measured rounds per launch (each task count once)")
    ap.add_argument("--repeats", type=int, default=1, help="launches of each (noise, ranks), interleaved")
    ap.add_argument("--memory", type=float, default=0.5, help="generator.vllm.gpu_memory_utilization")
    ap.add_argument("--eager", action="store_true", help="enforce_eager engines (fast start, slow decode)")
    ap.add_argument("--small", action="store_true", help="a 2-layer model, for a quick check")
    ap.add_argument("--path", default="/tmp/vrl-bench-model-0.5b")
    ap.add_argument("--timeout", type=int, default=900, help="seconds one launch may take")
    ap.add_argument("--torchrun-one", action="store_true",
                    help="launch 1 rank under torchrun too (--nproc-per-node 1) with OMP_NUM_THREADS=1, so every rank "
                    "count runs in the environment torchrun gives K > 1 ranks (their engines inherit it; torchrun "
                    "itself sets it only for K > 1)")
    ap.add_argument("--no-specialize", action="store_true",
                    help="start low-rank engines without vLLM's specialize_active_lora (vrl turns it on: CUDA graphs "
                    "per count of active adapters, so the LoRA kernels launch blocks for the active ones alone)")
    ap.add_argument("--rank-worker", help=argparse.SUPPRESS)  # the noise mode of the launch this rank is part of
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker:
        args.noise = args.rank_worker
        rank_main(args)
        return
    sys.path.insert(0, str(HERE))
    from vllm_generation import build_model

    build_model(args.path, args.small, shape="0.5b")
    import torch

    res: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                 "gpus": torch.cuda.device_count(), "backend": args.backend, "members": args.members,
                 "new_tokens": args.new_tokens, "small": args.small, "shape": "2-layer" if args.small else "Qwen2.5-0.5B",
                 "tasks": args.tasks, "ranks": args.ranks, "torchrun_one": args.torchrun_one, "specialize": not args.no_specialize,
                 "launches": [], "runs": [],
                 # vLLM's LoRA kernel configs (benchmarks/lowrank_profile.py --configs-out), when set
                 "vllm_tuned_config_folder": os.environ.get("VLLM_TUNED_CONFIG_FOLDER")}

    def save() -> None:
        Path(args.out).write_text(json.dumps(res, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for noise in args.noise:
                for ranks in args.ranks:
                    result = Path(tmp) / f"{noise}-{ranks}-{rep}.json"
                    t0 = time.perf_counter()
                    done = launch_once(args, noise, ranks, result)
                    launch = {"repeat": rep, "noise": noise, "ranks": ranks, "rc": done.returncode,
                              "wall_s": time.perf_counter() - t0}
                    if done.returncode != 0 or not result.exists():
                        launch["stderr_tail"] = done.stderr[-4000:]
                    else:
                        measured = json.loads(result.read_text())
                        launch["startup_s"] = measured["startup_s"]
                        launch["omp_num_threads"] = measured.get("omp_num_threads")
                        launch["lora_slots"] = measured.get("lora_slots")  # per engine (low-rank); full-rank: unused
                        res["runs"] += [{"repeat": rep, "noise": noise, "ranks": ranks, **r} for r in measured["runs"]]
                    res["launches"].append(launch)
                    print(json.dumps({k: v for k, v in launch.items() if k != "stderr_tail"}), flush=True)
                    save()
    summary = {}
    for noise in args.noise:
        for n in args.tasks:
            base = None
            for ranks in args.ranks:
                rows = [r for r in res["runs"] if (r["noise"], r["tasks"], r["ranks"]) == (noise, n, ranks)]
                loops = [r["loop_s"] for r in rows]
                if not loops:
                    continue
                loop = statistics.median(loops)
                per_hour = 3600 / loop
                base = per_hour if base is None else base
                summary[f"noise={noise},tasks={n},ranks={ranks}"] = {
                    "loop_s": loop, "iterations_per_hour": per_hour, "vs_first_ranks": per_hour / base,
                    "sample_s": statistics.median(r["sample_s"] for r in rows),
                    "own_s": statistics.median(r.get("own_s", r["sample_s"]) for r in rows),
                    "update_s": statistics.median(r["update_s"] for r in rows),
                    "samples": len(loops)}
    res["summary"] = summary
    save()
    print(json.dumps(summary, indent=1))
    failed = [x for x in res["launches"] if x["rc"] != 0]
    if failed:
        sys.exit(f"{len(failed)} launch(es) failed; their stderr tails are in {args.out}")


if __name__ == "__main__":
    main()
