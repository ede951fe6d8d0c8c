"""The Modal time/cost model reproduces the AE Studio iteration and shows what overlap and a pool buy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vrl.runtime.modal.cost import CASE_STUDY, SCENARIOS, _verify, simulate, table


def test_case_study_order_of_magnitude():
    r = simulate(CASE_STUDY)
    assert r["attempts"] == 3840 and r["batches"] == 60  # 3,840 proof attempts in batches of 64
    assert r["generation_s"] == pytest.approx(147, rel=0.02)
    assert r["loop_sequential_s"] == pytest.approx(538, rel=0.02)


def test_sandbox_scheduling():
    assert _verify([(0.0, 4)], sandboxes=2, batch_s=1.0) == 2.0
    assert _verify([(0.0, 1), (5.0, 1)], sandboxes=1, batch_s=1.0) == 6.0  # idle until the second batch is ready


def test_overlap_hides_verification_behind_generation_waves():
    waves = replace(CASE_STUDY, gpus=8)
    r = simulate(waves)
    assert r["loop_overlapped_s"] < r["loop_sequential_s"] - 250
    assert r["loop_overlapped_s"] < r["generation_s"] + 2 * CASE_STUDY.member_s  # close to max(gen, verify)
    for _, it in SCENARIOS:
        s = simulate(it)
        assert s["loop_overlapped_s"] <= s["loop_sequential_s"] + 1e-9  # (the same sum in another order)
        assert s["cost_overlapped_usd"] <= s["cost_sequential_usd"] + 1e-9


def test_a_warm_pool_brings_the_loop_near_generation_time():
    r = simulate(replace(CASE_STUDY, sandboxes=16))
    assert r["loop_overlapped_s"] < 1.25 * r["generation_s"]
    assert r["cost_overlapped_usd"] < simulate(CASE_STUDY)["cost_sequential_usd"] / 2  # idle GPUs wait less


def test_table_lists_every_scenario():
    text = table(SCENARIOS)
    assert len(text.splitlines()) == 2 + len(SCENARIOS)


def test_the_bill_counts_container_reservations_and_sandbox_rates():
    """Issue 40 item 5: every GPU container reserves CPU and memory, billed with the GPU; sandbox CPU costs
    about 3x a Function's and a Lean sandbox asks 32 GiB. Without those terms the model gives its earlier
    case-study figure ($17.70); with them the same iteration costs about a fifth more."""
    bare = replace(CASE_STUDY, gpu_cores=0.0, gpu_memory_gib=0.0, orchestrator_cores=0.0, sandbox_cpu_factor=1.0,
                   sandbox_memory_gib=8.0)
    assert simulate(bare)["cost_sequential_usd"] == pytest.approx(17.70, abs=0.01)
    full = simulate(CASE_STUDY)["cost_sequential_usd"]
    assert 1.15 < full / simulate(bare)["cost_sequential_usd"] < 1.25
    assert simulate(replace(CASE_STUDY, gpu_cores=8.0))["cost_sequential_usd"] > full  # each term is billed


def test_batch_time_is_measured_from_a_runs_metrics_and_sizes_the_pool(tmp_path, capsys):
    from vrl.runtime.modal.cost import KIMINA, batch_s_measured, main, pool_for

    # 30 members x 128 attempts in batches of 64: 60 batches per iteration; busy seconds summed over them.
    rows = [{"completions": 3840, "verification_s": 60 * s} for s in (40.0, 8.0, 6.0, 7.0)]  # the first: start-up
    assert batch_s_measured(rows, batch_size=64, members=30) == 8.0  # the median, not the start-up
    with pytest.raises(ValueError, match="judged anything"):
        batch_s_measured([{"completions": 0, "verification_s": 0.0}], 64, 30)
    size, row, paced = pool_for(KIMINA)
    assert paced and row["loop_overlapped_s"] <= row["generation_s"] + KIMINA.batch_s
    assert not simulate(replace(KIMINA, sandboxes=size - 1))["loop_overlapped_s"] <= row["generation_s"] + KIMINA.batch_s
    capped, capped_row, _ = pool_for(replace(CASE_STUDY, gpus=8), cap_usd=6.5)
    assert capped_row["cost_overlapped_usd"] <= 6.5
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(f'{{"completions": 3840, "verification_s": {60 * s}}}\n' for s in (8.0, 8.0)))
    main([str(metrics), "--batch-size", "64", "--members", "30"])
    out = capsys.readouterr().out
    assert "batch_s measured: 8.0 s (8.00 attempts/s per sandbox)" in out and "runtime.modal.sandboxes=" in out


def test_the_bill_counts_the_nonpreemptible_orchestrator_and_the_recheck_of_every_pass():
    """Issue 54 item 6. The CPU orchestrator is nonpreemptible, which Modal bills at 3x the CPU price
    (modal.com/docs/guide/preemption); and every pass is re-checked in its sandbox (Lean seconds per pass,
    `recheck_jobs` at a time) before its batch's verdicts return."""
    from vrl.runtime.modal.cost import CPU_CORE_PER_S, RECHECKED

    loop = simulate(CASE_STUDY)["loop_sequential_s"]
    preemptible = simulate(replace(CASE_STUDY, orchestrator_factor=1.0))["cost_sequential_usd"]
    extra = simulate(CASE_STUDY)["cost_sequential_usd"] - preemptible
    assert extra == pytest.approx(loop * CASE_STUDY.orchestrator_cores * 2 * CPU_CORE_PER_S)
    assert RECHECKED.batch_time_s == pytest.approx(6.5 + 64 * 0.3 * 8.0 / 2)
    checked, unchecked = simulate(RECHECKED), simulate(CASE_STUDY)
    assert checked["verify_busy_s"] == pytest.approx(60 * RECHECKED.batch_time_s)
    assert checked["loop_sequential_s"] > unchecked["loop_sequential_s"] + 60 * 70  # 76.8 s more per batch
