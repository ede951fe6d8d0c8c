"""The flat parameter view: an fp32 master θ of the selected parameters and where the weights live.

`FlatParams` keeps θ for the selected parameters of an in-process module (or of tensors that stay
where they are, such as a vLLM engine's fused rows) and perturbs, restores and updates the weights
with the counter-based noise of `vrl.weights.noise`: one fused kernel on GPU
(`vrl.weights.flat_triton`), the pure-torch reference on CPU, the same bits on both. The hosts that
sample ES members (`vrl.generate`) keep one; ES (`vrl.optim.es`) replays onto one to export.
"""

from __future__ import annotations

import fnmatch
import logging
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch

from vrl.errors import SelectionError
from vrl.weights import noise as nz
from vrl.weights.update import FullRankUpdate, check_kind

log = logging.getLogger(__name__)


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
        self.use_triton = self.device.type == "cuda" and triton_available()

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
                from vrl.weights import flat_triton

                flat_triton.perturb(g.master, g.targets(), g.granule_tensor, g.starts, g.words_t, seed, scale, self.GRANULE)
            else:
                nz.perturb_reference(g.master_views, g.weight_views, g.words, seed, scale)

    def restore(self) -> None:
        """weights ← cast(θ): bit-exact, whatever happened to the weights since."""
        with torch.no_grad():
            for g in self.groups:
                if g.weights is not None:
                    g.weights.copy_(g.master)
                elif self.use_triton:
                    from vrl.weights import flat_triton

                    flat_triton.cast(g.master, g.targets(), g.granule_tensor, g.starts, self.GRANULE)
                else:
                    for w, m in zip(g.weight_views, g.master_views):
                        w.copy_(m)

    def update(self, update: FullRankUpdate) -> None:
        """θ ← θ + Σⱼ cⱼ·s(seedⱼ) (fp32, in term order); weights ← cast(θ)."""
        check_kind(update, "full")
        if not update:
            return
        terms = update.terms
        for g in self.groups:
            if self.use_triton:
                from vrl.weights import flat_triton

                flat_triton.update(g.master, g.targets(), g.granule_tensor, g.starts, g.words_t, list(terms), self.GRANULE)
            else:
                nz.update_reference(g.master_views, g.weight_views, g.words, terms)

    def state(self) -> dict[str, torch.Tensor]:
        """θ per parameter name (fp32, CPU copies)."""
        return {n: v.detach().to("cpu", copy=True) for g in self.groups for n, v in zip(g.names, g.master_views)}

    def checksum(self) -> str:
        """A fingerprint of θ's exact bits (`checksum`), tensor by tensor (the padding between them is left
        out: a kernel may write there): equal on two copies of the same selection only if their θ are
        equal (up to a hash collision), whatever device each lives on."""
        return checksum(v for g in self.groups for v in g.master_views)

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set θ (and the weights) from `state`; names and shapes must match."""
        for g in self.groups:
            for name, view in zip(g.names, g.master_views):
                if name not in state or state[name].shape != view.shape:
                    raise ValueError(f"snapshot does not match the model at parameter {name}")
                view.copy_(state[name])
        self.restore()


CHECKSUM_CHUNK = 1 << 22  # elements per step of `checksum`: bounds its scratch memory (64 MiB) on a large θ


def checksum(tensors: Iterable[torch.Tensor]) -> str:
    """A fingerprint of fp32 tensors' exact bits, computed where they live (no copy to the host): two
    wrapping 64-bit integer sums over the bit patterns, one of them weighted by position. Integer sums
    are exact and independent of summation order, so every device and GPU model gives the same value
    for the same bits; a single changed bit changes both. Cheap (one read of θ, one sync at the end),
    not cryptographic: it catches copies of θ that drifted apart (ES ranks), not an adversary."""
    flat = [t.detach().reshape(-1).view(torch.int32) for t in tensors]
    if not flat:
        return "0" * 32
    device = flat[0].device
    # No longer than the largest tensor: a small θ (ES on one layer, every iteration under torchrun) must
    # not pay for writing a whole chunk's ramp (32 MiB) on each call.
    ramp = torch.arange(1, min(CHECKSUM_CHUNK, max(b.numel() for b in flat)) + 1, dtype=torch.int64, device=device)
    plain = weighted = torch.zeros((), dtype=torch.int64, device=device)
    offset = 0
    for bits in flat:
        for start in range(0, bits.numel(), CHECKSUM_CHUNK):
            chunk = bits[start : start + CHECKSUM_CHUNK].to(torch.int64)
            total = chunk.sum()
            # Σ (offset + start + i + 1)·xᵢ = Σ (i + 1)·xᵢ + (offset + start)·Σ xᵢ, all modulo 2⁶⁴
            weighted = weighted + (chunk * ramp[: chunk.numel()]).sum() + total * (offset + start)
            plain = plain + total
        offset += bits.numel()
    mask = (1 << 64) - 1
    return f"{int(plain) & mask:016x}{int(weighted) & mask:016x}"


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
            from vrl.weights import flat_triton

            self._targets = flat_triton.Targets(self.weight_views)
        return self._targets


def triton_available() -> bool:
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
        raise SelectionError(
            f"es.include={list(include)} / es.exclude={list(exclude)} select no parameter; set es.include to "
            f"shell-style patterns of parameter names, which look like: {sample}, ..."
        )
    return chosen
