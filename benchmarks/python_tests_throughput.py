"""Throughput of the python-tests verifier: warm fork-server sandboxes vs starting an interpreter.

    python benchmarks/python_tests_throughput.py [--attempts 2000] [--workers N]

Measures, on this machine:
  * bare `python3 -c pass` (the floor for any design that starts an interpreter per attempt),
  * a cold bubblewrap sandbox per attempt (`bwrap ... python3 -c pass`, same flags as the verifier),
  * one warm sandbox judging attempts one after another (latency per attempt, all tests included),
  * the verifier's `verify()` over batches with one warm sandbox per core (attempts per second),
    and the CPU (host + sandboxes) each attempt cost there, which a loaded machine distorts far less.
The attempts are the canonical solutions of the bundled tasks (5 tests each on average), cycled.
Prints a Markdown table; results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import time

from rich.console import Console
from vrl_python_tests.datasets import bundled_path, load_source, read_rows
from vrl_python_tests.sandbox import bwrap_argv, default_workers, pick_python, spawn_user
from vrl_python_tests.verifier import PythonTestsVerifier

from vrl.types import Attempt, Completion


def time_process(argv: list[str], runs: int, **kwargs) -> float:
    """Median wall time of running `argv` to completion."""
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, cwd="/", **kwargs)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def attempts(count: int) -> list[Attempt]:
    tasks = load_source("bundled")
    solutions = [row["solution"] for _, row in read_rows(bundled_path())]
    out = []
    for i in range(count):
        task, code = tasks[i % len(tasks)], solutions[i % len(tasks)]
        out.append(Attempt(task=task, completion=Completion(task_id=task.id, text=f"```python\n{code}```")))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=2000, help="attempts for the throughput run")
    parser.add_argument("--workers", type=int, default=default_workers(), help="warm sandboxes (default: one per core)")
    parser.add_argument("--runs", type=int, default=30, help="repetitions of the process-start measurements")
    args = parser.parse_args()
    console = Console(width=200)
    python = pick_python(None, "bwrap")
    batch = attempts(args.attempts)
    tests_per_attempt = statistics.mean(len(a.task.data["tests"]) for a in batch)

    bare = time_process([python, "-c", "pass"], args.runs)
    cold = time_process(bwrap_argv(python, 16) + [python, "-I", "-S", "-c", "pass"], args.runs, **spawn_user(0))

    serial = PythonTestsVerifier(workers=1)
    try:
        serial.judge(batch[0])  # start the sandbox outside the timing
        n = min(300, len(batch))
        start = time.perf_counter()
        verdicts = [serial.judge(a).verdict for a in batch[:n]]
        latency = (time.perf_counter() - start) / n
        assert all(v.passed for v in verdicts), "a canonical solution failed: the benchmark is invalid"
    finally:
        serial.close()

    pooled = PythonTestsVerifier(workers=args.workers)
    cpu_start = _cpu_seconds()
    warm = batch[: args.workers * 2]
    try:
        asyncio.run(pooled.verify(warm))  # warm every sandbox

        async def run_all():
            results = []
            for i in range(0, len(batch), 64):
                results += await pooled.verify(batch[i : i + 64])
            return results

        start = time.perf_counter()
        verdicts = asyncio.run(run_all())
        elapsed = time.perf_counter() - start
        assert all(v.passed for v in verdicts), "a canonical solution failed: the benchmark is invalid"
    finally:
        pooled.close()
    # Host and sandbox CPU together (the sandboxes' processes are reaped children by now), sandbox
    # starts included: unlike the wall clock, it hardly depends on what else the machine runs.
    cpu = (_cpu_seconds() - cpu_start) / (len(batch) + len(warm))

    console.print(f"machine: {platform.machine()}, {default_workers()} usable cores, Python {platform.python_version()} "
                  f"(sandbox: {python}); {len(batch)} attempts, {tests_per_attempt:.1f} tests each, "
                  f"{args.workers} workers")
    rows = [
        ("bare `python3 -c pass`", f"{bare * 1e3:.1f} ms", f"{1 / bare:.0f} /s per core"),
        ("cold bwrap sandbox + `python3 -c pass`", f"{cold * 1e3:.1f} ms", f"{1 / cold:.0f} /s per core"),
        ("warm sandbox, one attempt after another (all tests)", f"{latency * 1e3:.2f} ms",
         f"{1 / latency:.0f} /s per core"),
        (f"verify(), batches of 64, {args.workers} warm sandboxes", f"{elapsed / len(batch) * 1e3:.2f} ms",
         f"**{len(batch) / elapsed:.0f} attempts/s**"),
        ("CPU per attempt in that run (host + sandboxes, starts included)", f"{cpu * 1e3:.2f} ms CPU",
         "compare runs on a busy machine with this"),
    ]
    console.print("| what | time per attempt | rate |\n|---|---|---|")
    for row in rows:
        console.print("| " + " | ".join(row) + " |", markup=False)
    console.print(f"per-attempt latency vs bare python3: {latency / bare:.2f}x ({(latency - bare) * 1e3:+.1f} ms)")


if __name__ == "__main__":
    main()
