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
    calls = bytes_by_iteration(emu)
    per_iteration = [sum(sizes) / len(sizes) for sizes in calls.values()]
    assert len(per_iteration) == 6
    # From the second iteration on a call carries one update (the newest); before the fix, iteration k's
    # carried all k, so the last call outgrew the second by four updates. Allowed: less than one.
    history = ESHistory.read(tmp_path / "runs" / "scale" / "es_history.json")
    update_bytes = max(len(pickle.dumps(update_terms(r, history.antithetic, history.alpha).to_wire(), protocol=4))
                       for r in history.iterations)
    assert per_iteration[-1] - per_iteration[1] < update_bytes, \
        f"bytes per member call by iteration: {per_iteration} (one update: up to {update_bytes})"


def bytes_by_iteration(emu) -> dict[int, list[int]]:
    """The pickled size of each member call that reached a container, by iteration (the number of ES
    updates the call's history holds; each member is a call of its own)."""
    import cloudpickle

    out: dict[int, list[int]] = {}
    for row in emu.log:
        if row["function"] == "sample":
            _args, kwargs = cloudpickle.loads(emu.inputs[row["iid"]].blob)
            out.setdefault(kwargs["es"]["count"], []).append(row["bytes"])
    return dict(sorted(out.items()))


def run_with_cold_workers(emu, tmp_path, name: str, iterations: int, snapshot_every: int, population: int = 4):
    """An ES run on the emulator whose GPU containers are all killed as its last iteration starts, so that
    iteration's members run on cold containers. Returns the mean input bytes per member call by
    iteration and, for the last iteration, each call's catch-up: (updates replayed, seconds)."""
    import cloudpickle

    from vrl.runtime import make_runtime
    from vrl.trainer import Trainer

    killed: list[str] = []
    cold: list[tuple[int, float]] = []

    def iteration_of(input) -> int:  # noqa: A002 - the emulator's keyword
        return cloudpickle.loads(input.blob)[1]["es"]["count"]

    def started(service, container, function, input):  # noqa: A002 - the emulator's keyword
        if function == "sample" and iteration_of(input) == iterations - 1 and not killed:
            killed.extend(service.running("sample"))  # the last iteration begins: every warm worker is lost
            for cid in killed:
                service.kill(cid)

    def finished(service, container, function, input):  # noqa: A002
        if function == "sample" and input.ok and iteration_of(input) == iterations - 1:
            out = cloudpickle.loads(input.result)
            cold.append((out["replayed"], out["catch_up_s"]))

    emu.on("input_started", started)
    emu.on("input_finished", finished)
    cfg = modal_config(tmp_path, name=name, plugin="letters", iterations=iterations,
                       es={"population_size": population}, runtime={"snapshot_every": snapshot_every})
    Trainer(cfg, runtime=make_runtime(cfg)).run()
    assert not emu.hook_errors, emu.hook_errors
    by_iteration = bytes_by_iteration(emu)
    return {"bytes_per_call": [sum(b) / len(b) for b in by_iteration.values()], "cold": cold, "killed": len(killed)}


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


def test_a_member_lost_after_its_retries_is_dropped_and_the_step_is_the_one_without_it(emu, tmp_path):
    """Issue 40, item 4. One ES member's container crashes on every attempt; the iteration goes on.

    Real Modal: a call whose container dies is rescheduled, then fails; vrl's `.map()` raised at the first
    failure and the iteration was lost while the other members' calls ran on, billed. Now each member is
    its own call; the failed member is dropped (es.max_lost_share), and the update the workers replay is
    the one of the members that answered: α/N over those three, z normalised among them. Emulated: the
    Modal service's crash handling (an input whose container is killed three times fails).
    """
    import cloudpickle

    from vrl.optim.es import ESHistory, member_seeds, normalize
    from vrl.rundir import read_jsonl
    from vrl.runtime import make_runtime
    from vrl.trainer import Trainer
    from vrl.weights.update import FullRankUpdate

    crashed: list[str] = []

    def crash_member_1_of_iteration_0(service, container, function, input):  # noqa: A002
        if function == "sample":
            args, kwargs = cloudpickle.loads(input.blob)
            if args[0]["index"] == 1 and kwargs["es"]["count"] == 0:
                crashed.append(container)
                service.kill(container)

    emu.on("input_started", crash_member_1_of_iteration_0)
    cfg = modal_config(tmp_path, name="lost", plugin="letters", iterations=2,
                       es={"population_size": 4, "max_lost_share": 0.25}, runtime={"retries": 0})
    Trainer(cfg, runtime=make_runtime(cfg)).run()
    assert not emu.hook_errors and len(crashed) == 3  # Modal's reschedules, then the call failed
    run = tmp_path / "runs" / "lost"
    history = ESHistory.read(run / "es_history.json")
    record = history.iterations[0]
    assert record.lost == [1] and read_jsonl(run / "metrics.jsonl")[0]["es/lost_members"] == 1
    rewards: dict[int, list[float]] = {}
    for row in read_jsonl(run / "samples.jsonl"):
        if row["iteration"] == 0:
            rewards.setdefault(row["variant"], []).append(row["reward"])
    assert sorted(rewards) == [0, 2, 3]  # nothing of the lost member was scored
    kept = [0, 2, 3]
    z = [round(v, 4) for v in normalize([sum(rewards[i]) / len(rewards[i]) for i in kept], "zscore")]
    seeds = member_seeds(record, history.antithetic)
    expected = FullRankUpdate.from_members([seeds[i] for i in kept], z, history.alpha).to_wire()
    # What the workers replayed in iteration 1: the update file on the Volume.
    on_volume = (emu.volume("vrl") / "runs" / "lost" / "es" / "updates" / "000000.json").read_text()
    import json

    assert json.loads(on_volume) == expected
