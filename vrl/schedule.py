"""Which tasks an iteration draws and trains on, beside the loop: dynamic sampling and the curriculum.

Without `grpo.filter_groups` and a curriculum the loop draws `tasks_per_iteration` tasks per iteration
from a seeded permutation per epoch (`Trainer.tasks_for`) and nothing here runs. With either, a
`Schedule` draws them instead, from the same permutations read as one stream of positions:

- **the curriculum** (`vrl.curriculum`) skips retired tasks, each re-admitted with probability
  `curriculum.readmit_prob` when its turn comes (a coin seeded by the run seed and the position);
- **dynamic sampling** (`vrl.filtering`, rules with `Optimizer.group_relative`) draws generation batches of
  ⌈gen_batch_multiplier × tasks_per_iteration⌉ tasks until that many groups with a non-constant raw
  outcome are found, in schedule order, at most `max_num_gen_batches` of them. Informative groups
  past the batch are counted (`filter/surplus_groups`, and `surplus` in tasks.jsonl), never dropped
  silently. At the bound, `filter_groups_exhausted` stops the run (naming the data as too hard or too
  easy) or trains on what was found.

A task appears at most once per iteration (a second turn in the same iteration is skipped), so a
group is never split or merged. Every drawn task is a row of `tasks.jsonl` in the run directory
(iteration, stream position, generation batch, attempts, passes, outcome, kept or dropped and why),
and the schedule is a pure function of the seed and those rows: the next iteration starts after the
last drawn position, and the curriculum is a fold over the rows. `load` truncates the file to the
finished iterations on resume, as metrics.jsonl is; `check` refuses a resume that changes these options.

Everything is decided on rank 0 from the whole batch, in schedule order, before the update: the ranks
of a torchrun launch receive the trained batch itself (`grpo.tell`), so they agree on its size.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vrl import filtering
from vrl.curriculum import Curriculum, defective
from vrl.errors import UsageError
from vrl.fileio import write_text
from vrl.optim import optimizer_class
from vrl.types import Result, Task

if TYPE_CHECKING:
    from vrl.rundir import RunDir

TASKS_FILE = "tasks.jsonl"
FILTER_SWITCH = "filter_groups"


def filter_section(config: Any) -> Any | None:
    """The run's rule's section when it filters groups (a `group_relative` rule with filter_groups on), else None."""
    section = getattr(config, config.optimizer, None)
    if optimizer_class(config.optimizer).group_relative and getattr(section, FILTER_SWITCH, False):
        return section
    return None


def fixed_fields(config: Any) -> list[tuple[str, Any, Any]]:
    """(dotted name, value, default) of every option that decides what the finished iterations trained on."""
    from vrl.optim.grpo_loss import FILTER_FIELDS

    out = []
    section = getattr(config, config.optimizer, None)
    if optimizer_class(config.optimizer).group_relative and section is not None:
        for name in (FILTER_SWITCH, *FILTER_FIELDS):
            if name in type(section).model_fields:
                out.append((f"{config.optimizer}.{name}", getattr(section, name),
                            type(section).model_fields[name].default))
    for name, info in type(config.curriculum).model_fields.items():
        out.append((f"curriculum.{name}", getattr(config.curriculum, name), info.default))
    return out


def check(config: Any, recorded: dict[str, Any] | None = None) -> None:
    """Refuse, before anything starts, what dynamic sampling or the curriculum cannot do, and a resume
    (`recorded`: the run's recorded config) that changes them. Raises a one-line `UsageError`."""
    from vrl import rollouts

    for name in getattr(type(config), "optimizers", ()):
        section = getattr(config, name, None)
        if name != config.optimizer and optimizer_class(name).group_relative and getattr(section, FILTER_SWITCH, False):
            raise UsageError(f"{name}.{FILTER_SWITCH}=true filters {name}'s groups; optimizer={config.optimizer} "
                             f"does not train on groups: leave {name}.{FILTER_SWITCH} at false")
    active = filter_section(config) is not None or config.curriculum.kind != "none"
    if active and rollouts.asynchronous(config):
        setting, stale = rollouts.staleness(config)
        what = f"{config.optimizer}.{FILTER_SWITCH}=true" if filter_section(config) is not None else \
            f"curriculum.kind={config.curriculum.kind}"
        raise UsageError(f"{what} decides each iteration's tasks from the verdicts before it, and {setting}={stale} "
                         f"samples iterations ahead of them (not supported yet): set {setting}=0")
    if recorded is None:
        return
    for dotted, value, default in fixed_fields(config):
        before: Any = recorded
        for part in dotted.split("."):
            before = before.get(part, default) if isinstance(before, dict) else default
        if before != (value if not isinstance(value, tuple) else list(value)):
            raise UsageError(f"cannot resume with {dotted}={value!r}: the run was trained with {dotted}={before!r}, "
                             "which decides the tasks its finished iterations drew; start a new run (--name) to change it")


@dataclass
class Drawn:
    position: int
    task: Task
    readmitted: bool = False


@dataclass
class IterationPlan:
    """What `Schedule.collect` gives the loop: every result generated, the ones to train on, the
    iteration's tasks.jsonl rows and its `filter/*` and `curriculum/*` metrics."""

    results: list[Result]
    trained: list[Result]
    rows: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


Sampler = Callable[[list[Task], int], list[Result]]
"""Sample, verify and shape every variant on a list of tasks (its second argument: the generation batch's
index within the iteration); the results of each task's group."""


class Schedule:
    """The draws of a run (see the module docstring). `pool`: the split's tasks."""

    def __init__(self, config: Any, pool: Sequence[Task]):
        self.config, self.pool = config, list(pool)
        self.filter = filter_section(config)
        self.curriculum = Curriculum(config.curriculum) if config.curriculum.kind == "pass_rate" else None
        self.active = self.filter is not None or self.curriculum is not None
        self.cursor = 0  # the stream position the next iteration starts at
        self._orders: dict[int, list[int]] = {}

    # -- the stream --------------------------------------------------------------------------------------
    def task_at(self, position: int) -> Task:
        """The task at a stream position: epoch e's seeded permutation, as `Trainer.tasks_for` reads it."""
        epoch, offset = divmod(position, len(self.pool))
        if epoch not in self._orders:
            order = list(range(len(self.pool)))
            random.Random(f"{self.config.seed}-{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time: positions only move forward
        return self.pool[self._orders[epoch][offset]]

    def readmits(self, position: int) -> bool:
        """The seeded coin of a retired task's turn at `position`."""
        p = self.config.curriculum.readmit_prob
        return p > 0 and random.Random(f"{self.config.seed}-readmit-{position}").random() < p

    def draw(self, count: int, taken: set[str], start: int) -> tuple[list[Drawn], int]:
        """Up to `count` tasks from position `start` on, skipping tasks in `taken` (this iteration's) and
        retired ones that lose their coin; at most two epochs' worth of positions are looked at. Returns
        the drawn tasks and the position after the last one looked at."""
        out: list[Drawn] = []
        position, limit = start, start + 2 * len(self.pool)
        while len(out) < count and position < limit:
            task = self.task_at(position)
            position += 1
            if task.id in taken:
                continue
            readmitted = False
            if self.curriculum is not None and self.curriculum.retired(task.id):
                if self.curriculum.status(task.id) == "retired_defective" or not self.readmits(position - 1):
                    continue
                readmitted = True
            taken.add(task.id)
            out.append(Drawn(position - 1, task, readmitted))
        return out, position

    # -- resume ------------------------------------------------------------------------------------------
    def load(self, run_dir: RunDir, start_iteration: int) -> None:
        """Keep the rows of the finished iterations (a crash, a rewind) and rebuild the state from them."""
        from vrl.rundir import read_jsonl

        path = run_dir.path / TASKS_FILE
        rows = read_jsonl(path)
        kept = [r for r in rows if r["iteration"] < start_iteration]
        if len(kept) != len(rows) or (path.exists() and not rows):
            write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        for row in kept:
            self._fold(row)

    def _fold(self, row: dict[str, Any]) -> None:
        self.cursor = max(self.cursor, row["position"] + 1)
        if self.curriculum is not None and row["attempts"]:
            self.curriculum.observe(row["task_id"], row["passed"] / row["attempts"], row["defective"])

    # -- one iteration -----------------------------------------------------------------------------------
    def collect(self, iteration: int, sample: Sampler) -> IterationPlan:
        """Draw, sample and decide one iteration (see the module docstring)."""
        k = self.config.tasks_per_iteration
        taken: set[str] = set()
        size = math.ceil(self.filter.gen_batch_multiplier * k) if self.filter is not None else k
        limit = self.filter.max_num_gen_batches if self.filter is not None else 1
        metric = self.filter.filter_groups_metric if self.filter is not None else "passed"
        position, batches, readmitted = self.cursor, 0, 0
        results: list[Result] = []
        kept: list[list[Result]] = []
        rows: list[dict[str, Any]] = []
        kinds = {"mixed": 0, "all_pass": 0, "all_fail": 0, "constant": 0}
        surplus = 0
        while batches < limit and (self.filter is None or len(kept) < k):
            drawn, position = self.draw(size, taken, position)
            if not drawn:
                if batches == 0:
                    raise self._nothing_to_draw(iteration)
                break
            batch = sample([d.task for d in drawn], batches)
            results += batch
            groups = filtering.by_task(batch)
            for d in drawn:
                group = groups.get(d.task.id, [])
                kind = filtering.classify(group, metric) if group else "constant"
                kinds[kind] += 1
                readmitted += d.readmitted
                why = None
                if self.filter is None:
                    kept.append(group)
                elif kind != "mixed":
                    why = kind
                elif len(kept) < k:
                    kept.append(group)
                else:
                    why, surplus = "surplus", surplus + 1
                rows.append({"iteration": iteration, "position": d.position, "task_id": d.task.id, "batch": batches,
                             "attempts": len(group), "passed": sum(r.verdict.passed for r in group),
                             "outcome": kind, "kept": why is None, "why": why, "readmitted": d.readmitted,
                             "defective": any(defective(r.verdict) for r in group)})
            batches += 1
        exhausted = self.filter is not None and len(kept) < k
        if exhausted and (self.filter.filter_groups_exhausted == "stop" or not kept):
            raise self._exhausted(iteration, len(kept), kinds, batches, len(rows))
        # without a filter every result trains, in the loop's order (by variant, task, sample: ES's members)
        trained = [r for group in kept for r in group] if self.filter is not None else results
        for row in rows:
            self._fold(row)
        metrics: dict[str, float] = {}
        if self.filter is not None:
            groups_seen = len(rows)
            kept_ids = {id(r) for r in trained}
            metrics.update({
                "filter/gen_batches": float(batches),
                "filter/groups": float(groups_seen),
                "filter/informative_frac": kinds["mixed"] / groups_seen if groups_seen else 0.0,
                "filter/all_pass_groups": float(kinds["all_pass"]),
                "filter/all_fail_groups": float(kinds["all_fail"]),
                "filter/constant_groups": float(kinds["constant"]),
                "filter/surplus_groups": float(surplus),
                "filter/trained_groups": float(len(kept)),
                "filter/exhausted": float(exhausted),
                "tokens_discarded": float(sum(r.completion.completion_tokens for r in results if id(r) not in kept_ids)),
                "reward_mean_trained": sum(r.reward for r in trained) / len(trained),
            })
        if self.curriculum is not None:
            metrics.update(self.curriculum.counts([t.id for t in self.pool]))
            metrics["curriculum/readmitted"] = float(readmitted)
        return IterationPlan(results=results, trained=trained, rows=rows, metrics=metrics)

    def _nothing_to_draw(self, iteration: int) -> UsageError:
        counts = self.curriculum.counts([t.id for t in self.pool]) if self.curriculum is not None else {}
        said = ", ".join(f"{int(v)} {k.split('/')[1]}" for k, v in counts.items() if v)
        return UsageError(f"iteration {iteration}: no task of the {len(self.pool)} in split {self.config.split!r} can be "
                          f"drawn ({said}): every one is retired by curriculum.kind=pass_rate; widen curriculum.band_low"
                          "/band_high, raise curriculum.readmit_prob, or use a larger split")

    def _exhausted(self, iteration: int, found: int, kinds: dict[str, int], batches: int, drawn: int) -> UsageError:
        k, name = self.config.tasks_per_iteration, self.config.optimizer
        verdict = "too hard for the model (most groups all failed)" if kinds["all_fail"] >= kinds["all_pass"] \
            else "too easy for the model (most groups all passed)"
        return UsageError(
            f"iteration {iteration}: {name}.{FILTER_SWITCH} found {found} of the {k} informative groups it needs after "
            f"{batches} generation batch(es) ({drawn} tasks; {name}.max_num_gen_batches={self.filter.max_num_gen_batches}"
            f"{'' if batches == self.filter.max_num_gen_batches else '; no more tasks could be drawn'}): "
            f"{kinds['all_fail']} groups all failed, {kinds['all_pass']} all passed, {kinds['constant']} had a constant "
            f"{self.filter.filter_groups_metric}; the data is {verdict}. Raise {name}.max_num_gen_batches or "
            f"{name}.gen_batch_multiplier, use curriculum.kind=pass_rate, or set {name}.filter_groups_exhausted=train "
            "to train on the groups found (at least one); the run stopped before this iteration's update")
