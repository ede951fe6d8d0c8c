"""A time and cost model of one ES iteration on Modal (docs/cost-model.md).

Members run on GPU containers in waves (`gpus` at once); a finished member hands its attempts to
the verifier in batches; `sandboxes` judge batches in parallel, one batch each at a time. The model
is a small event simulation, so it shows both the sequential loop (verify after all generation, as
in the AE Studio case study) and the overlapped one (verify each member as it returns).

    python -m vrl.runtime.modal.cost            # the case study, then the same iteration with a pool
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass, replace

# Modal list prices used for the cost column (USD); inputs, not facts: check modal.com/pricing.
H100_PER_S = 3.95 / 3600
CPU_CORE_PER_S = 0.0473 / 3600
MEMORY_GIB_PER_S = 0.008 / 3600


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
    sandbox_cores: float = 2.0
    sandbox_memory_gib: float = 8.0
    gpu_price_per_s: float = H100_PER_S
    scaledown_s: float = 1200.0  # runtime.modal.scaledown_window_s (its default): idle GPU containers stay warm (and billed) this long

    @property
    def attempts(self) -> int:
        return self.members * self.tasks * self.samples_per_task

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
    sequential = generation_s + _verify([(0.0, batches)], it.sandboxes, it.batch_s)
    overlapped = max(generation_s, _verify([(t, per_member) for t in done], it.sandboxes, it.batch_s))
    gpu_s = it.members * it.member_s
    verify_busy_s = batches * it.batch_s
    cpu_core_s = verify_busy_s * it.sandbox_cores

    def cost(loop: float) -> float:
        # Warm GPU containers wait for the next iteration while the verifier finishes (up to scaledown_s);
        # the sandbox pool is up for the whole loop.
        idle_gpu_s = min(it.gpus, it.members) * min(it.scaledown_s, loop - generation_s)
        sandbox = it.sandboxes * loop * (it.sandbox_cores * CPU_CORE_PER_S + it.sandbox_memory_gib * MEMORY_GIB_PER_S)
        return (gpu_s + idle_gpu_s) * it.gpu_price_per_s + sandbox

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


SCENARIOS = [
    ("case study (1 sandbox)", CASE_STUDY),
    ("pool of 4", replace(CASE_STUDY, sandboxes=4)),
    ("pool of 16", replace(CASE_STUDY, sandboxes=16)),
    ("8 GPUs, 1 sandbox", replace(CASE_STUDY, gpus=8)),
    ("8 GPUs, pool of 4", replace(CASE_STUDY, gpus=8, sandboxes=4)),
    ("8 GPUs, pool of 16", replace(CASE_STUDY, gpus=8, sandboxes=16)),
]


if __name__ == "__main__":  # pragma: no cover - prints the table in docs/cost-model.md
    import json

    print(json.dumps(asdict(CASE_STUDY)))
    print(table(SCENARIOS))
