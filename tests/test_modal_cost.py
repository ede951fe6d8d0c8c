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
        assert s["loop_overlapped_s"] <= s["loop_sequential_s"]
        assert s["cost_overlapped_usd"] <= s["cost_sequential_usd"]


def test_a_warm_pool_brings_the_loop_near_generation_time():
    r = simulate(replace(CASE_STUDY, sandboxes=16))
    assert r["loop_overlapped_s"] < 1.25 * r["generation_s"]
    assert r["cost_overlapped_usd"] < simulate(CASE_STUDY)["cost_sequential_usd"] / 2  # idle GPUs wait less


def test_table_lists_every_scenario():
    text = table(SCENARIOS)
    assert len(text.splitlines()) == 2 + len(SCENARIOS)
