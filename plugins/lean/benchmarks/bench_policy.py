"""Cost of the validity policy and of the client's round trip, per proof, on the lean_workbook fixture.

    python plugins/lean/benchmarks/bench_policy.py

`prepare` (extract, tokenise, check the allow-list, rebuild with a fresh nonce) and `judge` (nonce echo,
errors, sorries, axioms audit) run once per completion in training, so they must cost
far less than Lean itself (tens of milliseconds to seconds per proof). The client round trip is
measured against the local replay server (no Lean), i.e. the overhead vrl adds per batch.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from lean_replay import FIXTURE, ReplayServer, fixture_responder, fixture_result
from vrl_lean.client import KiminaClient
from vrl_lean.data import load_local
from vrl_lean.policy import judge, prepare


def main() -> None:
    problems = {p.name: p for p in load_local(FIXTURE / "input")}
    sources = {p.name: f for f in (FIXTURE / "input").glob("*.lean") for p in [next(iter(load_local(f)))]}
    completions = {n: f"<think>\nplan\n</think>\n```lean4\n{sources[n].read_text()}\n```" for n in problems}
    submissions = {n: prepare(completions[n], problems[n].theorem) for n in problems}
    codes = {n: s.code for n, s in submissions.items()}
    results = {n: fixture_result("1", codes[n]) for n in problems}

    def per_proof(fn, rounds: int = 20) -> float:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for n in problems:
                fn(n)
            times.append((time.perf_counter() - start) / len(problems))
        return statistics.median(times)

    t_prepare = per_proof(lambda n: prepare(completions[n], problems[n].theorem))
    t_judge = per_proof(lambda n: judge(results[n], submissions[n]))
    mean_chars = statistics.mean(len(c) for c in completions.values())
    print(f"prepare: {t_prepare * 1e6:.0f} us/proof (mean completion {mean_chars:.0f} chars)")
    print(f"judge:   {t_judge * 1e6:.0f} us/proof")

    async def round_trips() -> float:
        with ReplayServer(fixture_responder()) as server:
            client = KiminaClient(server.url, repls=8)
            batch = [(f"{i}-{n}", codes[n]) for i, n in enumerate(problems)]
            await client.check(batch)  # warm the connection pool
            start = time.perf_counter()
            for _ in range(5):
                await client.check(batch)
            await client.aclose()
            return (time.perf_counter() - start) / (5 * len(batch))

    print(f"client round trip vs local replay server (batches of 8): {asyncio.run(round_trips()) * 1e3:.2f} ms/proof")


if __name__ == "__main__":
    main()
