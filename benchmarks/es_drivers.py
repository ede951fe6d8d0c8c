"""ES iterations per second of a pool of engines driven in this process vs from driver processes.

    python benchmarks/es_drivers.py --out result.json [--gpus 0 1] [--engines 2] [--noise lowrank]
                                    [--tasks 8 64] [--members 30] [--repeats 3] [--small]
    python benchmarks/es_drivers.py --out cpu.json --backend hf --model tiny --tasks 4 --members 4 \\
                                    --new-tokens 8 --repeats 2        # the CPU check of the script

One ES iteration is what `vrl train` does without verification: `host.sample(tasks, N members)`, then
`ES.tell` on made-up rewards (the update on every engine). Each configuration (noise mode, pool size,
`runtime.local.driver_processes` off or on) is started once before anything is timed; the
configurations are interleaved over `--repeats` rounds and medians reported, with iterations per
second (`it_s` = 1 / (sampling + update), `es_engines.iteration`) and, per pool, the ratio of driver processes to in-process
(`drivers_vs_in_process`) and to one in-process engine (`vs_one_engine`, when `--engines` lists 1).

vllm (default): Qwen2.5-1.5B shapes with random bf16 weights (`vllm_generation.build_model`), prompts of
64 random printable characters, every completion runs to `--new-tokens`; engines are dealt over
`--gpus`, one per GPU (driver processes need one engine per GPU). hf: `--model tiny` runs on CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import string
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--model", default=None, help="a model path or 'tiny' (default: build Qwen2.5-1.5B shapes at --path)")
    ap.add_argument("--members", type=int, default=30)
    ap.add_argument("--noise", nargs="+", default=["lowrank"], choices=["full", "lowrank"])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--tasks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--gpus", type=int, nargs="+", default=None, help="default: 0..max(--engines)-1 (vllm)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory", type=float, default=None,
                    help="generator.vllm.gpu_memory_utilization of each engine (default: 0.85 split over the engines "
                    "that share the busiest GPU: every configuration stays started)")
    ap.add_argument("--small", action="store_true", help="a 2-layer model, for a quick check")
    ap.add_argument("--path", default="/tmp/vrl-bench-model")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sys.path.insert(0, str(Path(__file__).parent))

    from es_engines import iteration

    from vrl.config import build
    from vrl.optim.es import ES
    from vrl.runtime.local import LocalRuntime
    from vrl.types import Task

    res: dict = {"backend": args.backend, "members": args.members, "new_tokens": args.new_tokens, "rank": args.rank,
                 "small": args.small, "runs": []}
    if args.backend == "vllm":
        import torch
        import vllm

        res.update(device=torch.cuda.get_device_name(), gpus_present=torch.cuda.device_count(), vllm=vllm.__version__)
    model = args.model
    if model is None:
        from vllm_generation import build_model

        build_model(args.path, args.small)
        model = args.path

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    rng = random.Random(0)
    tasks = [Task(id=f"p{i}", prompt="".join(rng.choice(string.ascii_letters + " ") for _ in range(64)))
             for i in range(max(args.tasks))]
    pools = {}
    configs = [(noise, k, drivers) for noise in args.noise for k in args.engines for drivers in (False, True)]
    memory = args.memory or round(0.85 / len(configs), 3)  # GPU 0 holds an engine of every configuration
    res["memory"] = memory
    for noise, k, drivers in configs:
        es_section = {"population_size": args.members, "noise": noise}
        if noise == "lowrank":
            es_section.update(rank=args.rank, exclude=["lm_head*"])  # vLLM's LoRA path does not serve lm_head
        generator = ({"backend": "vllm", "vllm": {"gpu_memory_utilization": memory, "max_model_len": 1024}}
                     if args.backend == "vllm" else {"backend": "hf", "device": "cpu", "dtype": "float32"})
        gpus = (args.gpus or list(range(k)))[:k] if args.backend == "vllm" else None
        cfg = build({"model": model, "optimizer": "es", "seed": 1, "es": es_section, "generator": generator,
                     "sampling": {"temperature": 1.0, "max_new_tokens": args.new_tokens, "batch_size": 32},
                     "runtime": {"local": {"engines": k, "gpus": gpus, "driver_processes": drivers}}})
        t0 = time.perf_counter()
        es = ES(cfg.es, seed=1, base={"model": model})
        host = LocalRuntime().policy(cfg, es.needs())
        es.setup(host)
        pools[noise, k, drivers] = (host, es)
        res[f"startup_s_{noise}_{k}_engines_{'drivers' if drivers else 'in_process'}"] = time.perf_counter() - t0
        save()

    def timed(key: tuple[str, int, bool], n_tasks: int) -> dict:
        run = iteration(*pools[key], tasks[:n_tasks])
        return {**run, "it_s": 1 / run["loop_s"]}

    for key in configs:  # warm-up
        timed(key, args.tasks[0])
    for rep in range(args.repeats):
        for n_tasks in args.tasks:
            for noise, k, drivers in configs:
                run = {"repeat": rep, "tasks": n_tasks, "noise": noise, "engines": k, "drivers": drivers,
                       **timed((noise, k, drivers), n_tasks)}
                res["runs"].append(run)
                print(json.dumps(run), flush=True)
                save()

    def median(field: str, n_tasks: int, noise: str, k: int, drivers: bool) -> float:
        return statistics.median(r[field] for r in res["runs"]
                                 if (r["tasks"], r["noise"], r["engines"], r["drivers"]) == (n_tasks, noise, k, drivers))

    summary = {}
    for n_tasks in args.tasks:
        for noise, k, drivers in configs:
            it_s = median("it_s", n_tasks, noise, k, drivers)
            summary[f"tasks={n_tasks},noise={noise},engines={k},drivers={drivers}"] = {
                "it_s": it_s, "sample_s": median("wall_s", n_tasks, noise, k, drivers),
                "update_s": median("update_s", n_tasks, noise, k, drivers),
                "tok_s": median("tok_s", n_tasks, noise, k, drivers),
                "drivers_vs_in_process": it_s / median("it_s", n_tasks, noise, k, False),
                "vs_one_engine": it_s / median("it_s", n_tasks, noise, 1, False) if 1 in args.engines else None,
            }
    res["summary"] = summary
    save()
    print(json.dumps(summary, indent=1))
    for host, _ in pools.values():
        host.close()


if __name__ == "__main__":
    main()
