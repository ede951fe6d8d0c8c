"""Multi-turn episodes on the vllm backend (one GPU): 3-turn episodes against single-turn completions of
the same total new tokens, tok/s of the model's tokens, and the environment step's share of the wall
time. Results: docs/benchmarks.md.

    python benchmarks/episodes.py --out result.json            # Qwen2.5-1.5B shapes, random bf16
    python benchmarks/episodes.py --small --out result.json    # a 2-layer model, for a quick check

Weights are random (no downloads); prompts are random printable text through the byte tokenizer of
`vrl.generate.tiny`, 64 tokens each. An episode has 3 model turns of up to `--turn-tokens` tokens each,
and the environment answers each of the first two with a short message (about 30 tokens, rendered by
the chat template); the single-turn baseline generates up to 3 × `--turn-tokens` tokens per prompt.
Repeats alternate the two, medians reported (of each kind's tok/s, and of the ratio within each pair).
`engine_s` is the time in the engine's steps as the episode loop streams turns through them; `env_share`
the rest of the wall time (rendering, tokenising, environment steps not overlapped with generation).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import string
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--turn-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--path", default="/tmp/vrl-bench-episodes")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (faster start, slower generation)")
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location("vllm_generation", root / "benchmarks" / "vllm_generation.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    from vrl.config import build
    from vrl.episodes import Episodes, Interaction, ModelTurn, Reply
    from vrl.generate import make_generator
    from vrl.policy import HostNeeds, Variant
    from vrl.types import Task

    bench.build_model(args.path, args.small)

    class Feedback(Interaction):
        max_turns = 3

        async def reply(self, turn: ModelTurn) -> Reply:
            return Reply(messages=[{"role": "user", "content": f"Turn {turn.index}: keep going, say more."}])

    class Env:
        name = "bench"

        def interaction(self, task):
            return Feedback()

    rng = random.Random(0)
    tasks = [Task(id=f"p{i}", prompt=[{"role": "user", "content": "".join(rng.choice(string.ascii_letters) for _ in range(48))}])
             for i in range(args.prompts)]

    def engine(max_new_tokens: int):
        cfg = build({"model": args.path, "optimizer": "grpo", "seed": 0,
                     "sampling": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "batch_size": args.prompts},
                     "generator": {"backend": "vllm", "dtype": "bfloat16", "vllm": {
                         "enforce_eager": args.eager, "gpu_memory_utilization": 0.6, "max_model_len": 2048}}})
        return make_generator(cfg, HostNeeds("trained"))

    t0 = time.perf_counter()
    gen = engine(args.turn_tokens)
    start_s = time.perf_counter() - t0
    runner = Episodes(Env())
    generate_s = [0.0]
    from vrl.generate import vllm as vllm_backend

    original = vllm_backend._Turns.step

    def timed(self):  # the engine's steps, as the episode loop streams turns through them
        t = time.perf_counter()
        try:
            return original(self)
        finally:
            generate_s[0] += time.perf_counter() - t

    vllm_backend._Turns.step = timed
    rows = {"episodes": [], "single": []}
    for r in range(args.repeats + 1):  # the first round warms both paths up and is not kept
        for kind in ("episodes", "single"):
            if kind == "episodes":
                gen.episodes(runner)
                gen.sampling = gen.sampling.model_copy(update={"max_new_tokens": args.turn_tokens})
            else:
                gen._episodes = None
                gen.sampling = gen.sampling.model_copy(update={"max_new_tokens": 3 * args.turn_tokens})
            generate_s[0] = 0.0
            t = time.perf_counter()
            comps = [c for b in gen.sample(tasks, [Variant(0)], seed=r) for c in b]
            wall = time.perf_counter() - t
            tokens = sum(c.completion_tokens for c in comps)
            row = {"wall_s": wall, "model_tokens": tokens, "tok_s": tokens / wall}
            if kind == "episodes":
                row.update(env_tokens=sum(len(c.token_ids) - c.completion_tokens for c in comps),
                           engine_s=generate_s[0], env_share=1 - generate_s[0] / wall,
                           turns_mean=statistics.mean(c.episode.metrics["turns"] for c in comps))
            if r:
                rows[kind].append(row)
            print(kind, row, flush=True)
    gen.close()
    med = {k: statistics.median(x["tok_s"] for x in v) for k, v in rows.items()}
    pairs = [e["tok_s"] / s["tok_s"] for e, s in zip(rows["episodes"], rows["single"])]
    result = {"prompts": args.prompts, "turn_tokens": args.turn_tokens, "small": args.small, "eager": args.eager,
              "engine_start_s": start_s, "runs": rows, "tok_s_median": med, "ratio": med["episodes"] / med["single"],
              "pair_ratios": pairs, "pair_ratio_median": statistics.median(pairs),
              "env_share_median": statistics.median(x["env_share"] for x in rows["episodes"])}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
