"""benchmarks/lowrank_profile.py's bookkeeping, on the CPU: how a profile's kernels are attributed to
layer kinds, how decode steps are picked from the engine's step log, and the layout of the tuned LoRA
kernel config files vLLM reads (config[max_loras + 1][num_slices][m][k][n], from vLLM 0.26's
`lora/ops/triton_ops/utils.py`). The profile itself runs on a GPU (docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "lowrank_profile.py"
_spec = importlib.util.spec_from_file_location("lowrank_profile", _PATH)
lp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lp)

GEMM = "nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NTN"
SHRINK = "_lora_shrink_kernel"
EXPAND = "_lora_expand_kernel"
FILL = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
ATTN = "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...> > >"
NORM = "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>"
REDUCE = "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>"

# one decoder layer: (kernel, µs); LoRA per kind: (zero, shrink, expand)
LORA = {"qkv_proj": (1, 2, 3), "o_proj": (1, 4, 5), "gate_up_proj": (1, 6, 7), "down_proj": (1, 8, 9)}
BASE = {"qkv_proj": 10, "o_proj": 11, "gate_up_proj": 12, "down_proj": 13}


def layer(lora: bool) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = [(NORM, 0.5)]
    for kind in lp.KINDS:
        out.append((GEMM, BASE[kind]))
        if lora:
            z, s, e = LORA[kind]
            out += [(FILL, z), (SHRINK, s), (EXPAND, e)]
        if kind == "qkv_proj":
            out.append((ATTN, 20))
        if kind == "o_proj":
            out.append((NORM, 0.5))
    return out


def steps(n_steps: int, layers: int, lora: bool) -> list[dict]:
    """Kernel records of `n_steps` decode steps, shuffled (a profile's events come in any order)."""
    seq: list[tuple[str, float]] = []
    for _ in range(n_steps):
        for _ in range(layers):
            seq += layer(lora)
        seq += [(GEMM, 30), (REDUCE, 2), ("Memcpy DtoH (Device -> Pinned)", 1)]
    t, records = 0.0, []
    for name, dur in seq:
        records.append({"name": name, "start": t, "dur": dur})
        t += dur + 0.25
    random.Random(0).shuffle(records)
    return records


def test_summarize_attributes_kernels_to_layer_kinds_per_step() -> None:
    s = lp.summarize(steps(3, 2, lora=True), steps=3, layers=2)
    assert s["gemms_per_step"] == 9
    assert s["gemm_us_per_step_by_kind"] == {kind: 2 * BASE[kind] for kind in lp.KINDS} | {"lm_head": 32}
    assert s["lora_us_per_step_by_kind"] == {
        kind: {"zero": 2 * z, "shrink": 2 * sh, "expand": 2 * e} for kind, (z, sh, e) in LORA.items()}
    by = s["us_per_step_by_class"]
    assert by["lora_zero"] == 8 and by["lora_shrink"] == 40 and by["lora_expand"] == 48
    assert by["gemm"] == 2 * sum(BASE.values()) + 30 and by["gemm_reduce"] == 2
    assert by["attention"] == 40 and by["memcpy"] == 1 and "fill" not in by  # every fill zeroes a LoRA buffer
    assert s["kernels_per_step"] == 2 * (1 + 4 + 12 + 2) + 3
    assert s["top_kernels"][0]["name"] == GEMM


def test_summarize_without_lora_and_when_the_pattern_does_not_fit() -> None:
    plain = lp.summarize(steps(2, 2, lora=False), steps=2, layers=2)
    assert plain["lora_us_per_step_by_kind"] is None
    assert plain["gemm_us_per_step_by_kind"]["down_proj"] == 26
    # a GEMM missing from the window: no guess at which kind each is
    ks = sorted(steps(2, 2, lora=True), key=lambda k: k["start"])
    ks.remove(next(k for k in ks if k["name"] == GEMM))
    odd = lp.summarize(ks, steps=2, layers=2)
    assert odd["gemm_us_per_step_by_kind"] is None
    assert odd["lora_us_per_step_by_kind"] is not None  # the LoRA kernels still fit theirs


def test_kernel_class_tells_attention_from_gemm() -> None:
    assert lp.kernel_class(ATTN) == "attention"  # a cutlass kernel, but FlashAttention's
    assert lp.kernel_class("void reshape_and_cache_flash_kernel<...>") == "attention"
    assert lp.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x64x64") == "gemm"
    assert lp.kernel_class(REDUCE) == "gemm_reduce"
    assert lp.kernel_class("Memset (Device)") == "fill"
    assert lp.kernel_class("triton_poi_fused_add_mul_0") == "other"


def test_step_stats_takes_decode_steps_of_the_whole_batch() -> None:
    log = [(0.0, 0.005, 3840, "exec"), (0.006, 0.007, -1, "sample")]  # prefill
    t = 0.050
    for i in range(20):
        log += [(t, t + 0.002, 240, "exec"), (t + 0.003, t + 0.004, -1, "sample")]
        t += 0.012 if i == 7 else 0.010
    log += [(t, t + 0.001, 100, "exec")]  # a tail step with fewer requests
    s = lp.step_stats(log, 240)
    assert s["steps"] == 19
    assert s["step_ms"] == pytest.approx(10.0)
    assert s["execute_model_host_ms"] == pytest.approx(2.0)
    assert s["sample_tokens_host_ms"] == pytest.approx(1.0)
    assert lp.step_stats(log, 480) is None


def test_tuned_configs_fill_every_slice_count_vllm_indexes() -> None:
    def cfg(tag: str) -> dict:
        return {"block_m": tag}

    defaults = {kind: {"shrink": cfg(f"s-{kind}"), "expand": cfg(f"e-{kind}"),
                       "shrink_large": cfg(f"S-{kind}"), "expand_large": cfg(f"E-{kind}")} for kind in lp.KINDS}
    best = {"qkv_proj": {"shrink": cfg("best-qkv-s")}, "gate_up_proj": {"expand": cfg("best-gu-e")}}
    files = lp.tuned_configs(best, defaults, max_loras=30, tokens=240, rank=8)
    shrink, expand = files["SHRINK.json"]["31"], files["EXPAND_TRUE.json"]["31"]
    assert set(shrink) == set(expand) == {"1", "2", "3"}
    # shrink: [m][hidden][rank]; expand: [m][rank][largest slice]
    assert shrink["3"]["240"]["1536"]["8"] == cfg("best-qkv-s")
    assert shrink["1"]["240"] == {"1536": {"8": cfg("s-o_proj")}, "8960": {"8": cfg("s-down_proj")}}
    assert shrink["3"]["1920"]["1536"]["8"] == cfg("S-qkv_proj")
    assert expand["2"]["240"]["8"]["8960"] == cfg("best-gu-e")
    assert expand["3"]["240"]["8"]["1536"] == cfg("e-qkv_proj")
    assert expand["2"]["1920"]["8"]["8960"] == cfg("E-gate_up_proj")


def test_configs_of_several_batch_sizes_merge_without_losing_a_tuned_entry() -> None:
    """Sweeps at 240 and 1920 tokens (one engine of 8 and of 64 tasks): one set of files where each batch
    size keeps its own tuned config, and the prefill-sized defaults sit above the largest only (8 · 240 =
    1920 would otherwise overwrite the tuned 1920 entry)."""
    def cfg(tag: str) -> dict:
        return {"block_m": tag, "num_warps": 4}

    def defaults(m: int) -> dict:
        return {kind: {"shrink": cfg(f"s{m}"), "expand": cfg(f"e{m}"), "shrink_large": cfg(f"S{m}"),
                       "expand_large": cfg(f"E{m}")} for kind in lp.KINDS}

    shapes = lp.SHAPES_BY_MODEL["0.5b"]
    small = lp.tuned_configs({"gate_up_proj": {"expand": cfg("best240")}}, defaults(240), 30, 240, 8, shapes, large=False)
    big = lp.tuned_configs({"gate_up_proj": {"expand": cfg("best1920")}}, defaults(1920), 30, 1920, 8, shapes)
    expand = lp.merge_configs([small, big])["EXPAND_TRUE.json"]["31"]["2"]
    assert expand["240"]["8"]["4864"] == cfg("best240")
    assert expand["1920"]["8"]["4864"] == cfg("best1920")
    assert expand["15360"]["8"]["4864"] == cfg("E1920")
    assert set(expand) == {"240", "1920", "15360"}
    shrink = lp.merge_configs([small, big])["SHRINK.json"]["31"]["1"]
    assert shrink["240"] == {"896": {"8": cfg("s240")}, "4864": {"8": cfg("s240")}}


def test_write_configs_leaves_exactly_the_sweeps_files(tmp_path: Path) -> None:
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "stale.json").write_text("{}")  # from an earlier sweep: vLLM would not read it, but it misleads
    files = {"NVIDIA_H200_SHRINK.json": {"31": {"1": {}}}, "NVIDIA_H200_EXPAND_TRUE.json": {"31": {"2": {}}}}
    out = lp.write_configs(files, folder)
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    assert json.loads((out / "NVIDIA_H200_EXPAND_TRUE.json").read_text()) == files["NVIDIA_H200_EXPAND_TRUE.json"]


def test_graph_summary_takes_medians_and_same_run_ratios() -> None:
    def run(batch: int, lora: bool, tok_s: float, step_ms: float) -> dict:
        return {"batch": batch, "lora": lora, "tok_s": tok_s,
                "decode": {"step_ms": step_ms, "execute_model_host_ms": 3.0 if lora else 2.0}}

    out = {"raw256_tok_s": [20000.0, 30000.0, 25000.0],
           "runs": [run(240, True, 15000, 12), run(240, True, 17000, 11), run(240, True, 16000, 13),
                    run(240, False, 20000, 10), run(240, False, 22000, 9), run(240, False, 21000, 8)],
           "vrl": [{"tok_s": 20000.0}, {"tok_s": 22500.0}, {"tok_s": 21000.0}]}
    s = lp.graph_summary(out, [240], 240)
    row = s["batch=240"]
    assert (row["lora_tok_s"], row["nolora_tok_s"], row["lora_step_ms"], row["nolora_step_ms"]) == (16000, 21000, 12, 9)
    assert row["lora_vs_nolora_tok_s"] == pytest.approx(16 / 21)
    assert row["nolora_vs_lora_step"] == pytest.approx(9 / 12)
    assert s["raw256_tok_s"] == 25000 and s["vrl_tok_s"] == 21000
    assert s["vrl_vs_raw256"] == pytest.approx(21 / 25)
    assert s["vrl_vs_nolora_same_requests"] == pytest.approx(1.0)
