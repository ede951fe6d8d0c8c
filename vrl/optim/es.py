"""Evolution Strategies (Qiu et al. 2025, "Evolution Strategies at Scale", arXiv 2509.24372).

One iteration, read top to bottom in `ES`:

1. `ask`: N members, each a seed (antithetic: N/2 seeds, each used with sign +1 and -1).
2. sampling (not here: the `PolicyHost` that holds the weights): member i is sampled from
   cast(θ + σ·signᵢ·ε(seedᵢ)), and the weights are cast(θ) again afterwards (bit-exact).
3. `tell`: member reward Rᵢ = mean shaped reward of its results; zᵢ = normalise(R) (z-score, rank or
   per-task group, averaged over the tasks that carry signal), rounded to 4 decimals;
   θ ← θ + α·(1/N)·Σᵢ zᵢ·signᵢ·ε(seedᵢ) (the paper's convention: 1/σ folded into α; default α = σ/2).

θ is an fp32 master copy of the selected parameters, kept by the host (`PolicyHost.perturbations`)
next to the weights it samples from, on every copy; ES only sends it seeds and coefficients, as a
typed update (`iteration_update`: a `FullRankUpdate`; with es.noise=lowrank, ε is replaced by the
low-rank σ·A·Bᵀ/√r of `vrl.weights.factors` and the update is a `LowRankUpdate` of integer
multipliers). Noise is never stored: ε is a pure function of (seed, parameter name, element index)
(`vrl.weights.noise`), identical on CPU and GPU. The whole training state is therefore
the base model reference plus the list of (seed, z) per iteration: `es_history.json` in the run
directory. `replay` rebuilds θ_t from θ₀ bit for bit; optional snapshots every K iterations bound the
replay.

Under torchrun (`ES.ranks`; docs/es.md "ES on many machines") every rank holds an engine and its own
θ. Rank 0 runs the loop; the members of an iteration are dealt over the ranks (`grpo_dist.RankHosts`,
the seeds of one process), each rank verifies its own attempts and sends rank 0 their verdicts, and
every rank applies the same `iteration_update` of rank 0's record; a fingerprint of θ
(`PolicyHost.checksum`), read after every update and sent with the next share, turns ranks that drift
apart into a one-line error before anything sampled from the drifted θ is recorded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vrl import distributed
from vrl.fileio import atomic_path, write_text
from vrl.filtering import same
from vrl.optim.base import Optimizer
from vrl.policy import HostNeeds, PerturbationSpec, PolicyHost, Variant, share_needs
from vrl.reward import judged
from vrl.types import Result
from vrl.weights import noise as nz
from vrl.weights.exact import MAX_RANK
from vrl.weights.update import FullRankUpdate, LowRankUpdate, Update

# torch and the weights layer's tensor code are imported in the functions that use them: the
# registry imports this module for `ES.Config`, and `vrl plugins` must not load torch (issue 28).
if TYPE_CHECKING:
    from vrl.weights.export import ModelLoader
    from vrl.weights.flat import FlatParams
    from vrl.weights.lowrank import LowRankParams

log = logging.getLogger(__name__)

HISTORY_FILE = "es_history.json"
SNAPSHOT_DIR = "es_snapshots"
HISTORY_FORMAT = "vrl-es-history"
HISTORY_VERSION = 1
Z_DECIMALS = 4
RANK_TIMEOUT_S = 3600.0
"""Under torchrun: how long rank 0 waits for another rank's share of a sampling pass or its checksum
beyond its own (a rank that died is reported at once; this bounds one that hangs)."""


class ESConfig(BaseModel):
    """Evolution Strategies settings."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    population_size: int = Field(30, ge=2, description="Members N per iteration (even when antithetic).")
    sigma: float = Field(1e-3, gt=0, description="Perturbation scale σ (standard deviation of each weight's noise).")
    alpha: float | None = Field(
        None, gt=0, description="Step size α in θ ← θ + α·(1/N)·Σ zᵢεᵢ; default σ/2 (the paper's convention)."
    )
    normalization: Literal["zscore", "rank", "group"] = Field(
        "zscore",
        description="How member rewards become weights zᵢ: 'zscore' (R−mean)/std; 'rank' centred ranks in "
        "[−0.5, 0.5]; 'group' z-score among members per task, then averaged over the tasks whose members' rewards "
        "differ (a task every member scores the same carries no signal and does not shrink the step).",
    )
    antithetic: bool = Field(False, description="Sample members in ± pairs sharing one seed (N/2 seeds).")
    include: list[str] = Field(
        default_factory=lambda: ["*"],
        description="fnmatch patterns of parameter names to perturb and train, e.g. 'model.layers.1*'.",
    )
    exclude: list[str] = Field(
        default_factory=list, description="fnmatch patterns of parameter names to leave untouched, e.g. '*embed*'."
    )
    snapshot_every: int = Field(
        0, ge=0, description="Write the fp32 weights every K iterations so resume replays at most K; 0: never."
    )
    noise: Literal["full", "lowrank"] = Field(
        "full",
        description="'full': every selected weight gets its own noise (members run one after another); 'lowrank': "
        "each selected linear-layer matrix gets σ·A·Bᵀ/√r (EGGROLL), so all members share the base weights "
        "and run as one batch (hf: one batched forward; vllm: one generation pass, members in LoRA slots).",
    )
    rank: int = Field(
        8, ge=1, le=MAX_RANK, description="Rank r of each member's perturbation A·Bᵀ (with noise=lowrank)."
    )
    max_lost_share: float = Field(
        0.1, ge=0, lt=1, description="Members that came back with no result (their remote call failed after its "
        "retries) are dropped, with their antithetic partner, and the step is the one of the members that "
        "answered; more than this share of N lost fails the iteration.")

    @model_validator(mode="after")
    def _check(self) -> ESConfig:
        if self.antithetic and self.population_size % 2:
            raise ValueError(f"antithetic sampling needs an even population_size, got {self.population_size}")
        if self.noise == "full" and self.rank != type(self).model_fields["rank"].default:
            raise ValueError("rank only applies to low-rank noise; set es.noise=lowrank or remove es.rank")
        if not self.include:
            raise ValueError("include must name at least one parameter pattern, e.g. ['*']")
        return self

    @property
    def step_size(self) -> float:
        """α, resolved (σ/2 when unset)."""
        return self.alpha if self.alpha is not None else self.sigma / 2


# -- the checkpoint ------------------------------------------------------------------------------------


class BaseModelRef(BaseModel):
    """Which weights θ₀ are: replay starts from exactly these."""

    model: str
    revision: str | None = None
    dtype: str | None = None


class IterationRecord(BaseModel):
    """One iteration: member i used seed `seed + i` (antithetic: `seed + i//2`, sign (−1)**i) and weight z[i];
    `lost`: members dropped for want of a result (the step is over the others, as if N were smaller)."""

    seed: int
    z: list[float]
    lost: list[int] = Field(default_factory=list)


class ESHistory(BaseModel):
    """The whole ES training state (about 250 bytes per iteration at N=30)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["vrl-es-history"] = HISTORY_FORMAT
    version: int = HISTORY_VERSION
    noise: str = nz.NOISE_VERSION
    base: BaseModelRef
    sigma: float
    alpha: float
    population_size: int
    antithetic: bool
    normalization: str
    include: list[str]
    exclude: list[str]
    # es.noise and es.rank (histories written before low-rank ES lack them: full-rank)
    perturbation: Literal["full", "lowrank"] = "full"
    rank: int | None = None
    iterations: list[IterationRecord] = Field(default_factory=list)

    def to_json(self) -> str:
        """Compact JSON with one iteration per line (diff-friendly, ~250 bytes per line)."""
        head = self.model_dump(mode="json", exclude={"iterations"})
        lines = [json.dumps(r.model_dump(mode="json", exclude_defaults=True), separators=(",", ":"))
                 for r in self.iterations]
        body = ",\n  ".join(lines)
        return json.dumps(head, indent=1)[:-2] + ',\n "iterations": [\n  ' + body + "\n ]\n}\n"

    @classmethod
    def read(cls, path: Path) -> ESHistory:
        """Load and check an es_history.json."""
        try:
            history = cls.model_validate_json(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read ES history {path}: {exc}") from exc
        if history.noise != nz.NOISE_VERSION:
            raise ValueError(
                f"{path} was written with noise scheme {history.noise!r}; this vrl implements {nz.NOISE_VERSION!r}. "
                "Replay it with the vrl version that wrote it."
            )
        return history

    def digest(self, iterations: int) -> str:
        """Fingerprint of the first `iterations` records (ties a snapshot to the history it came from)."""
        data = json.dumps([r.model_dump(mode="json", exclude_defaults=True) for r in self.iterations[:iterations]],
                          separators=(",", ":"))
        return hashlib.sha256(data.encode()).hexdigest()


def member_seeds(record: IterationRecord, antithetic: bool) -> list[tuple[int, int]]:
    """(seed, sign) of each member of an iteration."""
    if antithetic:
        return [(record.seed + i // 2, 1 if i % 2 == 0 else -1) for i in range(len(record.z))]
    return [(record.seed + i, 1) for i in range(len(record.z))]


def kept_members(record: IterationRecord, antithetic: bool) -> tuple[list[tuple[int, int]], list[float]]:
    """(seed, sign) and z of the members an iteration's step is made of (all but the `lost` ones)."""
    lost = set(record.lost)
    members = member_seeds(record, antithetic)
    kept = [i for i in range(len(record.z)) if i not in lost]
    return [members[i] for i in kept], [record.z[i] for i in kept]


def update_terms(record: IterationRecord, antithetic: bool, alpha: float) -> FullRankUpdate:
    """The full-rank update Σᵢ (α/N)·zᵢ·signᵢ·ε(seedᵢ) of one iteration: (seed, coefficient of the
    integer noise) terms, one per seed (`FullRankUpdate.from_members`); N counts the members kept."""
    return FullRankUpdate.from_members(*kept_members(record, antithetic), alpha)


# -- reward normalisation ---------------------------------------------------------------------------


def normalize(rewards: Sequence[float], method: str, per_task: Sequence[Sequence[float]] | None = None) -> list[float]:
    """Member weights zᵢ from member rewards; all zero when the rewards carry no ranking signal.

    Plain float64 arithmetic (`math.fsum`, correctly rounded), no torch: the detached orchestrator calls
    this and keeps no weights, so its container does not import torch for it (1-2 CPU-seconds of every
    orchestrator's cold start, on Modal as in the emulator)."""
    values = [float(x) for x in rewards]
    if method == "zscore":
        return _zscore(values)
    if method == "rank":
        if len(values) < 2 or all(v == values[0] for v in values):
            return [0.0] * len(values)
        # Average ranks for ties, centred to [−0.5, 0.5] (OpenAI-ES "centered ranks").
        ranks = [0.0] * len(values)
        order = sorted(range(len(values)), key=lambda i: values[i])
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                ranks[order[k]] = (i + j) / 2
            i = j + 1
        return [rank / (len(values) - 1) - 0.5 for rank in ranks]
    if method == "group":
        if per_task is None:
            raise ValueError("group normalisation needs per-task member rewards")
        rows = [[float(x) for x in row] for row in per_task]  # members × tasks
        if len({len(row) for row in rows}) > 1:
            raise ValueError("group normalisation needs the same tasks for every member")
        # Each task's column, normalised; a constant column (all zeros) carries no signal, so the mean is over
        # the tasks that do: tasks every member solves or fails do not shrink the step (issue 58).
        by_task = [z for z in (_zscore(list(column)) for column in zip(*rows)) if any(z)]
        return [math.fsum(z[m] for z in by_task) / len(by_task) if by_task else 0.0 for m in range(len(rows))]
    raise ValueError(f"unknown ES normalization {method!r}; choose zscore, rank or group")


def informative_share(per_task: Sequence[Sequence[float]]) -> float:
    """The share of an iteration's tasks on which the members' rewards differ (members × tasks), i.e. that
    carry signal for the update; 0.0 with no tasks."""
    columns = list(zip(*per_task))
    return sum(any(_zscore(list(c))) for c in columns) / len(columns) if columns else 0.0


def _zscore(values: list[float]) -> list[float]:
    """(x − mean) / std (population std); all zero when the values are equal (up to float64 noise:
    0.1 + 0.2 and 0.3 are one value, `vrl.filtering.same`) or not all finite."""
    if not values or not all(math.isfinite(v) for v in values) or all(same(v, values[0]) for v in values):
        return [0.0] * len(values)
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    return [(v - mean) / std for v in values] if std > 0 else [0.0] * len(values)


def iteration_update(history: ESHistory, record: IterationRecord) -> Update:
    """The update `PolicyHost.update` takes for one iteration of `history`, in its noise mode.

    Full-rank: `update_terms`, a `FullRankUpdate` of (seed, coefficient) terms. Low-rank: the
    iteration's `LowRankUpdate` (seed, integer multiplier) terms and one coefficient. A host set up
    for the other mode refuses it; across processes it travels as its `to_wire` data.
    """
    if history.perturbation == "lowrank":
        if history.rank is None:
            raise ValueError("a low-rank ES history needs its rank")
        return LowRankUpdate.from_members(*kept_members(record, history.antithetic), history.alpha, history.rank)
    return update_terms(record, history.antithetic, history.alpha)


#: Seconds between the progress lines of a long replay (on 2 CPU cores, 72-80 s an iteration for a 135M model
#: with 30 members: the noise of every member is regenerated).
REPLAY_REPORT_S = 10.0


def replay(history: ESHistory, target: PolicyHost | FlatParams | LowRankParams, start: int = 0,
           stop: int | None = None) -> None:
    """Apply the updates of iterations [start, stop) of `history` to `target` (θ_start → θ_stop):
    a host (every copy of its weights), one `FlatParams` (full-rank) or one `LowRankParams` (low-rank)."""
    flat = _instance(target, "vrl.weights.flat", "FlatParams")
    lowrank = _instance(target, "vrl.weights.lowrank", "LowRankParams")
    if flat and history.perturbation != "full":
        raise ValueError("this history used low-rank noise; replay it onto LowRankParams or a host set up for es.noise=lowrank")
    if lowrank and history.perturbation != "lowrank":
        raise ValueError("this history used full-rank noise ('full'); replay it onto FlatParams or a host set up "
                         "for es.noise=full")
    if lowrank and history.rank != target.rank:
        raise ValueError(f"this history used rank {history.rank}; these parameters are low-rank with rank {target.rank}")
    records = history.iterations[start:stop]
    if len(records) > 1:
        log.info("ES: rebuilding θ: replaying %d iterations of %d members", len(records), history.population_size)
    began = last = time.monotonic()
    with _no_grad():
        for done, record in enumerate(records, 1):
            target.update(iteration_update(history, record))
            now = time.monotonic()
            if now - last >= REPLAY_REPORT_S and done < len(records):  # a long replay (a CPU, a big model) shows it moves
                log.info("ES: replayed %d of %d iterations (%.0f s)", done, len(records), now - began)
                last = now


def _instance(target: Any, module: str, name: str) -> bool:
    """isinstance(target, module.name), without importing `module` (the weights layer imports torch): an
    object of a class whose module was never imported cannot be one."""
    import sys

    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(target, getattr(loaded, name))


def _no_grad() -> Any:
    """`torch.no_grad()` where torch is loaded. A process that never imported torch holds no tensors (the
    detached Modal orchestrator's ES policy keeps no weights: its updates go to the workers), so there is
    nothing to guard there, and a resumed orchestrator does not import torch for it."""
    import contextlib
    import sys

    torch = sys.modules.get("torch")
    return torch.no_grad() if torch is not None else contextlib.nullcontext()


# -- the optimizer ------------------------------------------------------------------------------------


class ES(Optimizer):
    """Evolution Strategies behind the ask/tell contract; state = `ESHistory`."""

    name = "es"
    Config = ESConfig
    moves = "perturbations"
    ranks = True  # under torchrun every rank samples its members and applies the same update (module docstring)
    fixed_on_resume = ("population_size", "sigma", "alpha", "normalization", "antithetic", "include", "exclude",
                       "noise", "rank")

    @classmethod
    def label(cls, section: Mapping[str, Any]) -> str:
        """Low-rank runs say so, with their rank: full-rank and low-rank ES stay apart in a report."""
        if section.get("noise") == "lowrank":
            return f"{cls.name} lowrank r={section.get('rank', '?')}"
        return cls.name

    @classmethod
    def check_fits(cls, config: Any, model: Callable[[], Any] | None) -> None:
        """es.include / es.exclude select something this noise mode moves, and that the backend serves:
        a typo fails here in a second, not after an engine has started."""
        if model is None:
            return
        from vrl.weights.flat import select_parameters
        from vrl.weights.lowrank import select_linear

        es, tree = config.es, model()
        if es.noise != "lowrank":
            select_parameters(tree, es.include, es.exclude)
            return
        select_linear(tree, es.include, es.exclude, report=False)  # what a backend serves: its `check_fits`

    def __init__(self, config: ESConfig, seed: int = 0, base: dict[str, Any] | None = None, granule: int = 1):
        """`granule`: the hosts' batch size; under torchrun, task shards dealt to ranks start at its multiples."""
        self.config, self.seed = config, seed
        self.base = dict(base or {"model": "unknown"})
        self.granule = granule
        self.host: PolicyHost | None = None
        self.history: ESHistory | None = None
        self._variants: list[Variant] | None = None
        self.group = None  # the ranks of a torchrun launch (`vrl.optim.grpo_dist.Group`), None on one process
        self._verification: Any = None  # a rank > 0: its verification pool (`follow`)
        self._checksum: str | None = None  # under torchrun: θ's fingerprint since the last update (`_fingerprint`)

    @classmethod
    def from_config(cls, config: Any) -> ES:
        return cls(config.es, seed=config.seed, base={"model": config.model, "revision": config.generator.revision},
                   granule=config.sampling.batch_size)

    # -- several ranks (torchrun) ----------------------------------------------------------------------
    @classmethod
    def check_launch(cls, config: Any) -> None:
        """Each rank samples on one engine of the local runtime, on its own GPU (LOCAL_RANK)."""
        from vrl.errors import UsageError

        if config.runtime.kind != "local":
            raise UsageError(f"ES under torchrun samples on each rank's own engine: runtime.kind={config.runtime.kind} "
                             "cannot run under torchrun; use runtime.kind=local, or start it without torchrun")
        local = config.runtime.local
        if local.engines > 1 or local.gpus:
            raise UsageError("ES under torchrun runs one engine per rank, on the rank's own GPU: start one rank per "
                             "GPU (torchrun --nproc-per-node K) instead of setting runtime.local.engines / "
                             "runtime.local.gpus")

    def samples_on_every_rank(self) -> bool:
        return True

    def sampler(self, host: PolicyHost) -> PolicyHost:
        """Under torchrun: every rank's host as one (`grpo_dist.RankHosts`: the members dealt over the
        ranks with one process's seeds, the attempts gathered to rank 0); otherwise `host`."""
        if self.group is None:
            return host
        from vrl.optim.grpo_dist import RankHosts

        return RankHosts(host, self.group, granule=self.granule, check=self._compare)

    def follow(self, verification: Any = None) -> None:
        """A rank > 0: sample and verify its share, apply rank 0's updates, rebuild θ on resume, until rank 0 stops."""
        if self.group is None:
            raise RuntimeError("ES.follow runs on ranks > 0 of a torchrun launch")
        self._verification = verification
        self.group.serve(lambda command, *args: getattr(self, f"_follow_{command}")(*args))

    def _follow_sample_share(self, work: list[Any]) -> None:
        """This rank's members, verified here (`grpo_dist.sample_calls`), to rank 0, with the fingerprint of
        the θ they were sampled from (`_compare`). ES learns from rewards alone: the token ids stay here, so
        only text, counts and verdicts travel."""
        from vrl.optim.grpo_dist import sample_calls, send_share

        share = sample_calls(self.host, work[self.group.rank], self._verification)
        for c in share if isinstance(share, list) else ():
            c.prompt_token_ids = c.token_ids = c.logprobs = c.token_mask = None
        send_share(self.group, share, self._fingerprint())

    def _follow_apply(self, record: IterationRecord) -> None:
        self._apply(record)

    def _follow_agree(self, when: str) -> None:
        self._agree(when, fresh=False)

    def _follow_resume(self, history: str) -> None:
        """θ rebuilt from rank 0's history (replayed from θ₀: rank 0's snapshots may be on another node)."""
        saved = ESHistory.model_validate_json(history)
        self._check_compatible(saved, self.history)
        replay(saved, self.host)
        self.history = saved
        self._agree("resuming")

    def _apply(self, record: IterationRecord) -> None:
        """θ ← θ + the update of `record` on this rank; under torchrun, also θ's fingerprint (`_compare`). On
        a rank > 0 that read of θ runs while rank 0 records the iteration: off the loop's path."""
        host, history = self._require_setup()
        host.update(iteration_update(history, record))
        history.iterations.append(record)
        self._checksum = host.checksum() if self.group is not None else None

    def _fingerprint(self) -> str:
        """θ's checksum on this rank (`PolicyHost.checksum`), read once per update."""
        if self._checksum is None:
            self._checksum = self.host.checksum()
        return self._checksum

    def _compare(self, sums: list[str]) -> None:
        """Rank 0, on receiving the other ranks' shares (`RankHosts`' check): each was sampled from a θ whose
        fingerprint must be rank 0's, else the run stops before anything sampled from it is recorded. The
        fingerprints ride with the shares, so agreeing costs no round trip after the update; the last
        update of a run, which no share follows, is compared by `finish`."""
        n = self.iteration
        self._differ(self._fingerprint(), sums, f"iteration {n - 1}" if n else "loading the model")

    def finish(self) -> None:
        """Rank 0, the run's iterations all trained: every rank's fingerprint of θ after the last update
        (no share follows it) compared in one round trip, so a rank that applied it wrongly fails the run
        in one line instead of ending it silently apart (its θ is what the run would export)."""
        if self.group is not None and self.iteration:
            when = f"iteration {self.iteration - 1}, the run's last"
            self.group.send("agree", when)
            self._agree(when, fresh=False)

    def _agree(self, when: str, fresh: bool = True) -> None:
        """Every rank's θ fingerprint to rank 0 now (a round trip: on resuming, where `fresh` reads θ anew,
        and at the run's end, where each rank's read after the last update stands)."""
        if fresh:
            self._checksum = None
        sums = self.group.gather(self._fingerprint())
        if sums is not None:
            self._differ(sums[0], sums[1:], when)

    @staticmethod
    def _differ(mine: str, sums: list[str], when: str) -> None:
        """Stop the run in one line naming the first rank (1, 2, ...) whose θ fingerprint is not `mine`."""
        for rank, s in enumerate(sums, start=1):
            if s != mine:
                raise RuntimeError(f"rank {rank}'s weights differ from rank 0's after {when} (θ checksum {s} != "
                                   f"{mine}): the ranks drifted apart; the run stops before recording anything "
                                   "sampled from them (resume rebuilds every rank's θ from the history)")

    def stop_followers(self) -> None:
        """Rank 0: end the other ranks' `follow` (once; nothing on one process)."""
        if self.group is not None:
            self.group.stop()

    def close(self) -> None:
        """Under torchrun, on every rank: release the others (rank 0), then the process group."""
        if self.group is not None:
            group = self.group
            try:
                self.stop_followers()
            finally:
                self.group = None
                group.close()

    def spec(self) -> PerturbationSpec:
        """The perturbations this run's members are (what `setup` declares to the host)."""
        c = self.config
        rank = c.rank if c.noise == "lowrank" else 0
        return PerturbationSpec(tuple(c.include), tuple(c.exclude), c.sigma, noise=c.noise, rank=rank)

    def needs(self) -> HostNeeds:
        """What this process's host is asked. Under torchrun each rank samples its share of the members
        (`deal` over the ranks), so its engine is sized for that share: a vLLM engine's LoRA kernels launch
        work for every slot it has, used or not."""
        return share_needs(HostNeeds(self.moves, self.spec(), variants=self.config.population_size),
                           distributed.world_size())

    def setup(self, host: PolicyHost) -> None:
        """Have the host select the parameters and keep θ₀ (an fp32 master) of them; start the history."""
        super().setup(host)
        c = self.config
        info = host.perturbations(self.spec())
        if c.snapshot_every and not info.exportable:
            raise ValueError(
                f"es.snapshot_every needs the weights in this process, but {host.name} keeps them on its workers "
                "(which rebuild θ from the history and stay warm across iterations). Set es.snapshot_every=0."
            )
        self.info = info
        self.history = self._new_history(info.dtype)
        if distributed.world_size() > 1 and self.group is None:
            import torch

            from vrl.optim.grpo_dist import Group

            # Only Python objects travel (work, attempts, records, checksums): gloo on CPU, whatever the engines.
            self.group = Group(torch.device("cpu"), RANK_TIMEOUT_S)
        log.info("ES: %d tensors, %d parameters selected", len(info.names), info.numel)

    def _new_history(self, dtype: str) -> ESHistory:
        """An empty history of this run's settings, over base weights of `dtype`."""
        c = self.config
        return ESHistory(
            base=BaseModelRef(**{**self.base, "dtype": dtype}),
            sigma=c.sigma,
            alpha=c.step_size,
            population_size=c.population_size,
            antithetic=c.antithetic,
            normalization=c.normalization,
            include=list(c.include),
            exclude=list(c.exclude),
            perturbation=c.noise,
            rank=c.rank if c.noise == "lowrank" else None,
        )

    def _require_setup(self) -> tuple[PolicyHost, ESHistory]:
        if self.host is None or self.history is None:
            raise RuntimeError("call ES.setup(host) before ask/tell")
        return self.host, self.history

    @property
    def iteration(self) -> int:
        """Completed iterations."""
        return len(self._require_setup()[1].iterations)

    def samples_per_task(self) -> int:
        return self.config.population_size

    def iteration_seed(self, iteration: int) -> int:
        """Base member seed of an iteration: a pure function of the run seed, so resume asks the same."""
        digest = hashlib.blake2b(f"vrl-es-seed:{self.seed}:{iteration}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 33  # < 2**31: room for + N, still one 32-bit word

    def ask(self) -> list[Variant]:
        """N members of this iteration (seeds derived from the run seed and the iteration)."""
        n = self.config.population_size
        record = IterationRecord(seed=self.iteration_seed(self.iteration), z=[0.0] * n)
        self._variants = [
            Variant(index=i, seed=seed, sign=sign) for i, (seed, sign) in enumerate(member_seeds(record, self.config.antithetic))
        ]
        return self._variants

    def tell(self, results: list[Result]) -> dict[str, float]:
        """Normalise member rewards, update θ, append the iteration to the history."""
        host, history = self._require_setup()
        if self._variants is None:
            raise RuntimeError("ES.tell() called without a preceding ask()")
        n = len(self._variants)
        by_member: list[list[Result]] = [[] for _ in range(n)]
        for r in results:
            if not 0 <= r.completion.variant < n:
                raise ValueError(f"result for variant {r.completion.variant}, but this iteration has members 0..{n - 1}")
            by_member[r.completion.variant].append(r)
        # A verifier error (a reward function or judge that failed) is no score: left out of its member's fitness.
        scored = [[r for r in rs if judged(r.verdict)] for rs in by_member]
        lost = self._lost([i for i, rs in enumerate(scored) if not rs], n)
        kept = [rs for i, rs in enumerate(by_member) if i not in lost]
        rewards = [sum(r.reward for r in rs) / len(rs) for i, rs in enumerate(scored) if i not in lost]
        per_task = None
        if self.config.normalization == "group":
            task_ids = sorted({r.task.id for r in results})
            per_task = [_task_means(rs, task_ids) for rs in kept]
        weights = iter(normalize(rewards, self.config.normalization, per_task))
        signal = {"es/informative_task_frac": informative_share(per_task)} if per_task is not None else {}
        z = [0.0 if i in lost else round(next(weights), Z_DECIMALS) + 0.0 for i in range(n)]
        record = IterationRecord(seed=self._variants[0].seed, z=z, lost=sorted(lost))
        if self.group is not None:
            self.group.send("apply", record)  # every rank applies the same update
        self._apply(record)
        self._variants = None
        mean = sum(rewards) / len(rewards)
        return {
            "es/member_reward_mean": mean,
            "es/member_reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
            "es/member_reward_max": max(rewards),
            "es/member_reward_min": min(rewards),
            "es/lost_members": float(len(lost)),
            **signal,
        }

    def _lost(self, missing: list[int], n: int) -> set[int]:
        """The members to drop: those with no result and, antithetic, their partners (one side of a pair
        alone would bias the step). Refused above `max_lost_share` of N, or when fewer than two remain."""
        lost = set(missing)
        if self.config.antithetic:
            lost |= {i ^ 1 for i in missing}  # pairs are (0, 1), (2, 3), ...: they share a seed
        if lost and (len(lost) > self.config.max_lost_share * n or n - len(lost) < 2):
            raise ValueError(f"ES members {missing} have no results (their generation failed, or the verifier failed on "
                             f"each): {len(lost)} of {n} "
                             f"members lost is more than es.max_lost_share={self.config.max_lost_share}; raise it, or "
                             "fix what failed and resume")
        return lost

    # -- persistence ----------------------------------------------------------------------------------
    def save(self, run_dir: Path, final: bool = False) -> None:
        """Write es_history.json (atomically), and a snapshot every `snapshot_every` iterations."""
        _, history = self._require_setup()
        run_dir = Path(run_dir)
        write_text(run_dir / HISTORY_FILE, history.to_json())
        k = self.config.snapshot_every
        if k and self.iteration % k == 0 and self.iteration:
            self._save_snapshot(run_dir)

    def load(self, run_dir: Path, completed: int) -> None:
        """Rebuild θ_t for the run's t = `completed` iterations: latest valid snapshot, then replay."""
        host, _ = self._require_setup()
        start = self._rebuild(host, Path(run_dir), completed)
        if self.group is not None:
            self.group.send("resume", self.history.to_json())
            self._agree("resuming")
        self.replayed_from = start  # the snapshot's iteration (0: replayed from θ₀)
        self._variants = None
        log.info("ES: resumed at iteration %d (snapshot %d, replayed %d)", completed, start, completed - start)

    def _rebuild(self, target: PolicyHost | FlatParams | LowRankParams, run_dir: Path, completed: int) -> int:
        """θ_completed onto `target` from the run's history (checked against this run's settings): the
        newest matching snapshot, then replay. Keeps the history; returns the snapshot's iteration."""
        saved = ESHistory.read(run_dir / HISTORY_FILE)
        self._check_compatible(saved, self.history)
        if len(saved.iterations) < completed:
            raise ValueError(
                f"{run_dir / HISTORY_FILE} has {len(saved.iterations)} iterations but the run finished {completed}; "
                "the history is incomplete, so the weights cannot be rebuilt"
            )
        saved.iterations = saved.iterations[:completed]  # an update saved after the last finished iteration
        start = self._load_snapshot(target, run_dir, saved, completed)
        replay(saved, target, start)
        self.history = saved
        return start

    @classmethod
    def export(cls, run_dir: Path, config: dict[str, Any], finished: int, folder: Path, load: ModelLoader
               ) -> dict[str, Any]:
        """The base model with θ rebuilt exactly as a resume does (newest matching snapshot, then replay),
        onto the weights layer's view of the model (no host)."""
        from vrl.weights.export import save_model
        from vrl.weights.lowrank import perturbable

        history = ESHistory.read(Path(run_dir) / HISTORY_FILE)
        base = history.base
        dtype = base.dtype if base.dtype in ("float32", "bfloat16", "float16") else config["generator"]["dtype"]
        model, tokenizer = load(base.model, dtype, base.revision)
        es = cls(ESConfig.model_validate(config["es"]), seed=config["seed"],
                 base={"model": config["model"], "revision": config["generator"].get("revision")})
        params = perturbable(model, es.spec())
        es.history = es._new_history(params.dtype)
        replayed_from = es._rebuild(params, Path(run_dir), finished)
        save_model(model, tokenizer, folder)
        return {"optimizer": cls.name, "iteration": finished, "base_model": base.model, "dtype": dtype,
                "replayed_from": replayed_from}

    def _check_compatible(self, saved: ESHistory, current: ESHistory) -> None:
        fields = ("base", "sigma", "alpha", "population_size", "antithetic", "normalization", "include", "exclude",
                  "perturbation", "rank")
        for f in fields:
            if getattr(saved, f) != getattr(current, f):
                setting = {"perturbation": "noise"}.get(f, f)
                raise ValueError(
                    f"cannot resume: the run's ES history has {f}={getattr(saved, f)!r} but this run has "
                    f"{getattr(current, f)!r}; resume with the recorded settings (es.{setting} / model / generator)"
                )

    def _save_snapshot(self, run_dir: Path) -> None:
        from safetensors.torch import save_file

        host, history = self._require_setup()
        folder = run_dir / SNAPSHOT_DIR
        folder.mkdir(exist_ok=True)
        t = self.iteration
        path = folder / f"iter-{t:06d}.safetensors"
        meta = {"iteration": str(t), "noise": nz.NOISE_VERSION, "digest": history.digest(t)}
        with atomic_path(path) as tmp:
            save_file(host.state(), str(tmp), metadata=meta)
        # Keep two: the newest may be ahead of state.json if the run stops between the two writes.
        for old in sorted(folder.glob("iter-*.safetensors"))[:-2]:
            old.unlink()

    def _load_snapshot(self, target: PolicyHost | FlatParams | LowRankParams, run_dir: Path, history: ESHistory,
                       completed: int) -> int:
        snapshots = sorted((run_dir / SNAPSHOT_DIR).glob("iter-*.safetensors"), reverse=True)
        if not snapshots:  # (torch is imported only to read one: a detached orchestrator keeps none)
            return 0
        import torch
        from safetensors import safe_open
        from safetensors.torch import load_file

        for path in snapshots:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            t = int(meta.get("iteration", -1))
            if 0 < t <= completed and meta.get("noise") == nz.NOISE_VERSION and meta.get("digest") == history.digest(t):
                with torch.no_grad():
                    target.load_state(load_file(str(path)))
                return t
        return 0


def _task_means(results: Sequence[Result], task_ids: Sequence[str]) -> list[float]:
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    scored: dict[str, int] = defaultdict(int)
    for r in results:
        counts[r.task.id] += 1
        if judged(r.verdict):  # NaN for a task none of whose results was judged: it carries no signal
            sums[r.task.id] += r.reward
            scored[r.task.id] += 1
    missing = [t for t in task_ids if not counts[t]]
    if missing:
        raise ValueError(f"group normalisation needs every member to answer every task; missing {missing[:3]}")
    return [sums[t] / scored[t] if scored[t] else math.nan for t in task_ids]
