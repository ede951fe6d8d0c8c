"""The ES noise scheme: a pure, versioned function with the intended statistics and exact arithmetic."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from vrl.weights import noise as nz

M = 0xFFFFFFFF


def _spec_noise(seed: int, name: str, index: int) -> int:
    """The scheme re-implemented from its documentation with plain Python ints (independent of torch)."""
    digest = hashlib.blake2b(f"vrl-es-noise-v1:{name}".encode(), digest_size=8).digest()
    n1, n2 = int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")
    lo, hi = seed & M, seed >> 32

    def h(x: int) -> int:
        x ^= x >> 16
        x = x * 0x7FEB352D & M
        x ^= x >> 15
        x = x * 0x846CA68B & M
        return x ^ (x >> 16)

    k1, k2 = h(h(n1 ^ lo) ^ hi), h(h(n2 ^ lo) ^ hi)
    x = (index * 0x9E3779B1 + k1) & M
    x ^= x >> 16
    x = x * 0x7FEB352D & M
    x ^= (x >> 15) ^ k2
    x = x * 0x846CA68B & M
    x ^= x >> 16
    return sum((x >> s) & 255 for s in (0, 8, 16, 24)) - 510


@pytest.mark.parametrize("seed,name", [(0, "w"), (12345, "model.layers.0.mlp.up_proj.weight"), (2**40 + 7, "lm_head.weight")])
def test_torch_noise_matches_the_documented_scheme(seed: int, name: str) -> None:
    indices = [0, 1, 2, 1000, 2**20 + 3, 2**32 - 1]
    keys = nz.tensor_keys(seed, nz.name_words(name))
    for i in indices:
        assert nz.noise_int(keys, i, 1).item() == _spec_noise(seed, name, i)


def test_scheme_is_pinned() -> None:
    # Known-answer values for vrl-hash32-v1: if these change, bump NOISE_VERSION (old histories would no longer replay).
    assert nz.NOISE_VERSION == "vrl-hash32-v1"
    got = nz.noise_int(nz.tensor_keys(0, nz.name_words("w")), 0, 6).tolist()
    assert got == [_spec_noise(0, "w", i) for i in range(6)]
    assert nz.C == 0.006766319274902344


def test_chunks_agree_with_the_whole_range() -> None:
    keys = nz.tensor_keys(3, nz.name_words("x"))
    whole = nz.noise_int(keys, 0, 5000)
    assert torch.equal(torch.cat([nz.noise_int(keys, 0, 1234), nz.noise_int(keys, 1234, 3766)]), whole)


def test_the_references_cpu_chunking_changes_no_bit(monkeypatch) -> None:
    """perturb_reference and update_reference walk a CPU tensor in cache-sized chunks (2^15 elements; 10x faster
    than 2^23): over a tensor of several chunks and a ragged end, every bit equals one whole-tensor pass."""
    n = 3 * nz._CPU_CHUNK + 777
    words, terms = [nz.name_words("layer.weight")], [(11, 0.25), (12, -0.5), (13, 0.125)]

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        master = torch.linspace(-1, 1, n)
        perturbed = torch.empty(n, dtype=torch.bfloat16)
        nz.perturb_reference([master], [perturbed], words, 7, nz.noise_scale(0.01))
        weights = torch.empty(n, dtype=torch.bfloat16)
        nz.update_reference([master], [weights], words, terms)
        return master, perturbed, weights

    chunked = run()
    monkeypatch.setattr(nz, "_CPU_CHUNK", n)
    whole = run()
    assert all(torch.equal(a, b) for a, b in zip(chunked, whole))
    assert not torch.equal(chunked[0], torch.linspace(-1, 1, n))  # the update did move θ
    step = torch.zeros(n)  # the update as defined: the members' noise_int, summed in order
    for seed, c in terms:
        step += nz.noise_int(nz.tensor_keys(seed, words[0]), 0, n).to(torch.float32) * c
    assert torch.equal(chunked[0], torch.linspace(-1, 1, n) + step)


def test_pure_function_of_seed_name_and_index() -> None:
    a = nz.noise(9, "layer.weight", (64, 32))
    assert torch.equal(a, nz.noise(9, "layer.weight", (64, 32)))
    assert torch.equal(a.flatten()[:100], nz.noise(9, "layer.weight", (100,)))  # the shape does not matter, the index does
    assert not torch.equal(a, nz.noise(10, "layer.weight", (64, 32)))
    assert not torch.equal(a, nz.noise(9, "layer.bias", (64, 32)))


def test_mean_variance_and_tails() -> None:
    n = 2_000_000
    e = nz.noise(2024, "stats", (n,)).double()
    assert abs(e.mean().item()) < 5 / math.sqrt(n)
    assert abs(e.var().item() - 1.0) < 5e-3
    kurtosis = ((e - e.mean()) ** 4).mean().item() / e.var().item() ** 2
    assert 2.65 < kurtosis < 2.75  # sum of four uniform bytes: 3 - 6/20 = 2.7; a Gaussian has 3
    assert e.abs().max().item() <= 510 * nz.C
    s = nz.noise_int(nz.tensor_keys(2024, nz.name_words("stats")), 0, n)
    assert s.min().item() >= -510 and s.max().item() <= 510
    # Symmetric about zero (what makes the ES gradient estimate unbiased): as many positive as negative values.
    assert abs((s > 0).double().mean().item() - (s < 0).double().mean().item()) < 5e-3


def test_independent_across_tensors_seeds_and_neighbours() -> None:
    n = 1_000_000
    names = ["model.layers.1.self_attn.q_proj.weight", "model.layers.10.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"]
    rows = [nz.noise(77, name, (n,)) for name in names]
    rows += [nz.noise(78, names[0], (n,)), nz.noise(77 + 2**32, names[0], (n,))]  # next seed; same low word
    rows.append(rows[0].roll(1))  # neighbouring elements
    corr = torch.corrcoef(torch.stack(rows).double())
    off = corr - torch.eye(len(rows), dtype=torch.float64)
    assert off.abs().max().item() < 5 / math.sqrt(n)


def test_scaled_products_are_exact_in_fp32() -> None:
    g = torch.Generator().manual_seed(0)
    s = torch.arange(-510, 511, dtype=torch.float64)
    for x in (torch.rand(200, generator=g, dtype=torch.float64) * 2 - 1) * 1e-3:
        c = nz.round_sig(float(x), nz.SCALE_BITS)
        assert float(torch.tensor(c, dtype=torch.float32)) == c  # representable
        exact = s * c
        assert torch.equal((s.float() * torch.tensor(c, dtype=torch.float32)).double(), exact)
    assert nz.round_sig(0.0, 14) == 0.0
    with pytest.raises(ValueError, match="non-finite"):
        nz.round_sig(float("nan"), 14)


def test_bad_seeds_and_indices_are_refused() -> None:
    with pytest.raises(ValueError, match="seeds must lie"):
        nz.seed_words(-1)
    with pytest.raises(ValueError, match="seeds must lie"):
        nz.seed_words(2**64)
    with pytest.raises(ValueError, match="2\\*\\*32"):
        nz.noise_int((1, 2), 2**32 - 1, 2)


def test_the_theta_checksum_sees_one_changed_bit_and_a_swap_and_not_the_chunking(monkeypatch) -> None:
    """`checksum` (what ES ranks compare under torchrun): equal bits give equal sums however the tensors are
    split into chunks; one ulp in one element, or two elements swapped, change it; a model's θ after a
    seeded update differs from θ₀ and agrees with a second copy given the same update."""
    from vrl.weights.flat import FlatParams, checksum

    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g)
    base = checksum([a[:300], a[300:]])
    monkeypatch.setattr("vrl.weights.flat.CHECKSUM_CHUNK", 7)
    assert checksum([a[:300], a[300:]]) == base  # order- and chunk-independent integer sums
    nudged = a.clone()
    nudged[500] = torch.nextafter(nudged[500], torch.tensor(math.inf))
    swapped = a.clone()
    swapped[[3, 4]] = a[[4, 3]]
    assert checksum([nudged[:300], nudged[300:]]) != base
    assert checksum([swapped[:300], swapped[300:]]) != base
    from vrl.weights.update import FullRankUpdate

    copies = [FlatParams([("w", torch.nn.Parameter(a.clone().view(40, 25)))]) for _ in range(2)]
    before = copies[0].checksum()
    for p in copies:
        p.update(FullRankUpdate.from_members([(7, 1)], [1.0], 0.5))
    assert copies[0].checksum() == copies[1].checksum() != before
