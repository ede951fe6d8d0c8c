"""What vrl's Modal runs send at scale, on the Modal emulator (tests/modal_emulator): issue 25, defect 9.

The emulator records the pickled size of every input that reaches a container. The test reproduces
the defect and fails on the code it was written against (strict xfail: the fix turns it into a pass).
"""

from __future__ import annotations

import pytest

from tests.modal_emulated import modal_config


@pytest.mark.xfail(strict=True, reason="issue 25 defect 9: every ES member call re-sends all tasks and the whole "
                   "update list since the base, so the payload per call (and a cold worker's replay) grows with "
                   "the iteration count")
def test_the_payload_of_a_member_call_does_not_grow_with_iterations(emu, tmp_path):
    """Defect 9. Six ES iterations of eight members: the bytes per member call stay flat.

    Real Modal: each input is pickled and sent (inputs over 2 MiB go through blob storage,
    modal/_utils/blob_utils.py); `ModalPolicy.sample` passes `updates=self.updates`, every
    (seed, coefficient) since the base, to every member, so a call carries O(iterations × population)
    bytes and every cold worker replays them all. At 400 iterations of 64 members that is ~25,600
    updates per call, per member.
    """
    from vrl.rundir import read_jsonl
    from vrl.runtime import make_runtime
    from vrl.trainer import Trainer

    # letters: the tiny model's members score differently, so every iteration makes a real update
    cfg = modal_config(tmp_path, name="scale", plugin="letters", iterations=6, es={"population_size": 8})
    Trainer(cfg, runtime=make_runtime(cfg)).run()
    metrics = read_jsonl(tmp_path / "runs" / "scale" / "metrics.jsonl")
    assert sum(row["es/member_reward_std"] > 0 for row in metrics) >= 4, "too few real updates to measure growth"
    calls: dict[str, list[int]] = {}  # one .map() per iteration, in order
    for row in emu.log:
        if row["function"] == "GPUWorker":
            calls.setdefault(row["call"], []).append(row["bytes"])
    per_iteration = [sum(sizes) / len(sizes) for sizes in calls.values()]
    assert len(per_iteration) == 6
    assert per_iteration[-1] <= 1.1 * per_iteration[0], f"bytes per member call by iteration: {per_iteration}"
