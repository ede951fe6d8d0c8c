"""A time and cost model of one ES iteration on Modal (docs/cost-model.md).

Members run on GPU containers in waves (`gpus` at once); a finished member hands its attempts to
the verifier in batches; `sandboxes` judge batches in parallel, one batch each at a time. The model
is a small event simulation, so it shows both the sequential loop (verify after all generation, as
in the AE Studio case study) and the overlapped one (verify each member as it returns).

    python -m vrl.runtime.modal.cost            # the case study, then the same iteration with a pool
    python -m vrl.runtime.modal.cost runs/NAME/metrics.jsonl --batch-size 64 --members 30 --cap 10
                                                # batch_s measured by a run; the pool that keeps pace under $10
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass, replace

# Modal list prices used for the cost column (USD); inputs, not facts: check modal.com/pricing.
H100_PER_S = 3.95 / 3600
CPU_CORE_PER_S = 0.0473 / 3600
MEMORY_GIB_PER_S = 0.008 / 3600
# Sandboxes: CPU at about 3x a Function's core price, billed on max(request, use) (modal.com/pricing).
SANDBOX_CPU_FACTOR = 3.0
# A nonpreemptible Function (the detached CPU orchestrator, app.py) pays "a 3x multiplier ... to the list price
# for CPU and Memory usage" (modal.com/docs/guide/preemption).
NONPREEMPTIBLE_FACTOR = 3.0


@dataclass(frozen=True)
class Iteration:
    """One ES iteration's workload and resources."""

    members: int = 30
    tasks: int = 128
    samples_per_task: int = 1
    tokens_per_completion: float = 1500.0
    tokens_per_s: float = 1500.0  # generation throughput of one member on one GPU (batched decoding)
    member_overhead_s: float = 19.0  # per call: replay the newest iteration, perturb, warm-up (warm container)
    gpus: int = 30  # GPU containers at once (runtime.modal.max_containers)
    batch_size: int = 64  # attempts per verifier call (verifier.batch_size)
    batch_s: float = 6.5  # wall time of one batch in one sandbox
    sandboxes: int = 1  # verifier calls in flight (pool size)
    sandbox_cores: float = 2.0  # runtime.modal.sandbox_cpu (billed as requested: max(request, use))
    sandbox_memory_gib: float = 32.0  # a Lean sandbox: 8 GiB per REPL x 4 REPLs (plugins/lean)
    sandbox_cpu_factor: float = SANDBOX_CPU_FACTOR
    gpu_price_per_s: float = H100_PER_S
    gpu_cores: float = 4.0  # runtime.modal.cpu: reserved (and billed) with every GPU container
    gpu_memory_gib: float = 64.0  # runtime.modal.memory_mb / 1024, likewise
    orchestrator_cores: float = 2.0  # the detached orchestrator, for the whole loop
    orchestrator_factor: float = NONPREEMPTIBLE_FACTOR  # a CPU orchestrator is nonpreemptible; 1.0 with orchestrator_gpu
    pass_rate: float = 0.0  # the share of attempts that pass; each pass is re-checked in its sandbox
    recheck_s: float = 0.0  # Lean seconds of one re-check (compile, kernel replay); a run measures lean/recheck_s_mean
    recheck_jobs: int = 2  # re-checks a sandbox runs at once (vrl_lean's Rechecker `jobs`)
    scaledown_s: float = 1200.0  # runtime.modal.scaledown_window_s (its default): idle GPU containers stay warm (and billed) this long

    @property
    def attempts(self) -> int:
        return self.members * self.tasks * self.samples_per_task

    @property
    def batch_time_s(self) -> float:
        """Wall time of one batch in one sandbox: the server's check, then the re-checks of its passes (the
        verdicts return once every pass is re-checked), `recheck_jobs` at a time."""
        return self.batch_s + self.batch_size * self.pass_rate * self.recheck_s / self.recheck_jobs

    @property
    def member_s(self) -> float:
        """Wall time of one member's call: overhead + its tokens at the GPU's throughput."""
        return self.member_overhead_s + self.tasks * self.samples_per_task * self.tokens_per_completion / self.tokens_per_s


def _verify(ready: list[tuple[float, int]], sandboxes: int, batch_s: float) -> float:
    """Finish time when batches become ready at given times ((time, count) pairs) and `sandboxes` judge them."""
    free = [0.0] * sandboxes
    heapq.heapify(free)
    end = 0.0
    for at, count in sorted(ready):
        for _ in range(count):
            start = max(heapq.heappop(free), at)
            heapq.heappush(free, start + batch_s)
            end = max(end, start + batch_s)
    return end


def simulate(it: Iteration) -> dict[str, float]:
    """Generation, verification and loop times (sequential and overlapped), GPU/CPU seconds, cost."""
    waves = math.ceil(it.members / it.gpus)
    done = [(w + 1) * it.member_s for w in range(waves) for _ in range(min(it.gpus, it.members - w * it.gpus))]
    generation_s = max(done)
    per_member = math.ceil(it.tasks * it.samples_per_task / it.batch_size)
    batches = per_member * it.members
    sequential = generation_s + _verify([(0.0, batches)], it.sandboxes, it.batch_time_s)
    overlapped = max(generation_s, _verify([(t, per_member) for t in done], it.sandboxes, it.batch_time_s))
    gpu_s = it.members * it.member_s
    verify_busy_s = batches * it.batch_time_s
    cpu_core_s = verify_busy_s * it.sandbox_cores

    def cost(loop: float) -> float:
        # Warm GPU containers wait for the next iteration while the verifier finishes (up to scaledown_s),
        # with the CPU and memory they reserve; the sandbox pool and the orchestrator are up for the loop.
        idle_gpu_s = min(it.gpus, it.members) * min(it.scaledown_s, loop - generation_s)
        gpu_rate = it.gpu_price_per_s + it.gpu_cores * CPU_CORE_PER_S + it.gpu_memory_gib * MEMORY_GIB_PER_S
        sandbox = it.sandboxes * loop * (it.sandbox_cores * it.sandbox_cpu_factor * CPU_CORE_PER_S
                                         + it.sandbox_memory_gib * MEMORY_GIB_PER_S)
        orchestrator = loop * it.orchestrator_cores * it.orchestrator_factor * CPU_CORE_PER_S
        return (gpu_s + idle_gpu_s) * gpu_rate + sandbox + orchestrator

    return {
        "attempts": it.attempts,
        "batches": batches,
        "tokens": it.attempts * it.tokens_per_completion,
        "generation_s": generation_s,
        "verify_busy_s": verify_busy_s,
        "loop_sequential_s": sequential,
        "loop_overlapped_s": overlapped,
        "gpu_s": gpu_s,
        "cpu_core_s": cpu_core_s,
        "cost_sequential_usd": cost(sequential),
        "cost_overlapped_usd": cost(overlapped),
    }


def batch_s_measured(rows: list[dict], batch_size: int, members: int) -> float:
    """Seconds one sandbox spends on one batch, from a run's metrics.jsonl rows: each iteration's
    verification busy time (summed over concurrent batches) over its batches (`members` calls, each split
    into batches of `batch_size`); the median over iterations (the first includes sandbox start-up)."""
    per_iteration = []
    for row in rows:
        completions, busy = int(row.get("completions", 0)), float(row.get("verification_s", 0.0))
        if completions and busy > 0:
            batches = members * math.ceil(completions / members / batch_size)
            per_iteration.append(busy / batches)
    if not per_iteration:
        raise ValueError("no iteration in these metrics judged anything (verification_s and completions)")
    ordered = sorted(per_iteration)
    return ordered[len(ordered) // 2]


def pool_for(it: Iteration, cap_usd: float | None = None, largest: int = 128) -> tuple[int, dict[str, float], bool]:
    """The verifier pool to ask for: the smallest with which verification keeps pace with generation (the
    overlapped loop ends within one batch of generation); with `cap_usd` (per iteration) and that pool
    over it, the fastest pool under the cap (or the cheapest, if none is). Returns the size, its
    `simulate` row, and whether it keeps pace."""
    rows = {size: simulate(replace(it, sandboxes=size)) for size in range(1, largest + 1)}

    def paced(size: int) -> bool:
        return rows[size]["loop_overlapped_s"] <= rows[size]["generation_s"] + it.batch_time_s

    keeping = [size for size in rows if paced(size)]
    pick = keeping[0] if keeping else min(rows, key=lambda size: rows[size]["cost_overlapped_usd"])
    if cap_usd is not None and rows[pick]["cost_overlapped_usd"] > cap_usd:
        under = [size for size in rows if rows[size]["cost_overlapped_usd"] <= cap_usd]
        pick = min(under, key=lambda size: (rows[size]["loop_overlapped_s"], size)) if under else \
            min(rows, key=lambda size: rows[size]["cost_overlapped_usd"])
    return pick, rows[pick], paced(pick)


CASE_STUDY = Iteration()
"""The AE Studio iteration: 30 members × 128 theorems = 3,840 attempts in 60 batches of 64, one batch at a
time; 147 s of generation (every member on its own GPU), 538 s per iteration."""


def table(rows: list[tuple[str, Iteration]]) -> str:
    """A markdown table of `simulate` for several scenarios."""
    head = "| scenario | GPUs | sandboxes | generation s | verification busy s | loop sequential s | loop overlapped s | GPU s | CPU core·s | $ sequential | $ overlapped |"
    lines = [head, "|" + "---|" * 11]
    for name, it in rows:
        r = simulate(it)
        lines.append(
            f"| {name} | {it.gpus} | {it.sandboxes} | {r['generation_s']:.0f} | {r['verify_busy_s']:.0f} | "
            f"{r['loop_sequential_s']:.0f} | {r['loop_overlapped_s']:.0f} | {r['gpu_s']:.0f} | {r['cpu_core_s']:.0f} | "
            f"{r['cost_sequential_usd']:.2f} | {r['cost_overlapped_usd']:.2f} |"
        )
    return "\n".join(lines)


KIMINA = replace(CASE_STUDY, batch_s=320.0)
"""The case study at kimina-lean-server's own throughput (about 0.8 proofs/s on 8 CPUs, so 0.2 on a 2-core
sandbox: 320 s per batch of 64), an assumption until a run measures `batch_s` (`batch_s_measured`)."""

RECHECKED = replace(CASE_STUDY, pass_rate=0.3, recheck_s=8.0)
"""The case study with vrl's re-check of every pass (the case study had none): 30 % of attempts pass and each
re-check takes 8 s of Lean, two at a time; both assumed until a run measures them (pass_rate, lean/recheck_s_mean)."""

SCENARIOS = [
    ("case study (1 sandbox)", CASE_STUDY),
    ("pool of 4", replace(CASE_STUDY, sandboxes=4)),
    ("pool of 16", replace(CASE_STUDY, sandboxes=16)),
    ("8 GPUs, 1 sandbox", replace(CASE_STUDY, gpus=8)),
    ("8 GPUs, pool of 4", replace(CASE_STUDY, gpus=8, sandboxes=4)),
    ("8 GPUs, pool of 16", replace(CASE_STUDY, gpus=8, sandboxes=16)),
    ("kimina rate, pool of 4", replace(KIMINA, sandboxes=4)),
    ("kimina rate, pool of 16", replace(KIMINA, sandboxes=16)),
    ("kimina rate, pool that keeps pace", replace(KIMINA, sandboxes=pool_for(KIMINA)[0])),
    ("re-checked passes, pool of 16", replace(RECHECKED, sandboxes=16)),
    ("re-checked passes, pool that keeps pace", replace(RECHECKED, sandboxes=pool_for(RECHECKED)[0])),
]


def main(argv: list[str] | None = None) -> None:
    """Print the scenarios of docs/cost-model.md, or size a pool from a run's measured batch time."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m vrl.runtime.modal.cost", description=main.__doc__)
    parser.add_argument("metrics", nargs="?", type=Path, help="a run's metrics.jsonl (batch_s is measured from it)")
    parser.add_argument("--batch-size", type=int, default=CASE_STUDY.batch_size, help="verifier.batch_size of that run")
    parser.add_argument("--members", type=int, default=CASE_STUDY.members, help="ES members per iteration of that run")
    parser.add_argument("--cap", type=float, help="the most an iteration may cost (USD)")
    args = parser.parse_args(argv)
    if args.metrics is None:
        print(json.dumps(asdict(CASE_STUDY)))
        print(table(SCENARIOS))
        return
    rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    it = replace(CASE_STUDY, batch_s=batch_s_measured(rows, args.batch_size, args.members), batch_size=args.batch_size,
                 members=args.members)
    size, row, paced = pool_for(it, args.cap)
    print(f"batch_s measured: {it.batch_s:.1f} s ({it.batch_size / it.batch_s:.2f} attempts/s per sandbox)")
    print(f"runtime.modal.sandboxes={size}: loop {row['loop_overlapped_s']:.0f} s for {row['generation_s']:.0f} s of "
          f"generation, ${row['cost_overlapped_usd']:.2f} per iteration"
          + ("" if paced else " (verification does not keep pace under the cap)"))


if __name__ == "__main__":  # pragma: no cover - prints the table in docs/cost-model.md
    main()
