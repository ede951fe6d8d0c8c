"""What an ES run on Modal sends per member call, and what a cold GPU worker pays to catch up (issue 25, item 4).

    python benchmarks/modal_payload.py [--iterations 3 6 12] [--every 4] [--out result.json]

Runs vrl's real Modal runtime on the Modal emulator (tests/modal_emulator: containers are processes,
`.map()` inputs are pickled, the Volume follows Modal's commit/reload rules; needs bubblewrap and
cloudpickle), on the tiny model and the `letters` built-in, 8 ES members on 2 containers. For each
iteration count N, once without θ snapshots (`runtime.modal.snapshot_every=0`) and once with them
(`--every`): every GPU container is killed as iteration N starts, so that iteration's members run on
cold containers, which must rebuild θ_(N-1) before sampling. Recorded:

  * bytes per member call (the pickled input, as the emulator receives it) by iteration, and for
    comparison the bytes of the whole update list that every call carried before the fix (computed
    from the run's updates, not measured);
  * the cold workers' catch-up: updates replayed and seconds (reload, snapshot load, replay).

The tiny model makes an update cost microseconds, so the seconds show the shape, not a GPU's cost:
on a real model each replayed update regenerates the noise of every perturbed weight (a full-rank
update of a 1.5B model is about the cost of one perturbation, see docs/benchmarks.md "ES perturbation").
A benchmark, not a test; results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(iterations: int, every: int, work: Path) -> dict:
    """One emulated run of `iterations` with θ snapshots every `every` updates (0: none)."""
    from tests.modal_emulator import emulated_modal
    from tests.test_modal_emulated_scale import run_with_cold_workers
    from vrl.optim.es import ESHistory, update_terms

    with emulated_modal(work / "modal", limit_s=1800) as emu:
        out = run_with_cold_workers(emu, work, f"n{iterations}k{every}", iterations, every, population=8)
    history = ESHistory.read(work / "runs" / f"n{iterations}k{every}" / "es_history.json")
    wire = [update_terms(r, history.antithetic, history.alpha).to_wire() for r in history.iterations]
    before, now = es_state_bytes(wire[: iterations - 1])
    replayed = [r for r, _ in out["cold"]]
    seconds = [s for _, s in out["cold"]]
    return {"iterations": iterations, "snapshot_every": every, "bytes_per_call": out["bytes_per_call"],
            "es_state_bytes": now, "es_state_bytes_before_fix": before, "cold_calls": len(replayed),
            "cold_replayed_max": max(replayed), "cold_catch_up_s_max": max(seconds)}


def es_state_bytes(wire: list[dict]) -> tuple[list[int], list[int]]:
    """By iteration k (k updates so far): the pickled ES state of one member call before the fix (the whole
    update list) and now (`UpdateLog.head()`: the newest update and two digests)."""
    from vrl.runtime.modal.workers import UpdateLog

    log = UpdateLog("runs/bench/es", lambda files: None)
    before, now = [], []
    for k in range(len(wire) + 1):
        before.append(len(pickle.dumps(wire[:k], protocol=4)))
        now.append(len(pickle.dumps(log.head(), protocol=4)))
        if k < len(wire):
            log.append(wire[k])
    return before, now


def synthetic(iterations: int, members: int) -> tuple[int, int]:
    """The same two sizes at iteration `iterations` of a population of `members` (every update a full
    one: `members` terms), computed, as a real run's would be."""
    from vrl.weights.update import FullRankUpdate

    wire = [FullRankUpdate(tuple((i * members + j, 1.5e-5 * (j + 1)) for j in range(members))).to_wire()
            for i in range(iterations)]
    before, now = es_state_bytes(wire)
    return before[-1], now[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, nargs="+", default=[3, 6, 12])
    parser.add_argument("--every", type=int, default=4, help="runtime.modal.snapshot_every of the runs with snapshots")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.modal_emulator import emulator_problem

    problem = emulator_problem()
    if problem:
        raise SystemExit(f"the Modal emulator cannot run here: {problem}")
    os.environ.setdefault("MODAL_TOKEN_ID", "ak-emulated")
    os.environ.setdefault("MODAL_TOKEN_SECRET", "as-emulated")
    rows = []
    for n in args.iterations:
        for every in (0, args.every):
            with tempfile.TemporaryDirectory(prefix="vrl-modal-payload-") as tmp:
                rows.append(measure(n, every, Path(tmp)))
            print(json.dumps({k: v for k, v in rows[-1].items() if not isinstance(v, list)}), flush=True)
    print("\n| iterations N | θ snapshots | cold calls | updates replayed (max) | catch-up s (max) |")
    print("|---|---|---|---|---|")
    for r in rows:
        every = f"every {r['snapshot_every']}" if r["snapshot_every"] else "none"
        print(f"| {r['iterations']} | {every} | {r['cold_calls']} | {r['cold_replayed_max']} | "
              f"{r['cold_catch_up_s_max']:.3f} |")
    longest = max((r for r in rows if not r["snapshot_every"]), key=lambda r: r["iterations"])
    print("\n| iteration | bytes per member call (measured) | its ES state | the ES state before the fix (computed) |")
    print("|---|---|---|---|")
    for k, (call, now, before) in enumerate(zip(longest["bytes_per_call"], longest["es_state_bytes"],
                                                 longest["es_state_bytes_before_fix"])):
        print(f"| {k} | {call:.0f} | {now} | {before} |")
    before, now = synthetic(400, 64)
    print(f"\nComputed, 64 members and every update full: at iteration 400 a call's ES state is {now} bytes "
          f"(before the fix: {before} bytes).")
    if args.out:
        args.out.write_text(json.dumps({"machine": platform.platform(), "python": platform.python_version(),
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
