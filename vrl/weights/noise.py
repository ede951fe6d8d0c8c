"""ES noise: a pure function of (member seed, parameter name, element index), the same on every device.

Scheme ``vrl-hash32-v1`` (change `NOISE_VERSION` whenever a single output bit could change):

1. Per tensor, two 32-bit *name words* ``(n1, n2)``: the first 8 bytes of
   ``blake2b("vrl-es-noise-v1:" + name)``, little-endian. Computed once per parameter.
2. Per (member seed, tensor), two 32-bit *keys*: with ``lo, hi`` the low and high 32-bit words of the
   seed (0 ≤ seed < 2**64), ``k1 = h(h(n1 ^ lo) ^ hi)`` and ``k2 = h(h(n2 ^ lo) ^ hi)``, where ``h`` is
   the bijective multiply-xorshift mixer below. Tensors get unrelated keys, so their noise is
   independent (the ES paper's first code reused one seed for all tensors: correlated noise).
3. Per element with index ``i`` inside its tensor (row-major, 0 ≤ i < 2**32):
   ``x = i·0x9E3779B1 + k1``; ``x ^= x>>16; x *= 0x7FEB352D; x ^= (x>>15) ^ k2; x *= 0x846CA68B;
   x ^= x>>16`` (all mod 2**32). The four bytes of ``x`` summed, minus 510, give an integer
   ``s`` in [-510, 510] with mean 0 and variance 21845 (four uniform bytes).
4. The noise value is ``ε = C·s`` with ``C = 1/√21845`` rounded to 13 significant bits, so every ε is
   exact in fp32; ε has mean 0 and variance 1 (to 2e-4), and light tails (|ε| ≤ 3.46, kurtosis 2.7).

Only integer arithmetic decides the noise, so CPU (this module, int64 torch ops masked to 32 bits)
and GPU (`vrl.weights.flat_triton`) agree bit for bit; `torch.randn` on CUDA does not (its stream depends
on the GPU's SM count). Scales that multiply ``s`` are rounded to 14 significant bits
(`round_sig`): a 14-bit scale times a 10-bit integer is exact in fp32, so a fused multiply-add and a
separate multiply and add round identically and the result does not depend on the compiler.

The two operations ES needs are defined here as the reference (pure torch, any device):
`perturb_reference` writes ``weights = cast(master + scale·s)`` and `update_reference` does
``acc = Σⱼ cⱼ·sⱼ`` (in member order) then ``master += acc; weights = cast(master)``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

# torch is imported in the functions that use it: `vrl.optim.es` reads NOISE_VERSION and the
# constants here when `vrl plugins` lists it, and listing must not load torch (issue 28).
if TYPE_CHECKING:
    import torch

NOISE_VERSION = "vrl-hash32-v1"
BYTE_SUM_OFFSET = 510
BYTE_SUM_VARIANCE = 21845  # 4 · (256² − 1) / 12
SCALE_BITS = 14
MAX_NUMEL = 2**32
_M32 = 0xFFFFFFFF
# Odd multipliers of the mixer (a Weyl step, then a two-round multiply-xorshift with good avalanche).
W0, M1, M2 = 0x9E3779B1, 0x7FEB352D, 0x846CA68B


def round_sig(x: float, bits: int) -> float:
    """`x` rounded to `bits` significant bits (so products with small integers stay exact in fp32)."""
    if x == 0.0 or not math.isfinite(x):
        if not math.isfinite(x):
            raise ValueError(f"cannot round non-finite value {x} for the ES update")
        return 0.0
    mantissa, exponent = math.frexp(x)
    value = math.ldexp(round(mantissa * 2**bits), exponent - bits)
    # Far below fp32's normal range the rounded value would not be exact there; such terms are noise.
    return value if abs(value) >= 2.0**-100 else 0.0


C = round_sig(1.0 / math.sqrt(BYTE_SUM_VARIANCE), 13)


def _h(x: int) -> int:
    """Bijective 32-bit mixer used for key derivation (Python ints)."""
    x ^= x >> 16
    x = (x * M1) & _M32
    x ^= x >> 15
    x = (x * M2) & _M32
    return x ^ (x >> 16)


def name_words(name: str) -> tuple[int, int]:
    """The two 32-bit words that identify a parameter in the noise scheme."""
    digest = hashlib.blake2b(f"vrl-es-noise-v1:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def seed_words(seed: int) -> tuple[int, int]:
    """Low and high 32-bit words of a member seed."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"ES member seeds must lie in [0, 2**64), got {seed}")
    return seed & _M32, seed >> 32


def tensor_keys(seed: int, words: tuple[int, int]) -> tuple[int, int]:
    """The per-(member, tensor) keys (k1, k2) from a seed and a parameter's name words."""
    lo, hi = seed_words(seed)
    n1, n2 = words
    return _h(_h(n1 ^ lo) ^ hi), _h(_h(n2 ^ lo) ^ hi)


def tensor_keys_many(seeds: Sequence[int], words: Sequence[tuple[int, int]]) -> torch.Tensor:
    """`tensor_keys` of every (tensor, seed) pair at once, as int64 (len(words)·len(seeds), 2): row
    i·len(seeds) + j holds the keys of tensor i for seed j (vectorised: 6,000 pairs in well under a
    millisecond, where the scalar function takes tens)."""
    import numpy as np
    import torch

    for seed in seeds:
        seed_words(seed)  # the range check
    seed_arr = np.array(list(seeds), dtype=np.uint64)
    lo, hi = seed_arr & np.uint64(_M32), seed_arr >> np.uint64(32)
    w = np.array(list(words), dtype=np.uint64).reshape(-1, 2)

    def h(x: np.ndarray) -> np.ndarray:  # `_h` on uint64 arrays holding 32-bit values (products wrap mod 2⁶⁴)
        x = x ^ (x >> np.uint64(16))
        x = (x * np.uint64(M1)) & np.uint64(_M32)
        x = x ^ (x >> np.uint64(15))
        x = (x * np.uint64(M2)) & np.uint64(_M32)
        return x ^ (x >> np.uint64(16))

    k1 = h(h(w[:, :1] ^ lo[None, :]) ^ hi[None, :])
    k2 = h(h(w[:, 1:] ^ lo[None, :]) ^ hi[None, :])
    return torch.from_numpy(np.stack([k1, k2], axis=-1).reshape(-1, 2).astype(np.int64))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # x·c mod 2³² in int64 without overflowing (a 32×32-bit product would): split c into 16-bit halves.
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def noise_int(
    keys: tuple[int, int] | tuple[torch.Tensor, torch.Tensor], start: int, count: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Integer noise s ∈ [-510, 510] (int32) for elements start .. start+count-1 of one tensor.

    Keys may also be int64 tensors of shape (T, 1): then row t holds the noise of keys t (T streams at once).
    """
    if start < 0 or start + count > MAX_NUMEL:
        raise ValueError(f"element indices must lie in [0, 2**32); got {start}..{start + count}")
    return _noise_at(_positions(start, count, device), keys)


def _positions(start: int, count: int, device: torch.device | str) -> torch.Tensor:
    """Elements start .. start+count-1 times W0 mod 2³²: the part of `noise_int` every member shares."""
    import torch

    return _mul32(torch.arange(start, start + count, dtype=torch.int64, device=device), W0)


def _noise_at(positions: torch.Tensor, keys: tuple[int, int] | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`noise_int` from `_positions` (an update computes those once per chunk for all its members)."""
    import torch

    k1, k2 = keys
    x = (positions + k1) & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, M1)
    x = x ^ (x >> 15) ^ k2
    x = _mul32(x, M2)
    x = x ^ (x >> 16)
    s = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)
    return (s - BYTE_SUM_OFFSET).to(torch.int32)


def noise(seed: int, name: str, shape: Sequence[int] | torch.Size, device: torch.device | str = "cpu") -> torch.Tensor:
    """Unit-variance fp32 noise ε for the parameter `name` of member `seed` (the scheme's public face)."""
    import torch

    numel = math.prod(shape)
    return (noise_int(tensor_keys(seed, name_words(name)), 0, numel, device).to(torch.float32) * C).reshape(tuple(shape))


def noise_scale(scale: float) -> float:
    """The factor that multiplies the integer noise s for a perturbation of standard deviation `scale`."""
    return round_sig(scale * C, SCALE_BITS)


# Elements of noise generated at once by the reference. On a GPU: large, to bound the int64 temporaries (~64 MB)
# and the kernel launches. On a CPU: small, so that the ~36 elementwise steps of `noise_int` run in cache instead
# of streaming 64 MB temporaries through memory: 2^15 elements made `update_reference` 11.2x faster than 2^23
# for 30 members of a 4M-element tensor (benchmarks/noise_cpu.py, docs/benchmarks.md; 2^14 and 2^16 slower).
_CHUNK = 1 << 23
_CPU_CHUNK = 1 << 15


def _chunk(device: torch.device) -> int:
    return _CPU_CHUNK if device.type == "cpu" else _CHUNK


def perturb_reference(
    master: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], words: Sequence[tuple[int, int]], seed: int, scale: float
) -> None:
    """weights[t] = cast(master[t] + scale·s(seed, t)) for every tensor t; `scale` from `noise_scale`."""
    import torch

    for m, w, nw in zip(master, weights, words):
        keys = tensor_keys(seed, nw)
        m_flat, w_flat = m.view(-1), w.view(-1)
        step = _chunk(m.device)
        for start in range(0, m_flat.numel(), step):
            count = min(step, m_flat.numel() - start)
            s = noise_int(keys, start, count, m.device).to(torch.float32)
            w_flat[start : start + count].copy_(m_flat[start : start + count] + s * scale)


def update_reference(
    master: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    words: Sequence[tuple[int, int]],
    terms: Sequence[tuple[int, float]],
) -> None:
    """master[t] += Σⱼ cⱼ·s(seedⱼ, t) (summed in the order of `terms`), then weights[t] = cast(master[t])."""
    import torch

    for m, w, nw in zip(master, weights, words):
        keys = [(tensor_keys(seed, nw), c) for seed, c in terms]
        m_flat = m.view(-1)
        step = _chunk(m.device)
        for start in range(0, m_flat.numel(), step):
            count = min(step, m_flat.numel() - start)
            acc = torch.zeros(count, dtype=torch.float32, device=m.device)
            positions = _positions(start, count, m.device)  # shared by the members: 1.1x on the CPU
            for k, c in keys:
                acc += _noise_at(positions, k).to(torch.float32) * c
            m_flat[start : start + count] += acc
        w.copy_(m)
