"""ES sampling on the vllm backend: one host call per iteration, on one engine or a pool of engines.

    python benchmarks/es_engines.py --out result.json [--members 30] [--tasks 8 64 256] [--engines 1 2]
                                    [--noise full lowrank] [--rank 8] [--include '*.mlp.*'] [--max-num-seqs 512]

Qwen2.5-1.5B shapes with random bf16 weights; prompts of 64 random printable characters through the
byte tokenizer; every completion runs to `--new-tokens` (a random model never stops). For each
task count, noise mode and pool size, one ES iteration's sampling: `host.sample(tasks, N members)`
(what `vrl train` does: full-rank members perturb the engine one after another; low-rank members
are written into LoRA slots and sampled in one pass), timed end to end and reported as generated
tokens per second; then the update (`ES.tell` on made-up rewards), so `loop_s` is sampling plus
update, the loop's GPU-side time without verification (`update_worker_s`: the part inside the engine's
workers, with one engine). Every pool is started before anything is timed and the configurations are interleaved
over `--repeats` rounds (medians reported), next to raw `LLM.generate` on `--raw-prompts` prompts
on the same GPU in the same run: the baseline every ratio is taken against. With a one-engine
low-rank pool, `raw_lora_tok_s` is raw `LLM.generate` of the low-rank pass's own requests (first
task count × members, each with its member's LoRA adapter): vLLM's own speed on that mix.

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


def iteration(host, es, tasks: list) -> dict:
    """One timed ES iteration without verification: `host.sample` of every member, then `es.tell` on
    made-up rewards (the update and its history; θ moves at random)."""
    from vrl.types import Result, Verdict

    by_id = {t.id: t for t in tasks}
    variants = es.ask()
    t0 = time.perf_counter()
    tokens, done = 0, []
    for batch in host.sample(tasks, variants, seed=7):
        tokens += sum(c.completion_tokens for c in batch)
        done += batch
    wall = time.perf_counter() - t0
    rewards = random.Random(len(done))
    results = [Result(task=by_id[c.task_id], completion=c, verdict=Verdict.ok(), reward=rewards.random()) for c in done]
    t1 = time.perf_counter()
    es.tell(results)
    update = time.perf_counter() - t1
    return {"wall_s": wall, "update_s": update, "loop_s": wall + update, "tokens": tokens, "tok_s": tokens / wall,
            "completions": len(done)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--members", type=int, default=30)
    ap.add_argument("--noise", nargs="+", default=["full", "lowrank"], choices=["full", "lowrank"])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--include", nargs="+", default=["*"],
                    help="es.include of low-rank runs (e.g. '*.mlp.*': LoRA layers on the MLP alone)")
    ap.add_argument("--tasks", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--gpus", type=int, nargs="+", default=None)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--raw-prompts", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--raw-each", type=int, default=2,
                    help="raw baselines per round (raw varied 23-35k tok/s between rounds on one H100)")
    ap.add_argument("--memory", type=float, default=0.3, help="gpu_memory_utilization of each pool, per GPU")
    ap.add_argument("--small", action="store_true", help="a 2-layer model, for a quick check")
    ap.add_argument("--eager", action="store_true", help="enforce_eager engines (fast start, slow decode)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="generator.vllm.max_num_seqs (default: vrl's)")
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
                 "members": args.members, "new_tokens": args.new_tokens, "small": args.small, "rank": args.rank,
                 "include": args.include,
                 "max_num_seqs": args.max_num_seqs, "runs": []}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    build_model(args.path, args.small)
    rng = random.Random(0)
    texts = ["".join(rng.choice(string.ascii_letters + " ") for _ in range(64)) for _ in range(max(args.tasks + [args.raw_prompts]))]
    tasks = [Task(id=f"p{i}", prompt=t) for i, t in enumerate(texts)]
    pools = {}
    configs = [(noise, k) for noise in args.noise for k in args.engines]
    for noise, k in configs:
        es_section = {"population_size": args.members, "noise": noise}
        if noise == "lowrank":
            es_section.update(rank=args.rank, include=args.include, exclude=["lm_head*"])  # vLLM's LoRA path does not serve lm_head
        cfg = build({"model": args.path, "optimizer": "es", "seed": 1,
                     "sampling": {"temperature": 1.0, "max_new_tokens": args.new_tokens, "batch_size": 32},
                     "es": es_section,
                     "generator": {"backend": "vllm", "vllm": {
                         "gpu_memory_utilization": args.memory, "max_model_len": 1024, "enforce_eager": args.eager,
                         **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {})}},
                     "runtime": {"local": {"engines": k, "gpus": args.gpus}}})
        t0 = time.perf_counter()
        es = ES(cfg.es, seed=1, base={"model": args.path})
        host = LocalRuntime().policy(cfg, es.needs())
        es.setup(host)
        pools[noise, k] = (host, es)
        res[f"startup_s_{noise}_{k}_engines"] = time.perf_counter() - t0
        save()

    first = pools[configs[0]][0]
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

    def es_iteration(key: tuple[str, int], n_tasks: int) -> dict:
        host, es = pools[key]
        run = iteration(host, es, tasks[:n_tasks])
        counters = host.counters()  # members_s: writing the LoRA slots; update_worker_s: the update in the workers
        run.update({k: counters[k] for k in ("members_s", "update_worker_s") if k in counters})
        return run

    lowrank_one = pools.get(("lowrank", 1), (None, None))[0]

    def raw_lora() -> float:
        """Raw `LLM.generate` of the low-rank pass's own request mix (`--tasks`' first count × members,
        each tagged with its member's LoRA slot, per-request seeds), on the low-rank engine: what vLLM
        itself reaches with these adapters, so vrl's overhead and LoRA's cost can be told apart."""
        from vllm.lora.request import LoRARequest

        prompts, params, loras = [], [], []
        for p in range(args.members):
            lora = LoRARequest(f"vrl-member-{p}", p + 1, "vrl://lora-slot")  # the slots vrl registered
            for i, t in enumerate(tasks[: args.tasks[0]]):
                prompts.append({"prompt_token_ids": first_tokens(t)})
                params.append(vllm.SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=7 + i))
                loras.append(lora)
        t0 = time.perf_counter()
        one = lowrank_one.hosts[0] if hasattr(lowrank_one, "hosts") else lowrank_one  # a pool dealt over --gpus
        outs = one.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

    raw()  # warm-up
    for key in configs:
        es_iteration(key, args.tasks[0])
    for rep in range(args.repeats):
        for _ in range(args.raw_each):
            res.setdefault("raw_tok_s", []).append(raw())
            if lowrank_one is not None:  # its slots hold the members of the last low-rank iteration
                res.setdefault("raw_lora_tok_s", []).append(raw_lora())
        for n_tasks in args.tasks:
            for noise, k in configs:
                run = {"repeat": rep, "tasks": n_tasks, "noise": noise, "engines": k, **es_iteration((noise, k), n_tasks)}
                res["runs"].append(run)
                print(json.dumps(run), flush=True)
                save()
    raw_median = statistics.median(res["raw_tok_s"])
    summary = {}

    def median_of(field: str, n_tasks: int, noise: str, k: int) -> float:
        return statistics.median([r[field] for r in res["runs"] if (r["tasks"], r["noise"], r["engines"]) == (n_tasks, noise, k)])

    for n_tasks in args.tasks:
        for noise, k in configs:
            rate = median_of("tok_s", n_tasks, noise, k)
            summary[f"tasks={n_tasks},noise={noise},engines={k}"] = {
                "tok_s": rate, "wall_s": median_of("wall_s", n_tasks, noise, k),
                "loop_s": median_of("loop_s", n_tasks, noise, k), "update_s": median_of("update_s", n_tasks, noise, k),
                "vs_raw": rate / raw_median,
                "vs_one_engine": rate / median_of("tok_s", n_tasks, noise, args.engines[0]),
                "vs_full": rate / median_of("tok_s", n_tasks, "full", k) if "full" in args.noise else None,
            }
    res["raw_tok_s_median"] = raw_median
    if "raw_lora_tok_s" in res:
        res["raw_lora_tok_s_median"] = statistics.median(res["raw_lora_tok_s"])
    res["summary"] = summary
    save()
    print(json.dumps({"raw_tok_s": raw_median, "raw_lora_tok_s": res.get("raw_lora_tok_s_median"), **summary}, indent=1))
    for host, _ in pools.values():
        host.close()


if __name__ == "__main__":
    main()
