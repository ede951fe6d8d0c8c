"""`vrl eval`: pass@k of a model on an environment split."""

from __future__ import annotations

from collections import Counter, defaultdict
from math import comb
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress

from vrl import episodes
from vrl.environment import Environment
from vrl.errors import UsageError
from vrl.policy import Variant
from vrl.types import Attempt, refuse_shared_ids

if TYPE_CHECKING:
    from vrl.config import TrainConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c passes (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate(config: TrainConfig, split: str = "test", k: int = 1, limit: int | None = None, console: Console | None = None,
             environment: Environment | None = None) -> dict[str, Any]:
    """pass@1, 2, 4, ..., k over a split. Checks the tasks, the model and the verifier before generating."""
    from vrl.plugins import registry
    from vrl.preflight import preflight
    from vrl.runtime import make_runtime

    env = environment or registry().environment(config.plugin, **config.env_options)
    tasks = env.tasks(split, limit=limit)
    if not tasks:
        raise UsageError(f"environment {env.name!r} has no tasks in split {split!r}; choose another --split")
    refuse_shared_ids(tasks, env.name, split)
    preflight(config, env, training=False)
    runtime = make_runtime(config)
    policy = pool = None
    by_id = {t.id: t for t in tasks}
    passes: dict[str, int] = defaultdict(int)
    statuses: Counter[str] = Counter()
    pending = []
    try:
        policy = runtime.policy(config)
        episodes.attach(policy, env)  # evaluated as trained: whole episodes where the environment answers back
        pool = runtime.verification(env.verifier() if runtime.verifies_in_process(config) else None, config, len(tasks) * k)
        with Progress(console=console or Console(stderr=True), transient=True) as progress:
            bar = progress.add_task(f"eval {env.name}/{split}", total=len(tasks) * k)
            for batch in policy.sample(tasks, [Variant(index=0, samples_per_task=k)], seed=config.seed):
                attempts = [Attempt(task=by_id[c.task_id], completion=c) for c in batch]
                pending += pool.submit(attempts)
                progress.advance(bar, len(batch))
            for chunk, future in pending:
                for attempt, verdict in zip(chunk, future.result()):
                    passes[attempt.task.id] += int(verdict.passed)
                    statuses[verdict.status.value] += 1
    finally:
        try:
            if pool is not None:
                pool.close()
            if policy is not None:
                policy.close()
        finally:
            runtime.close()
    ks = sorted({1, k} | {2**i for i in range(k.bit_length()) if 2**i <= k})
    return {
        "tasks": len(tasks),
        "samples_per_task": k,
        "pass_at": {str(j): sum(pass_at_k(k, passes[t.id], j) for t in tasks) / len(tasks) for j in ks},
        "statuses": dict(statuses),
    }
