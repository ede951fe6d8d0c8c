"""What vrl's Modal runs send at scale, and what a cold worker pays, on the Modal emulator
(tests/modal_emulator): issue 25, defect 9 and item 4.

The emulator records the pickled size of every input that reaches a container. The tests reproduce
the defect and failed on the code they were written against (a strict xfail until the fix).
"""

from __future__ import annotations

import pickle

import pytest

from tests.modal_emulated import modal_config


def test_the_payload_of_a_member_call_does_not_grow_with_iterations(emu, tmp_path):
    """Defect 9. Six ES iterations of eight members: the bytes per member call stay flat.

    Real Modal: each input is pickled and sent (inputs over 2 MiB go through blob storage,
    modal/_utils/blob_utils.py); `ModalPolicy.sample` passes `updates=self.updates`, every
    (seed, coefficient) since the base, to every member, so a call carries O(iterations × population)
    bytes and every cold worker replays them all. At 400 iterations of 64 members that is ~25,600
    updates per call, per member. Fixed: a call carries the newest update and the digests of the
    history it extends (`workers.UpdateLog.head()`); the rest is on the Volume.
    """
    from vrl.optim.es import ESHistory, update_terms
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
        if row["function"] == "sample":
            calls.setdefault(row["call"], []).append(row["bytes"])
    per_iteration = [sum(sizes) / len(sizes) for sizes in calls.values()]
    assert len(per_iteration) == 6
    # From the second iteration on a call carries one update (the newest); before the fix, iteration k's
    # carried all k, so the last call outgrew the second by four updates. Allowed: less than one.
    history = ESHistory.read(tmp_path / "runs" / "scale" / "es_history.json")
    update_bytes = max(len(pickle.dumps(update_terms(r, history.antithetic, history.alpha).to_wire(), protocol=4))
                       for r in history.iterations)
    assert per_iteration[-1] - per_iteration[1] < update_bytes, \
        f"bytes per member call by iteration: {per_iteration} (one update: up to {update_bytes})"


def run_with_cold_workers(emu, tmp_path, name: str, iterations: int, snapshot_every: int, population: int = 4):
    """An ES run on the emulator whose GPU containers are all killed as its last iteration starts, so that
    iteration's members run on cold containers. Returns the mean input bytes per member call by
    iteration and, for the last iteration, each call's catch-up: (updates replayed, seconds)."""
    import cloudpickle

    from vrl.runtime import make_runtime
    from vrl.trainer import Trainer

    calls: list[str] = []
    killed: list[str] = []
    cold: list[tuple[int, float]] = []

    def started(service, container, function, input):  # noqa: A002 - the emulator's keyword
        if function == "sample" and input.call.fcid not in calls:
            calls.append(input.call.fcid)
            if len(calls) == iterations and not killed:  # the last iteration begins: every warm worker is lost
                killed.extend(service.running("sample"))
                for cid in killed:
                    service.kill(cid)

    def finished(service, container, function, input):  # noqa: A002
        if function == "sample" and input.ok and len(calls) == iterations and input.call.fcid == calls[-1]:
            out = cloudpickle.loads(input.result)
            cold.append((out["replayed"], out["catch_up_s"]))

    emu.on("input_started", started)
    emu.on("input_finished", finished)
    cfg = modal_config(tmp_path, name=name, plugin="letters", iterations=iterations,
                       es={"population_size": population}, runtime={"snapshot_every": snapshot_every})
    Trainer(cfg, runtime=make_runtime(cfg)).run()
    assert not emu.hook_errors, emu.hook_errors
    by_call: dict[str, list[int]] = {}
    for row in emu.log:
        if row["function"] == "sample":
            by_call.setdefault(row["call"], []).append(row["bytes"])
    return {"bytes_per_call": [sum(b) / len(b) for b in by_call.values()], "cold": cold, "killed": len(killed)}


@pytest.mark.slow  # two emulated runs of four iterations, cold containers in each: about a minute
def test_a_cold_worker_replays_at_most_k_updates_with_theta_snapshots(emu, tmp_path):
    """Issue 25 item 4 (and defect 9's replay). Every warm GPU container is lost as the fourth iteration
    starts; the members land on cold containers.

    Real Modal: a container that scaled down, was preempted or crashed starts from the base model. Before
    the fix it replayed every update since the base (cost growing with iterations); now one worker writes θ
    to the Volume every `snapshot_every` updates and a cold one starts from the newest snapshot, replaying
    at most that many. With `snapshot_every=0` the cold worker replays all three, as before.
    """
    import shutil

    without = run_with_cold_workers(emu, tmp_path / "a", "plain", iterations=4, snapshot_every=0)
    assert without["killed"] and without["cold"]
    assert max(r for r, _ in without["cold"]) == 3  # a cold worker replays the whole history
    shutil.rmtree(tmp_path / "a")
    emu.log.clear()
    emu.hooks.clear()
    snap = run_with_cold_workers(emu, tmp_path / "b", "snap", iterations=4, snapshot_every=2)
    assert snap["killed"] and snap["cold"]
    assert max(r for r, _ in snap["cold"]) == 1, snap["cold"]  # θ after 2 updates from the Volume, then one
    theta = emu.volume("vrl") / "runs" / "snap" / "es" / "theta"
    assert sorted(p.name for p in theta.glob("*.safetensors")) == ["000002.safetensors"]
