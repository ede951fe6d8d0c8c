"""ES sampling on the vllm backend: one host call per iteration, on one engine or a pool of engines.

    python benchmarks/es_engines.py --out result.json [--members 10] [--tasks 8 64 256] [--engines 1 2]

Qwen2.5-1.5B shapes with random bf16 weights; prompts of 64 random printable characters through the
byte tokenizer; every completion runs to `--new-tokens` (a random model never stops). For each
task count and pool size, one ES iteration's sampling: `host.sample(tasks, N members)` with
in-engine perturbation (what `vrl train` does), timed end to end; reported as generated tokens per
second. Every pool is started before anything is timed and the configurations are interleaved
over `--repeats` rounds (medians reported), next to raw `LLM.generate` on `--raw-prompts` prompts
on the same GPU in the same run: the baseline every ratio is taken against.

Engines of a pool are dealt over `--gpus` (default: all on GPU 0, each with an equal share of
`--memory`); on one GPU this measures what two engines give, on two GPUs the scaling.
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
    ap.add_argument("--members", type=int, default=10)
    ap.add_argument("--tasks", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--gpus", type=int, nargs="+", default=None)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--raw-prompts", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--memory", type=float, default=0.3, help="gpu_memory_utilization of each pool, per GPU")
    ap.add_argument("--small", action="store_true", help="a 2-layer model, for a quick check")
    ap.add_argument("--eager", action="store_true", help="enforce_eager engines (fast start, slow decode)")
    ap.add_argument("--path", default="/tmp/vrl-bench-model")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    import vllm
    from vllm_generation import build_model

    from vrl.config import build
    from vrl.optim.es import ES
    from vrl.runtime.local import LocalRuntime
    from vrl.types import Task

    res: dict = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "vllm": vllm.__version__,
                 "members": args.members, "new_tokens": args.new_tokens, "small": args.small, "runs": []}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    build_model(args.path, args.small)
    rng = random.Random(0)
    texts = ["".join(rng.choice(string.ascii_letters + " ") for _ in range(64)) for _ in range(max(args.tasks + [args.raw_prompts]))]
    tasks = [Task(id=f"p{i}", prompt=t) for i, t in enumerate(texts)]
    pools = {}
    for k in args.engines:
        cfg = build({"model": args.path, "optimizer": "es", "seed": 1,
                     "sampling": {"temperature": 1.0, "max_new_tokens": args.new_tokens, "batch_size": 32},
                     "es": {"population_size": args.members},
                     "generator": {"backend": "vllm", "gpu_memory_utilization": args.memory, "max_model_len": 1024,
                                   "enforce_eager": args.eager, "engines": k, "gpus": args.gpus}})
        t0 = time.perf_counter()
        host = LocalRuntime().policy(cfg, "perturbations")
        es = ES(cfg.es, seed=1, base={"model": args.path})
        es.setup(host)
        pools[k] = (host, es)
        res[f"startup_s_{k}_engines"] = time.perf_counter() - t0
        save()

    first = pools[args.engines[0]][0]
    llm = first.hosts[0].llm if hasattr(first, "hosts") else first.llm

    def raw() -> float:
        prompts = [{"prompt_token_ids": first_tokens(t)} for t in tasks[: args.raw_prompts]]
        params = vllm.SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

    tokenizer = (first.hosts[0] if hasattr(first, "hosts") else first).tokenizer

    def first_tokens(t: Task) -> list[int]:
        return tokenizer(t.prompt, add_special_tokens=False)["input_ids"]

    def es_iteration(k: int, n_tasks: int) -> dict:
        host, es = pools[k]
        variants = es.ask()
        t0 = time.perf_counter()
        tokens = completions = 0
        for batch in host.sample(tasks[:n_tasks], variants, seed=7):
            tokens += sum(c.completion_tokens for c in batch)
            completions += len(batch)
        wall = time.perf_counter() - t0
        es._variants = None  # no update: every repeat samples the same θ
        return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "completions": completions}

    raw()  # warm-up
    for k in args.engines:
        es_iteration(k, args.tasks[0])
    for rep in range(args.repeats):
        res.setdefault("raw_tok_s", []).append(raw())
        for n_tasks in args.tasks:
            for k in args.engines:
                run = {"repeat": rep, "tasks": n_tasks, "engines": k, **es_iteration(k, n_tasks)}
                res["runs"].append(run)
                print(json.dumps(run), flush=True)
                save()
    raw_median = statistics.median(res["raw_tok_s"])
    summary = {}
    for n_tasks in args.tasks:
        for k in args.engines:
            rates = [r["tok_s"] for r in res["runs"] if r["tasks"] == n_tasks and r["engines"] == k]
            walls = [r["wall_s"] for r in res["runs"] if r["tasks"] == n_tasks and r["engines"] == k]
            summary[f"tasks={n_tasks},engines={k}"] = {
                "tok_s": statistics.median(rates), "wall_s": statistics.median(walls),
                "vs_raw": statistics.median(rates) / raw_median,
                "vs_one_engine": statistics.median(rates) / statistics.median(
                    [r["tok_s"] for r in res["runs"] if r["tasks"] == n_tasks and r["engines"] == args.engines[0]]),
            }
    res["raw_tok_s_median"] = raw_median
    res["summary"] = summary
    save()
    print(json.dumps({"raw_tok_s": raw_median, **summary}, indent=1))
    for host, _ in pools.values():
        host.close()


if __name__ == "__main__":
    main()
