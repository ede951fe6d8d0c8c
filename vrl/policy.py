"""The contract between update rules and the places policies run.

An optimizer never drives an engine. It asks for `Variant`s (data: which policy to sample) and
changes the weights only through a `PolicyHost`, whatever holds copies of them: an in-process
transformers module, a vLLM engine, K engines on several GPUs, or Modal GPU workers. One iteration::

    variants = optimizer.ask()                          # ES: N seeded members; GRPO: θ with G samples
    for batch in host.sample(tasks, variants, seed):    # every variant, on every engine, streamed
        ... verify, shape ...
    optimizer.tell(results)                             # ES: host.update(update); GRPO: train, host.publish(model)

A host offers two ways to move weights, one per family of update rules:

- **Seeded perturbations** (ES): `perturbations(spec)` selects the parameters and the noise; a
  variant with a `seed` is sampled from θ + sign·σ·ε(seed) and θ is restored exactly afterwards;
  `update(update)` adds Σⱼ cⱼ·ε(seedⱼ) to θ on every copy. The state is replayable from seeds.
- **Trained weights** (GRPO): `trainable()` is the in-process model a gradient step changes;
  `publish(model)` makes every sampling copy use that model's weights (the module, tensors by
  checkpoint name, or a `WeightStream` of them bucket by bucket, as ranks of a sharded model gather
  them). `decouple()` (asynchronous rollouts) makes the trained model a copy apart from the sampled
  one, so sampling can run meanwhile.

A new update rule uses one of these (or both) and needs no change here; a new runtime implements
`PolicyHost` (or deals variants over hosts that do, as `vrl.runtime.pool.HostPool` does).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from vrl.types import Completion, Task

Moves = Literal["perturbations", "trained"]
"""How an update rule moves the weights: seeded perturbations (ES) or trained weights (GRPO)."""


@dataclass(frozen=True)
class Variant:
    """One policy to sample this iteration."""

    index: int
    samples_per_task: int = 1
    seed: int | None = None  # a seeded perturbation of θ (an ES member); None: θ itself
    sign: int = 1  # +1 or -1 (antithetic pairs share a seed)


@dataclass(frozen=True)
class PerturbationSpec:
    """Which parameters seeded variants perturb and how (declared once by the optimizer)."""

    include: tuple[str, ...]
    exclude: tuple[str, ...]
    sigma: float
    noise: Literal["full", "lowrank"] = "full"
    rank: int = 0  # lowrank only


@dataclass(frozen=True)
class HostNeeds:
    """What an update rule will ask of its hosts, known from the config before any engine starts.

    A runtime gets it when it places hosts, so settings that cannot work are refused before an engine
    starts, and engines are sized for the work (a vLLM engine serving low-rank members reserves one
    LoRA slot per member, up to `variants`).
    """

    moves: Moves
    spec: PerturbationSpec | None = None  # the perturbations it will declare (seeded perturbations)
    variants: int = 1  # the most variants one `sample` call may carry
    adapter_rank: int = 0  # trained weights: the rank of the LoRA adapter it trains (0: it trains every weight)
    #: trained weights in another process (a driver process's parent, `vrl.runtime.driver`): the torch
    #: device they are trained on there, e.g. 'cuda:0' (None: this process's `generator.device`)
    train_device: str | None = None


@dataclass(frozen=True)
class WeightsInfo:
    """What a host's perturbable weights are: the selected parameter names, their size and dtype."""

    names: tuple[str, ...]
    numel: int
    dtype: str
    exportable: bool = True  # `state()` works here (False: the weights live on remote workers)


@dataclass
class Trainable:
    """The in-process model a gradient-based optimizer trains, with its tokenizer and sampling settings."""

    model: Any
    tokenizer: Any
    sampling: Any
    extra: dict[str, Any] = field(default_factory=dict)
    # The host samples from weights of its own, which this model reaches only by `publish` (a vLLM
    # engine, a decoupled HF host): a launch that trains a sharded copy may then free this one.
    separate: bool = False


class WeightStream:
    """Weights by checkpoint name, in buckets, drawn once: each bucket (a list of (name, tensor)) is
    valid until the next one is drawn. How ranks of a sharded model publish (`vrl.optim.grpo_dist`):
    every bucket is gathered by every rank together, so the stream's owner `drain`s what the host left
    undrawn (a host that skips a push, or fails in the middle of one), and no process ever holds the
    whole model at once unless a host `collect`s it."""

    def __init__(self, buckets: Iterable[list[tuple[str, Any]]]):
        self._buckets = iter(buckets)

    def __iter__(self) -> Iterator[list[tuple[str, Any]]]:
        return self._buckets

    def collect(self) -> dict[str, Any]:
        """Every remaining weight at once, by name (for a host that publishes to several copies)."""
        return {name: t for bucket in self._buckets for name, t in bucket}

    def drain(self) -> None:
        """Draw (and drop) every remaining bucket."""
        for _ in self._buckets:
            pass


class Unsupported(RuntimeError):
    """A host cannot move its weights the way an optimizer asks (says which setting to change)."""


class PolicyHost(ABC):
    """Holds copies of the policy's weights and samples from variants of them."""

    name: str = "host"
    collective: bool = False
    """Its sampling takes part in collective calls with other processes (under torchrun, every rank's
    share: `grpo_dist.RankHosts`): a stop signal must not interrupt it half-way (`Trainer._stop_signals`)."""

    # -- sampling (the trainer, through the runtime) ----------------------------------------------
    @abstractmethod
    def sample(self, tasks: Sequence[Task], variants: Sequence[Variant], seed: int | None = None
               ) -> Iterator[list[Completion]]:
        """Completions of every variant (`samples_per_task` per task, tagged with the variant's index),
        yielded in batches as they finish, so verification starts while sampling goes on.

        Sampling seeds depend only on (seed, variant, task position, sample), never on which engine
        ran the variant: a pool of hosts returns what one host returns. A batch judged where it was
        sampled (another rank's share) comes as a `vrl.types.Verified`, with its verdicts.
        """

    def episodes(self, runner: Any) -> None:
        """Sample multi-turn episodes from now on: `runner` (a `vrl.episodes.Episodes`) holds the environment
        that answers each turn; `sample` then yields one completion per episode (DESIGN.md §6c)."""
        raise Unsupported(f"{self.name} cannot run multi-turn episodes")

    # -- seeded perturbations (ES) -----------------------------------------------------------------
    def perturbations(self, spec: PerturbationSpec) -> WeightsInfo:
        """Select the parameters seeded variants perturb and keep an fp32 master θ of them."""
        raise Unsupported(f"{self.name} cannot apply seeded perturbations")

    def update(self, update: Any) -> None:
        """θ ← θ + Σⱼ cⱼ·s(seedⱼ) on every copy (`s`: the integer noise of `vrl.weights.noise`).

        `update` is a `vrl.weights.update.FullRankUpdate`, or with `PerturbationSpec.noise ==
        "lowrank"` a `LowRankUpdate` (the weights layer sits above this contract, so the type is
        named here, not imported); a host refuses the other mode's kind.
        """
        raise Unsupported(f"{self.name} cannot apply seeded updates")

    def state(self) -> dict[str, Any]:
        """θ of the perturbable parameters (fp32 CPU tensors by name), for snapshots."""
        raise Unsupported(f"{self.name} cannot export its weights")

    def load_state(self, state: dict[str, Any]) -> None:
        """Set θ of the perturbable parameters (from `state`) on every copy."""
        raise Unsupported(f"{self.name} cannot load weights")

    def checksum(self) -> str:
        """A fingerprint of θ's exact bits, computed where θ lives (`vrl.weights.flat.checksum`): ES ranks
        under torchrun compare theirs after every update, so copies that drift apart stop the run."""
        raise Unsupported(f"{self.name} cannot fingerprint its weights")

    # -- trained weights (GRPO) --------------------------------------------------------------------
    def trainable(self) -> Trainable:
        """The in-process model to train; built on first call (a vLLM host loads an HF copy then)."""
        raise Unsupported(f"{self.name} has no trainable in-process model")

    def follow_trained(self) -> None:
        """This host samples the weights of a copy another host handed out (a pool trains its first host's
        `trainable()` and publishes to all): from now on it samples as its own `trainable()` would have made
        it sample (a vLLM engine reports sampling log-probs), without loading a copy. Nothing by default."""

    def publish(self, model: Any) -> None:
        """Make sampling use `model`'s weights from the next `sample` on (after each update): the trained
        module, a mapping of tensors by checkpoint name, or a `WeightStream` (draw it at most once)."""
        raise Unsupported(f"{self.name} cannot load trained weights")

    def decouple(self) -> None:
        """Asynchronous rollouts (`grpo.max_staleness` > 0, `vrl.rollouts`): from now on the sampled weights
        change only by `publish` (`trainable()` is a separate copy, trained while `sample` runs in another
        thread), and completions carry their tokens' sampling log-probs (`Completion.logprobs`) so the
        update can correct for the weights being a few updates old. Called before `trainable()`."""
        raise Unsupported(f"{self.name} cannot sample while its weights are trained (grpo.max_staleness > 0)")

    # -- instrumentation ---------------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        """Seconds of the host's last weight moves, by name (e.g. `sync_s`, `members_s`,
        `update_worker_s`; a host that measures none returns {}): what benchmarks record."""
        return {}

    def close(self) -> None:
        """Free engines and memory."""


# -- work dealt over samplers with the same weights (pooled engines, GRPO's ranks) ----------------------
def shard_seed(seed: int | None, start: int, n: int) -> int | None:
    """The seed that makes `stream(tasks[start:], n, seed=...)` sample what `stream(tasks, n, seed)` does."""
    return None if seed is None else seed + start * n


def share_needs(needs: HostNeeds | None, k: int) -> HostNeeds | None:
    """What each of `k` samplers sharing an iteration's work is asked (`deal` gives a sampler at most
    ⌈variants / k⌉ variants per call), so an engine sized per variant (a vLLM LoRA slot per low-rank ES
    member) is sized for its share: the engines of a pool, and the ranks of a torchrun launch."""
    if needs is None or k <= 1:
        return needs
    return dataclasses.replace(needs, variants=-(-needs.variants // k))


def deal(tasks: Sequence[Task], variants: Sequence[Variant], seed: int | None, k: int, granule: int = 1
         ) -> list[list[tuple[Sequence[Task], list[Variant], int | None]]]:
    """An iteration's work dealt over `k` samplers with the same weights: per sampler, the (tasks,
    variants, seed) calls it makes. Variants round-robin (each sampler runs all its members in one
    call) or, with fewer variants than samplers, each variant's tasks in contiguous shards starting at
    multiples of `granule`, each seeded for its position (`shard_seed`), so the samples are one
    sampler's whoever draws them."""
    work: list[list[tuple[Sequence[Task], list[Variant], int | None]]] = [[] for _ in range(k)]
    if len(variants) >= k or len(tasks) < 2:
        for h in range(k):  # one call per sampler with all its members (hf low-rank ES batches them)
            if variants[h::k]:
                work[h].append((tasks, list(variants[h::k]), seed))
        return work
    per_host = -(-len(tasks) // k)
    size = -(-per_host // granule) * granule
    h = 0
    for v in variants:
        for start in range(0, len(tasks), size):
            work[h % k].append((tasks[start : start + size], [v], shard_seed(seed, start, v.samples_per_task)))
            h += 1
    return work
