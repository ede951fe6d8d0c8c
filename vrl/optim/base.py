"""The ask/tell contract every update rule implements.

One iteration of the loop::

    variants = optimizer.ask()                          # which policies to sample
    for batch in host.sample(tasks, variants, seed):    # the runtime's hosts sample them all
        ... verify, shape ...
    metrics = optimizer.tell(results)                   # update the policy from rewarded results

ES asks for N seeded perturbations with one sample each; GRPO asks for the current policy with G
samples per task. An optimizer changes weights only through its `PolicyHost` (`vrl.policy`): ES
with seeded perturbations and updates, GRPO by training `host.trainable()` and publishing it.

A rule declares what it can do (`moves`, `staleness`, `ranks`); the loop, the launch and preflight
ask those declarations, never the rule's name, so a plugin's rule is treated as a built-in is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from vrl.policy import HostNeeds, Moves, PolicyHost, Variant
from vrl.types import Result

__all__ = ["Optimizer", "Variant"]


class Optimizer(ABC):
    """An update rule. Subclasses keep their own state and persist it under the run directory."""

    name: str = "optimizer"
    Config: type[BaseModel]  # its settings: the config section named after the rule (`config.<name>`)
    moves: Moves = "perturbations"  # how this rule changes weights (see `vrl.policy.Moves`)
    # Asynchronous rollouts (`vrl.rollouts`): the field of its section (`config.<name>.<field>`, an int) that
    # lets sampling run that many updates ahead of training; None: it samples and updates in turn. Needs
    # moves="trained" (seeded perturbations are asked for per iteration, with nothing to run ahead on).
    staleness: str | None = None
    # Trains under torchrun: rank 0 runs the loop and leads, every other rank runs `follow` (`vrl.launch`).
    ranks: bool = False
    # Learns from each task's group of samples_per_task attempts relative to the group, so a group whose raw
    # outcomes are all equal teaches nothing: dynamic sampling applies (`vrl.filtering`), and its section then
    # carries `grpo_loss.FILTER_FIELDS` and `filter_groups` (GRPO's names: verl's).
    group_relative: bool = False
    fixed_on_resume: tuple[str, ...] = ()  # fields of its section a resume may not change
    host: PolicyHost | None = None

    @classmethod
    @abstractmethod
    def from_config(cls, config: Any) -> Optimizer:
        """The rule configured for a run (a `TrainConfig`: its own section, the seed, the run length)."""

    @classmethod
    def label(cls, section: Mapping[str, Any]) -> str:
        """How `vrl report` names a run of this rule, from the run's recorded section of it (`config.<name>`):
        enough to keep runs of different methods apart in one comparison. Default: the rule's name."""
        return cls.name

    @classmethod
    def check_fits(cls, config: Any, model: Callable[[], Any] | None) -> None:
        """Refuse a run's settings this rule cannot work with, before anything loads or starts (`vrl
        train`'s preflight). `model()` builds the model's module tree without weights
        (`vrl.generate.hf.meta_model`; called only by rules that need it); None where the weights
        are elsewhere (Modal). Raises a `UsageError`: one line, what is wrong and how to fix it."""

    @classmethod
    def check_launch(cls, config: Any) -> None:
        """Refuse settings a torchrun launch of several ranks cannot train with (rules with `ranks`), on
        every rank before it joins the process group. Raises a `UsageError`: one line."""

    def needs(self) -> HostNeeds:
        """What this rule will ask of its hosts (the runtime places and sizes engines with it)."""
        return HostNeeds(self.moves)

    def setup(self, host: PolicyHost) -> None:
        """Attach to the host whose weights this optimizer moves. Called once before `ask`."""
        self.host = host

    def sampler(self, host: PolicyHost) -> PolicyHost:
        """What the loop samples from once `setup(host)` ran: `host` itself, unless the rule spreads the
        sampling over processes it leads (GRPO under torchrun with `grpo.sample_on_every_rank`)."""
        return host

    def samples_on_every_rank(self) -> bool:
        """Under torchrun: whether the ranks > 0 sample too (each then holds an engine of the run's backend;
        otherwise a rank loads the model with the in-process backend, for its weights alone)."""
        return False

    def follow(self, verification: Any = None) -> None:
        """A rank > 0 of a torchrun launch (rules with `ranks`): do what rank 0's rule tells it until the
        run stops. Called once `setup` ran. `verification`: this rank's pool of the run's verifier (a
        `vrl.runtime.base.VerificationPool`; None where the runtime verifies elsewhere), for a rule whose
        ranks sample (`samples_on_every_rank`): each rank verifies its own share (`grpo_dist.sample_calls`)."""
        raise NotImplementedError(f"{self.name} does not train under torchrun (Optimizer.ranks is False)")

    @property
    @abstractmethod
    def iteration(self) -> int:
        """Updates applied so far (after `load`: the iteration its checkpoint holds)."""

    @abstractmethod
    def ask(self) -> list[Variant]:
        """The policy variants to sample in this iteration."""

    @abstractmethod
    def tell(self, results: list[Result]) -> dict[str, float]:
        """Update from this iteration's rewarded results; return metrics to log."""

    @abstractmethod
    def samples_per_task(self) -> int:
        """Attempts per task in one iteration (all variants together): sizes verification."""

    def save(self, run_dir: Path, final: bool = False) -> None:
        """Persist what `load` needs to continue exactly (called after every iteration).

        `final`: the run stops here (Ctrl-C or an error between two updates): write even what is
        otherwise written only every k iterations.
        """

    def load(self, run_dir: Path, completed: int) -> None:
        """Restore the state saved by `save` for a run that finished `completed` iterations (resume)."""

    def finish(self) -> None:
        """The run trained all its iterations, every rank still serving (called once, before `close`, only
        then): a last check of what no later iteration would check. Raises to record the run as failed.
        Nothing by default; ES under torchrun compares the ranks' θ after the run's last update."""

    def close(self) -> None:
        """Finish what the rule does in the background (GRPO: the checkpoint being written) and release
        what it holds; called once at the end of every run, after the engines closed. Raises if that
        background work failed (the run is then recorded as failed)."""

    @classmethod
    def export(cls, run_dir: Path, config: dict[str, Any], finished: int, folder: Path,
               load: Callable[[str, str, str | None], tuple[Any, Any]]) -> dict[str, Any]:
        """Write the policy a run of this rule reached after `finished` iterations to `folder` as a Hugging
        Face model folder (`vrl export`); return what was exported (iteration, base model, ...).
        `load(name, dtype, revision)` gives a base model and its tokenizer on the export's device
        (`vrl.weights.export.ModelLoader`); `vrl.weights.export.save_model` writes the folder."""
        raise NotImplementedError
