"""`grpo.profile_dir`: one update under torch.profiler, on this machine's CPU (the GPU adds CUDA kernels to
the same accounting; `vrl.optim.profile`)."""

from __future__ import annotations

import json

from tests.test_grpo import make_generator, make_grpo, sample_results
from vrl.optim.profile import kind_of


def test_the_chosen_iterations_update_is_profiled_and_no_other(tmp_path):
    """Iteration 1's update (the default: the first is warm-up) writes its table and its time by kind;
    iterations 0 and 2 write nothing, and the profiled step trains as the others do."""
    gen = make_generator()
    opt = make_grpo(gen, profile_dir=str(tmp_path / "prof"))
    for seed in (1, 2, 3):
        metrics = opt.tell(sample_results(gen, seed=seed))
        assert metrics["grpo/grad_norm"] > 0
    files = sorted(p.name for p in (tmp_path / "prof").iterdir())
    assert files == ["update-000001-rank0.json", "update-000001-rank0.txt"]
    summary = json.loads((tmp_path / "prof" / "update-000001-rank0.json").read_text())
    assert summary["device"] == "cpu" and summary["wall_s"] > 0
    kinds = summary["seconds_by_kind"]
    assert set(kinds) == {"nccl", "attention", "gemm", "other"}
    assert kinds["gemm"] > 0 and kinds["other"] > 0 and kinds["nccl"] == 0  # one process: no collective
    assert sum(kinds.values()) <= summary["wall_s"] * 1.05  # one CPU stream: the parts fit in the wall time
    assert "aten::" in (tmp_path / "prof" / "update-000001-rank0.txt").read_text()


def test_kernels_are_sorted_by_kind():
    """GPU kernel names (cuBLAS, CUTLASS, FlashAttention, NCCL) and CPU operators land in their kinds."""
    assert kind_of("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "nccl"
    assert kind_of("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "nccl"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kind_of("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert kind_of("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>") == "attention"
    assert kind_of("aten::addmm") == kind_of("aten::mm") == "gemm"
    assert kind_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert kind_of("triton_poi_fused_add_mul_silu_0") == kind_of("aten::add_") == "other"
