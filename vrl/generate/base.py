"""The Generator: one sampling engine and its weights, as a `PolicyHost`."""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel

from vrl.config import Section
from vrl.policy import HostNeeds, PerturbationSpec, PolicyHost, Trainable, Unsupported, Variant, WeightsInfo, shard_seed  # noqa: F401 (shard_seed: its old home, imported from here)
from vrl.types import Completion, Task
from vrl.weights.update import Update


class Generator(PolicyHost):
    """One sampler and the weights it reads: the `PolicyHost` of a single engine.

    Backends implement `stream` (sample the weights as they are now) and `_perturbable` (the
    object that perturbs, restores and updates their weights: `FlatParams` for an in-process
    module, `EngineParams` inside a vLLM engine, `LowRankParams` / `EngineLowRank` for
    es.noise=lowrank); `sample` runs each variant in turn on them, except low-rank members, which
    share the base weights and go to the backend's `_population` all at once.

    A backend is registered by name (the `register_generators` hook) and selected with
    `generator.backend`; its `Config` is the config section `generator.<name>`, and
    `from_config` / `engines` start it for a run.
    """

    name = "generator"
    #: Its settings: the config section `generator.<name>` (a `vrl.config.Section`; none by default).
    Config: ClassVar[type[BaseModel]] = Section
    #: Whether this backend runs multi-turn episodes (`episodes`); the preflight refuses a multi-turn
    #: environment on one that cannot.
    runs_episodes: ClassVar[bool] = False
    #: Whether its engine can sample weights trained in another process (`trainable_elsewhere`): an engine
    #: driven from a process of its own (`vrl.runtime.driver`) then serves GRPO.
    trains_elsewhere: ClassVar[bool] = False
    _params: Any = None  # set by `perturbations`
    _episodes: Any = None  # set by `episodes`: a `vrl.episodes.Episodes`, for a backend that runs them

    @classmethod
    def from_config(cls, config: Any, needs: HostNeeds | None = None, *, gpu: str | None = None) -> Generator:
        """One engine for a run (a `TrainConfig`: the model, `generator.*`, its own `generator.<name>`,
        `sampling`). `needs`: what the update rule will ask of it (None: sampling only, e.g. eval);
        `gpu`: the CUDA device index to run on (None: `generator.device`)."""
        raise NotImplementedError(f"generator backend {cls.name!r} does not implement from_config")

    @classmethod
    def check_fits(cls, config: Any, needs: HostNeeds | None, model: Any) -> None:
        """Refuse, before anything loads or starts, what this backend cannot do for the update rule's
        `needs` (`model`: a callable building the weightless module tree, or None when the weights
        live elsewhere). Runs in the preflight, after the rule's own `check_fits`; nothing by default."""

    @classmethod
    def trainable_elsewhere(cls, config: Any) -> Trainable:
        """The model GRPO trains for an engine that runs in another process (`vrl.runtime.driver`): built in
        this process as the engine builds its own weights, so both start equal; the engine then samples
        only what `publish` sends it (a separate copy). Backends with `trains_elsewhere` implement it."""
        raise Unsupported(f"generator backend {cls.name!r} cannot sample weights trained in another process")

    def trained_elsewhere(self) -> None:
        """Called in the engine's process once the model GRPO trains has been built in another process
        (`trainable_elsewhere`, by a driver process's parent): from now on `publish` receives its weights
        from there. Nothing by default; vLLM starts returning sampling log-probs, as `trainable` does."""

    @classmethod
    def engines(cls, config: Any, needs: HostNeeds | None, gpus: Sequence[str | None]) -> list[Generator]:
        """One engine per entry of `gpus` (a GPU index, repeated where engines share a GPU; None: the
        default device), for the local runtime's `runtime.local.engines`. A backend whose engines share
        something (a model written to disk once, a split of GPU memory) overrides this."""
        hosts: list[Generator] = []
        try:
            for gpu in gpus:
                hosts.append(cls.from_config(config, needs, gpu=gpu))
        except BaseException:
            for host in hosts:
                host.close()
            raise
        return hosts

    @abstractmethod
    def stream(
        self, tasks: Sequence[Task], n: int = 1, variant: int = 0, seed: int | None = None
    ) -> Iterator[list[Completion]]:
        """Yield completions (n per task, tagged with `variant`) one generation batch at a time.

        Task `i`'s samples are seeded from `seed + i·n` on, so a shard `tasks[s:]` sampled with
        `seed + s·n` gives what the whole list gives (`shard_seed`).
        """

    def generate(
        self, tasks: Sequence[Task], n: int = 1, variant: int = 0, seed: int | None = None
    ) -> list[Completion]:
        """All completions for `tasks`, in task order, n per task."""
        return [c for batch in self.stream(tasks, n=n, variant=variant, seed=seed) for c in batch]

    def sample(self, tasks: Sequence[Task], variants: Sequence[Variant], seed: int | None = None
               ) -> Iterator[list[Completion]]:
        """Each variant in turn: perturb (seeded variants), stream, restore (bit-exact). With
        es.noise=lowrank the unperturbed variants go in turn, then every member in one `_population`."""
        members = [v for v in variants if v.seed is not None]
        batched = self._params is not None and self._spec.noise == "lowrank" and bool(members)
        for v in [v for v in variants if v.seed is None] if batched else variants:
            with self.applied(v):
                yield from self.stream(tasks, n=v.samples_per_task, variant=v.index, seed=seed)
        if batched:
            if any(v.sign not in (1, -1) for v in members):
                raise ValueError(f"variant signs must be +1 or -1, got {[v.sign for v in members]}")
            yield from self._population(tasks, members, seed)

    def _population(self, tasks: Sequence[Task], members: Sequence[Variant], seed: int | None
                    ) -> Iterator[list[Completion]]:
        """Every low-rank member (signs checked) on `tasks` at once, seeded per task position as `stream` is."""
        raise Unsupported(f"{self.name} cannot sample low-rank members")

    @contextlib.contextmanager
    def applied(self, variant: Variant) -> Iterator[None]:
        """The weights are `variant`'s inside the block and θ again after it (also on errors)."""
        if variant.seed is None:
            yield
            return
        params, spec = self._perturbation_state()
        if variant.sign not in (1, -1):
            raise ValueError(f"variant {variant.index} has sign {variant.sign}; use +1 or -1")
        import torch  # here, not at the top: `vrl plugins` imports the backends and must not load torch

        try:
            with torch.no_grad():
                params.perturb(variant.seed, variant.sign, spec.sigma)
            yield
        finally:
            params.restore()

    # -- seeded perturbations ---------------------------------------------------------------------
    def perturbations(self, spec: PerturbationSpec) -> WeightsInfo:
        # The backend's `_perturbable` refuses a noise mode it does not support (Unsupported).
        self._params, self._spec = self._perturbable(spec), spec
        return WeightsInfo(tuple(self._params.names), int(self._params.numel), self._params.dtype)

    def _perturbable(self, spec: PerturbationSpec) -> Any:
        """The backend's perturbable weights for `spec` (`FlatParams` or an equivalent)."""
        raise Unsupported(f"{self.name} cannot apply seeded perturbations")

    def _perturbation_state(self) -> tuple[Any, PerturbationSpec]:
        if self._params is None:
            raise RuntimeError(f"{self.name}: call perturbations(spec) before sampling seeded variants")
        return self._params, self._spec

    def update(self, update: Update) -> None:
        import torch  # see `applied`

        params, _ = self._perturbation_state()
        with torch.no_grad():
            params.update(update)

    def state(self) -> dict[str, Any]:
        return self._perturbation_state()[0].state()

    def checksum(self) -> str:
        return self._perturbation_state()[0].checksum()

    def load_state(self, state: dict[str, Any]) -> None:
        import torch  # see `applied`

        with torch.no_grad():
            self._perturbation_state()[0].load_state(state)


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` up to and including the earliest stop string, and whether one was found."""
    stopped = False
    for stop in stops:
        cut = text.find(stop)
        if cut >= 0:
            text, stopped = text[: cut + len(stop)], True
    return text, stopped


def tokens_covering(tokenizer: Any, ids: list[int], text: str) -> list[int]:
    """The shortest prefix of `ids` whose decoding is at least `text` long (binary search).

    Used after a stop string cut the text, so the token ids (what GRPO trains on) end where the
    text ends, whatever the backend's stop detection did.
    """
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= len(text):
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo]
