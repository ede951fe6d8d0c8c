"""Evolution Strategies (Qiu et al. 2025, "Evolution Strategies at Scale", arXiv 2509.24372).

One iteration, read top to bottom in `ES`:

1. `ask`: N members, each a seed (antithetic: N/2 seeds, each used with sign +1 and -1).
2. `activate`: weights ← cast(θ + σ·sign·ε(seed)); the block generates; weights ← cast(θ) (bit-exact).
3. `tell`: member reward Rᵢ = mean shaped reward of its results; zᵢ = normalise(R) (z-score, rank or
   per-task group), rounded to 4 decimals; θ ← θ + α·(1/N)·Σᵢ zᵢ·signᵢ·ε(seedᵢ) (the paper's
   convention: 1/σ folded into α; default α = σ/2).

θ is an fp32 master copy of the selected parameters; the model's weights (any dtype) are always
cast(θ) outside `activate`. Noise is never stored: ε is a pure function of (seed, parameter name,
element index) (`vrl.optim.noise`), identical on CPU and GPU. The whole training state is therefore
the base model reference plus the list of (seed, z) per iteration: `es_history.json` in the run
directory. `replay` rebuilds θ_t from θ₀ bit for bit; optional snapshots every K iterations bound the
replay. `evaluate_member` is the per-member evaluation as a pure function, for fan-out to workers.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import logging
import math
import os
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from vrl.optim import lowrank
from vrl.optim import noise as nz
from vrl.optim.base import Optimizer, Variant
from vrl.types import Completion, Result, Task

log = logging.getLogger(__name__)

HISTORY_FILE = "es_history.json"
SNAPSHOT_DIR = "es_snapshots"
HISTORY_FORMAT = "vrl-es-history"
HISTORY_VERSION = 1
Z_DECIMALS = 4


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
        "[−0.5, 0.5]; 'group' z-score among members per task, then averaged over tasks.",
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
        "and can run as one batch.",
    )
    rank: int = Field(
        8, ge=1, le=lowrank.MAX_RANK, description="Rank r of each member's perturbation A·Bᵀ (with noise=lowrank)."
    )

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
    """One iteration: member i used seed `seed + i` (antithetic: `seed + i//2`, sign (−1)**i) and weight z[i]."""

    seed: int
    z: list[float]


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
        lines = [json.dumps(r.model_dump(mode="json"), separators=(",", ":")) for r in self.iterations]
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
        data = json.dumps([r.model_dump(mode="json") for r in self.iterations[:iterations]], separators=(",", ":"))
        return hashlib.sha256(data.encode()).hexdigest()


def member_seeds(record: IterationRecord, antithetic: bool) -> list[tuple[int, int]]:
    """(seed, sign) of each member of an iteration."""
    if antithetic:
        return [(record.seed + i // 2, 1 if i % 2 == 0 else -1) for i in range(len(record.z))]
    return [(record.seed + i, 1) for i in range(len(record.z))]


def update_terms(record: IterationRecord, antithetic: bool, alpha: float) -> list[tuple[int, float]]:
    """The update Σᵢ (α/N)·zᵢ·signᵢ·ε(seedᵢ) as (seed, coefficient of the integer noise) terms.

    Members sharing a seed (antithetic pairs) are merged, so the noise is generated once per seed;
    coefficients are rounded to 14 significant bits, which keeps each product exact in fp32.
    """
    n = len(record.z)
    merged: dict[int, float] = defaultdict(float)
    for (seed, sign), z in zip(member_seeds(record, antithetic), record.z):
        merged[seed] += sign * z
    terms = [(seed, nz.round_sig(alpha / n * w * nz.C, nz.SCALE_BITS)) for seed, w in merged.items()]
    return [(seed, c) for seed, c in terms if c != 0.0]


# -- reward normalisation ---------------------------------------------------------------------------


def normalize(rewards: Sequence[float], method: str, per_task: Sequence[Sequence[float]] | None = None) -> list[float]:
    """Member weights zᵢ from member rewards; all zero when the rewards carry no ranking signal."""
    r = torch.tensor(rewards, dtype=torch.float64)
    if method == "zscore":
        std = r.std(unbiased=False)
        return ((r - r.mean()) / std).tolist() if std > 0 else [0.0] * len(r)
    if method == "rank":
        if len(r) < 2 or bool((r == r[0]).all()):
            return [0.0] * len(r)
        # Average ranks for ties, centred to [−0.5, 0.5] (OpenAI-ES "centered ranks").
        ranks = torch.empty_like(r)
        order = sorted(range(len(r)), key=lambda i: rewards[i])
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and rewards[order[j + 1]] == rewards[order[i]]:
                j += 1
            for k in range(i, j + 1):
                ranks[order[k]] = (i + j) / 2
            i = j + 1
        return (ranks / (len(r) - 1) - 0.5).tolist()
    if method == "group":
        if per_task is None:
            raise ValueError("group normalisation needs per-task member rewards")
        columns = torch.tensor(per_task, dtype=torch.float64)  # members × tasks
        std = columns.std(dim=0, unbiased=False)
        z = torch.where(std > 0, (columns - columns.mean(dim=0)) / std.clamp(min=1e-300), torch.zeros_like(columns))
        return z.mean(dim=1).tolist()
    raise ValueError(f"unknown ES normalization {method!r}; choose zscore, rank or group")


# -- the parameters ES moves ------------------------------------------------------------------------


class FlatParams:
    """The selected parameters' fp32 master θ in one flat padded buffer per dtype, and where the weights live.

    `FlatParams(named)` (hf backend) also moves the weights into one flat buffer per dtype, each
    parameter becoming a view of it. `FlatParams.over(views)` (vLLM engine) leaves the weights where
    they are, e.g. rows of an engine's fused tensors, and writes them there. Either way a
    perturbation of the whole model is one kernel launch on GPU that reads θ and writes each weight
    once. Each tensor's master starts at a multiple of `GRANULE` elements (padding is never
    written to a weight). Outside `perturb` the weights are always exactly cast(master).
    """

    GRANULE = 8192

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], *, move: bool = True):
        if not named:
            raise ValueError("no parameters selected for ES")
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"ES needs the selected parameters on one device; found {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.names = [n for n, _ in named]
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = defaultdict(list)
        for name, p in named:
            if p.numel() >= nz.MAX_NUMEL:
                raise ValueError(f"parameter {name} has {p.numel()} elements; the noise scheme indexes < 2**32")
            by_dtype[p.dtype].append((name, p))
        self.groups = [_Group(items, self.GRANULE, self.device, move) for items in by_dtype.values()]
        self.numel = sum(p.numel() for _, p in named)
        self.use_triton = self.device.type == "cuda" and _triton_available()

    @classmethod
    def over(cls, views: dict[str, torch.Tensor]) -> FlatParams:
        """θ for tensors that stay where they are (contiguous views, e.g. rows of a fused engine tensor)."""
        bad = [n for n, v in views.items() if not v.is_contiguous()]
        if bad:
            raise ValueError(f"ES writes weights in place and needs contiguous tensors; {bad[0]} is not")
        return cls(list(views.items()), move=False)

    @property
    def dtype(self) -> str:
        """The weights' dtype name (the groups' joined when they differ)."""
        return "+".join(str(g.dtype).removeprefix("torch.") for g in self.groups)

    def perturb(self, seed: int, sign: int, sigma: float) -> None:
        """weights ← cast(θ + sign·σ·ε(seed))."""
        scale = sign * nz.noise_scale(sigma)
        for g in self.groups:
            if self.use_triton:
                from vrl.optim import es_triton

                es_triton.perturb(g.master, g.targets(), g.granule_tensor, g.starts, g.words_t, seed, scale, self.GRANULE)
            else:
                nz.perturb_reference(g.master_views, g.weight_views, g.words, seed, scale)

    def restore(self) -> None:
        """weights ← cast(θ): bit-exact, whatever happened to the weights since."""
        with torch.no_grad():
            for g in self.groups:
                if g.weights is not None:
                    g.weights.copy_(g.master)
                elif self.use_triton:
                    from vrl.optim import es_triton

                    es_triton.cast(g.master, g.targets(), g.granule_tensor, g.starts, self.GRANULE)
                else:
                    for w, m in zip(g.weight_views, g.master_views):
                        w.copy_(m)

    def update(self, terms: Sequence[tuple[int, float]]) -> None:
        """θ ← θ + Σⱼ cⱼ·s(seedⱼ) (fp32, in term order); weights ← cast(θ)."""
        if not terms:
            return
        for g in self.groups:
            if self.use_triton:
                from vrl.optim import es_triton

                es_triton.update(g.master, g.targets(), g.granule_tensor, g.starts, g.words_t, list(terms), self.GRANULE)
            else:
                nz.update_reference(g.master_views, g.weight_views, g.words, terms)

    def state(self) -> dict[str, torch.Tensor]:
        """θ per parameter name (fp32, CPU copies)."""
        return {n: v.detach().to("cpu", copy=True) for g in self.groups for n, v in zip(g.names, g.master_views)}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set θ (and the weights) from `state`; names and shapes must match."""
        for g in self.groups:
            for name, view in zip(g.names, g.master_views):
                if name not in state or state[name].shape != view.shape:
                    raise ValueError(f"snapshot does not match the model at parameter {name}")
                view.copy_(state[name])
        self.restore()


class _Group:
    """The tensors of one dtype: their fp32 master in one flat buffer, and their weights.

    `move=True`: the weights move into a flat buffer of their own (`weights`) and each parameter's
    `.data` becomes a view of it. `move=False`: the weights stay where they are (`weights` is None).
    """

    def __init__(self, items: Sequence[tuple[str, torch.Tensor]], granule: int, device: torch.device, move: bool):
        self.names = [n for n, _ in items]
        self.words = [nz.name_words(n) for n in self.names]
        self.dtype = items[0][1].dtype
        starts, position = [], 0
        for _, p in items:
            starts.append(position)
            position += -(-p.numel() // granule) * granule
        self.weights = torch.zeros(position, dtype=self.dtype, device=device) if move else None
        self.master = torch.zeros(position, dtype=torch.float32, device=device)
        self.weight_views, self.master_views = [], []
        with torch.no_grad():
            for (_, p), start in zip(items, starts):
                if self.weights is not None:
                    w = self.weights[start : start + p.numel()].view(p.shape)
                    w.copy_(p.detach())
                    p.data = w  # the model now reads its weights from the flat buffer
                else:
                    w = p.detach()
                m = self.master[start : start + p.numel()].view(p.shape)
                m.copy_(w)
                self.weight_views.append(w)
                self.master_views.append(m)
        counts = [-(-p.numel() // granule) for _, p in items]
        self.granule_tensor = torch.repeat_interleave(torch.arange(len(items), dtype=torch.int32), torch.tensor(counts)).to(device)
        self.starts = torch.tensor(starts, dtype=torch.int64, device=device)
        self.words_t = torch.tensor(self.words, dtype=torch.int64, device=device)
        self._targets = None

    def targets(self):
        """The kernels' address table of the weights (built on first use: GPU only)."""
        if self._targets is None:
            from vrl.optim import es_triton

            self._targets = es_triton.Targets(self.weight_views)
        return self._targets


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        log.warning("triton is not installed: ES uses the pure-torch noise kernels on GPU (exact, but slower)")
        return False
    return True


def select_parameters(model: torch.nn.Module, include: Sequence[str], exclude: Sequence[str]) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters whose names match an `include` pattern and no `exclude` pattern (tied weights once)."""
    named = list(model.named_parameters())
    chosen = [
        (n, p)
        for n, p in named
        if any(fnmatch.fnmatchcase(n, pat) for pat in include) and not any(fnmatch.fnmatchcase(n, pat) for pat in exclude)
    ]
    if not chosen:
        sample = ", ".join(n for n, _ in named[:6])
        raise ValueError(
            f"es.include={list(include)} / es.exclude={list(exclude)} select no parameter; names look like: {sample}, ..."
        )
    return chosen


def replay(history: ESHistory, params: FlatParams, start: int = 0, stop: int | None = None) -> None:
    """Apply the updates of iterations [start, stop) of `history` to `params` (θ_start → θ_stop)."""
    if history.perturbation != "full":
        raise ValueError("this history used low-rank noise; replay it with vrl.optim.lowrank.replay")
    for record in history.iterations[start:stop]:
        params.update(update_terms(record, history.antithetic, history.alpha))


# -- the optimizer ------------------------------------------------------------------------------------


class ES(Optimizer):
    """Evolution Strategies behind the ask/tell contract; state = `ESHistory`."""

    name = "es"

    def __init__(self, config: ESConfig, seed: int = 0, base: dict[str, Any] | None = None):
        self.config, self.seed = config, seed
        self.base = dict(base or {"model": "unknown"})
        self.params: FlatParams | None = None
        self.history: ESHistory | None = None
        self._variants: list[Variant] | None = None

    def setup(self, generator: Any) -> None:
        """Take over the generator model's selected weights (flat buffers + fp32 master θ₀)."""
        super().setup(generator)
        c = self.config
        if c.noise != "full":
            raise ValueError("es.noise=lowrank is not wired into the training loop yet (issue 14); use es.noise=full")
        engine_params = getattr(generator, "es_params", None)  # a backend that perturbs its own engine (vllm)
        if engine_params is not None:
            self.params = engine_params(c.include, c.exclude)
        else:
            self.params = FlatParams(select_parameters(generator.model, c.include, c.exclude))
        self.history = ESHistory(
            base=BaseModelRef(**{**self.base, "dtype": self.params.dtype}),
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
        log.info("ES: %d tensors, %d parameters selected", len(self.params.names), self.params.numel)

    def _require_setup(self) -> tuple[FlatParams, ESHistory]:
        if self.params is None or self.history is None:
            raise RuntimeError("call ES.setup(generator) before ask/activate/tell")
        return self.params, self.history

    @property
    def iteration(self) -> int:
        """Completed iterations."""
        return len(self._require_setup()[1].iterations)

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

    @contextlib.contextmanager
    def activate(self, variant: Variant) -> Iterator[None]:
        """The generator holds cast(θ + σ·sign·ε(seed)) inside the block; cast(θ) again after it."""
        params, _ = self._require_setup()
        if variant.seed is None:
            raise ValueError(f"ES variant {variant.index} has no seed; use the variants returned by ES.ask()")
        try:
            with torch.no_grad():
                params.perturb(variant.seed, variant.sign, self.config.sigma)
            yield
        finally:
            params.restore()

    def tell(self, results: list[Result]) -> dict[str, float]:
        """Normalise member rewards, update θ, append the iteration to the history."""
        params, history = self._require_setup()
        if self._variants is None:
            raise RuntimeError("ES.tell() called without a preceding ask()")
        n = len(self._variants)
        by_member: list[list[Result]] = [[] for _ in range(n)]
        for r in results:
            if not 0 <= r.completion.variant < n:
                raise ValueError(f"result for variant {r.completion.variant}, but this iteration has members 0..{n - 1}")
            by_member[r.completion.variant].append(r)
        missing = [i for i, rs in enumerate(by_member) if not rs]
        if missing:
            raise ValueError(f"ES members {missing} have no results; every member needs at least one rewarded completion")
        rewards = [sum(r.reward for r in rs) / len(rs) for rs in by_member]
        per_task = None
        if self.config.normalization == "group":
            task_ids = sorted({r.task.id for r in results})
            per_task = [_task_means(rs, task_ids) for rs in by_member]
        z = [round(v, Z_DECIMALS) + 0.0 for v in normalize(rewards, self.config.normalization, per_task)]
        record = IterationRecord(seed=self._variants[0].seed, z=z)
        with torch.no_grad():
            params.update(update_terms(record, self.config.antithetic, history.alpha))
        history.iterations.append(record)
        self._variants = None
        mean = sum(rewards) / n
        return {
            "es/member_reward_mean": mean,
            "es/member_reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
            "es/member_reward_max": max(rewards),
            "es/member_reward_min": min(rewards),
        }

    # -- persistence ----------------------------------------------------------------------------------
    def save(self, run_dir: Path, final: bool = False) -> None:
        """Write es_history.json (atomically), and a snapshot every `snapshot_every` iterations."""
        _, history = self._require_setup()
        run_dir = Path(run_dir)
        _write_atomic(run_dir / HISTORY_FILE, history.to_json())
        k = self.config.snapshot_every
        if k and self.iteration % k == 0 and self.iteration:
            self._save_snapshot(run_dir)

    def load(self, run_dir: Path) -> None:
        """Rebuild θ_t for the run's t completed iterations: latest valid snapshot, then replay."""
        params, history = self._require_setup()
        run_dir = Path(run_dir)
        saved = ESHistory.read(run_dir / HISTORY_FILE)
        self._check_compatible(saved, history)
        completed = _completed_iterations(run_dir)
        if len(saved.iterations) < completed:
            raise ValueError(
                f"{run_dir / HISTORY_FILE} has {len(saved.iterations)} iterations but the run finished {completed}; "
                "the history is incomplete, so the weights cannot be rebuilt"
            )
        saved.iterations = saved.iterations[:completed]  # an update saved after the last finished iteration
        start = self._load_snapshot(run_dir, saved, completed)
        with torch.no_grad():
            replay(saved, params, start)
        self.history = saved
        self._variants = None
        log.info("ES: resumed at iteration %d (snapshot %d, replayed %d)", completed, start, completed - start)

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

        params, history = self._require_setup()
        folder = run_dir / SNAPSHOT_DIR
        folder.mkdir(exist_ok=True)
        t = self.iteration
        path = folder / f"iter-{t:06d}.safetensors"
        meta = {"iteration": str(t), "noise": nz.NOISE_VERSION, "digest": history.digest(t)}
        save_file(params.state(), str(path) + ".tmp", metadata=meta)
        os.replace(str(path) + ".tmp", path)
        # Keep two: the newest may be ahead of state.json if the run stops between the two writes.
        for old in sorted(folder.glob("iter-*.safetensors"))[:-2]:
            old.unlink()

    def _load_snapshot(self, run_dir: Path, history: ESHistory, completed: int) -> int:
        from safetensors import safe_open
        from safetensors.torch import load_file

        params, _ = self._require_setup()
        for path in sorted((run_dir / SNAPSHOT_DIR).glob("iter-*.safetensors"), reverse=True):
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            t = int(meta.get("iteration", -1))
            if 0 < t <= completed and meta.get("noise") == nz.NOISE_VERSION and meta.get("digest") == history.digest(t):
                with torch.no_grad():
                    params.load_state(load_file(str(path)))
                return t
        return 0

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"optimizer": self.name, "population_size": c.population_size, "sigma": c.sigma, "alpha": c.step_size,
                "normalization": c.normalization, "antithetic": c.antithetic}


def _task_means(results: Sequence[Result], task_ids: Sequence[str]) -> list[float]:
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for r in results:
        sums[r.task.id] += r.reward
        counts[r.task.id] += 1
    missing = [t for t in task_ids if not counts[t]]
    if missing:
        raise ValueError(f"group normalisation needs every member to answer every task; missing {missing[:3]}")
    return [sums[t] / counts[t] for t in task_ids]


def _completed_iterations(run_dir: Path) -> int:
    from vrl.rundir import RunDir  # late: vrl.rundir imports vrl.config, which imports this module

    return RunDir(run_dir).completed_iterations()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# -- per-member evaluation as a pure function ----------------------------------------------------------


class _Replica:
    """A generator holding θ_t of some history; kept warm so the next call only replays new iterations."""

    def __init__(self, history: ESHistory, device: str):
        from vrl.generate.hf import HFGenerator, load_model_and_tokenizer

        b = history.base
        dtype = b.dtype if b.dtype in ("float32", "bfloat16", "float16") else "auto"
        model, tokenizer = load_model_and_tokenizer(b.model, device, dtype, b.revision)
        self.generator = HFGenerator(model, tokenizer, None)
        self.es = ES(
            ESConfig(population_size=history.population_size, sigma=history.sigma, alpha=history.alpha,
                     normalization=history.normalization, antithetic=history.antithetic,  # type: ignore[arg-type]
                     include=history.include, exclude=history.exclude, noise=history.perturbation,
                     rank=history.rank or ESConfig.model_fields["rank"].default),
            base=b.model_dump(exclude={"dtype"}),
        )
        self.es.setup(self.generator)
        self.es._check_compatible(history, self.es._require_setup()[1])
        self.key = (history.model_dump_json(exclude={"iterations"}), device)

    def sync(self, history: ESHistory) -> bool:
        """Bring θ to the end of `history` if it extends what this replica holds; False if it does not."""
        _, mine = self.es._require_setup()
        t = len(mine.iterations)
        if len(history.iterations) < t or history.digest(t) != mine.digest(t):
            return False
        with torch.no_grad():
            replay(history, self.es.params, t)  # type: ignore[arg-type]
        mine.iterations = list(history.iterations)
        return True


_REPLICA: _Replica | None = None


def evaluate_member(
    history: ESHistory | dict[str, Any] | str | Path,
    seed: int,
    sign: int,
    tasks: Sequence[Task],
    sampling: Any,
    *,
    index: int = 0,
    samples_per_task: int = 1,
    sample_seed: int | None = None,
    device: str = "auto",
) -> list[Completion]:
    """Completions of one ES member: θ_t from `history` (replayed from the base model), perturbed by
    sign·σ·ε(seed), sampled on `tasks` with `sampling` (a `SamplingConfig`) and `sample_seed`.

    A pure function of its arguments (the result does not depend on the worker or on earlier calls);
    a warm worker keeps its replica and replays only iterations it has not seen. `index` tags the
    completions with the member's variant index; `samples_per_task` completions are drawn per task.
    """
    global _REPLICA
    if isinstance(history, (str, Path)):
        history = ESHistory.read(Path(history))
    elif isinstance(history, dict):
        history = ESHistory.model_validate(history)
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign}")
    key = (history.model_dump_json(exclude={"iterations"}), device)
    if _REPLICA is None or _REPLICA.key != key or not _REPLICA.sync(history):
        _REPLICA = None  # free the old model before loading a new one
        _REPLICA = _Replica(history, device)
        _REPLICA.sync(history)
    generator = _REPLICA.generator
    generator.sampling = sampling
    variant = Variant(index=index, samples_per_task=samples_per_task, seed=seed, sign=sign)
    with _REPLICA.es.activate(variant):
        return generator.generate(tasks, n=samples_per_task, variant=index, seed=sample_seed)
