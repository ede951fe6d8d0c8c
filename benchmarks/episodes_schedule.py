"""The episode loop's scheduling, without a GPU: streamed turns (vLLM's path, `vrl.episodes.TurnStream`) against one
batched engine call per turn (the path before it, still hf's), through the real `Episodes` loop and the real
`vllm._Turns`, on an emulated continuous-batching engine. Results: docs/benchmarks.md, "Episodes: streamed turns".

    python benchmarks/episodes_schedule.py --out result.json

The emulated engine (a stand-in for `vllm.LLM`'s request surface: `enqueue`, `llm_engine.step`, `abort_request`)
runs a decode step every `--step-ms` milliseconds for every running request (continuous batching, at most
`--max-running` at once); each turn's length is drawn from a seeded geometric distribution (mean `--mean-tokens`,
cut at `--max-tokens`), as a real model's turns vary, and the environment's step sleeps `--env-ms`. The GPU's own
throughput is not modelled (a step costs the same whatever the batch): this measures only what the schedule wastes —
steps that run with episodes idle, waiting for the slowest turn of their batch or for environment steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--mean-tokens", type=float, default=40.0)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--env-ms", type=float, default=20.0)
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.modules["vllm"] = SimpleNamespace(SamplingParams=lambda **kw: kw)  # the stand-in takes its params as a dict

    from vrl.config import build
    from vrl.episodes import Episodes, Interaction, Reply, Row
    from vrl.generate import tiny
    from vrl.generate.vllm import VLLMGenerator, _Turns
    from vrl.types import Task

    tok = tiny.build_tokenizer()

    class Engine:
        """Continuous batching: every running request gains a token per step; a finished one leaves at once."""

        def __init__(self, seed: int):
            self.rng, self.running, self.queue, self.count, self.steps = random.Random(seed), {}, [], 0, 0
            self.llm_engine = SimpleNamespace(has_unfinished_requests=lambda: bool(self.running or self.queue),
                                              step=self.step, abort_request=lambda ids: None)

        def enqueue(self, prompts, params, use_tqdm=False, **extra):
            ids = []
            for _ in prompts:
                rid = str(self.count)
                self.count += 1
                n = min(args.max_tokens, 1 + int(self.rng.expovariate(1 / args.mean_tokens)))
                self.queue.append((rid, n))
                ids.append(f"{rid}-x")
            return ids

        def step(self):
            while self.queue and len(self.running) < args.max_running:
                rid, n = self.queue.pop(0)
                self.running[rid] = [n, 0]
            time.sleep(args.step_ms / 1000)
            self.steps += 1
            done = []
            for rid, st in list(self.running.items()):
                st[1] += 1
                if st[1] >= st[0]:
                    del self.running[rid]
                    ids = [65 + (int(rid) + k) % 26 for k in range(st[0])]
                    done.append(SimpleNamespace(request_id=rid, finished=True, outputs=[
                        SimpleNamespace(token_ids=ids, finish_reason="length", index=0, logprobs=None)]))
            return done

    class Talk(Interaction):
        max_turns = args.turns

        async def reply(self, turn):
            await asyncio.sleep(args.env_ms / 1000)
            return Reply(messages=[{"role": "user", "content": "go on"}])

    class Env:
        name = "schedule"

        def interaction(self, task):
            return Talk()

    tasks = [Task(id=f"e{i}", prompt=[{"role": "user", "content": f"episode {i}"}]) for i in range(args.episodes)]
    rows = [Row(task=t, seed=i) for i, t in enumerate(tasks)]

    def once(kind: str, seed: int) -> dict:
        engine = Engine(seed)
        gen = VLLMGenerator(engine, tok, build({}).sampling, mode="sample")
        turns = _Turns(gen, [], None)
        runner = Episodes(Env())

        def batched(seqs, seeds, members):  # one call per turn: submit all, step until every one is back
            keys = list(range(len(seqs)))
            turns.submit(keys, seqs, seeds, members)
            got = {}
            while turns.busy():
                got.update(turns.step())
            return [got[k] for k in keys]

        t = time.perf_counter()
        comps = runner.run(rows, tok, turns if kind == "streamed" else batched)
        wall = time.perf_counter() - t
        tokens = sum(c.completion_tokens for c in comps)
        return {"wall_s": wall, "engine_steps": engine.steps, "model_tokens": tokens, "tok_s": tokens / wall}

    runs = {"streamed": [], "batched": []}
    for r in range(args.repeats):
        for kind in ("batched", "streamed"):
            row = once(kind, seed=r)
            runs[kind].append(row)
            print(kind, row, flush=True)
    pairs = [b["wall_s"] / s["wall_s"] for s, b in zip(runs["streamed"], runs["batched"])]
    result = {"settings": vars(args), "runs": runs, "speedup_median": statistics.median(pairs), "speedups": pairs,
              "steps_median": {k: statistics.median(x["engine_steps"] for x in v) for k, v in runs.items()}}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
