"""Start-up time of the `vrl` command and of `import vrl`, each a fresh process.

    python benchmarks/cli_startup.py [--runs 20] [--out result.json]

Times, as whole processes (one warm-up run each, then `--runs` counted runs, wall clock):
  * `python -c pass`, the interpreter's own floor,
  * `python -c "import vrl"`,
  * `vrl --help`, `vrl train --help` and `vrl plugins` (the installed console script),
and reports for each whether torch was imported (a second run of the same command under
`python -c`, which lists the heavy modules it loaded). Goal (issue 28): `vrl --help` under a second,
no torch. Prints a Markdown table; results are recorded in docs/benchmarks.md.
A benchmark, not a test: a loaded machine shifts every figure, so compare medians of one call.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HEAVY = ("torch", "transformers", "vllm", "triton", "safetensors", "matplotlib")
_MODULES = """
import json, sys
args = json.loads(sys.argv[1])
if args is None:
    import vrl
else:
    from vrl.cli import main
    try:
        main(args, prog_name="vrl", standalone_mode=False)
    except SystemExit:
        pass
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[2])))
print("HEAVY=" + json.dumps(heavy))
"""


def wall_times(argv: list[str], runs: int) -> list[float]:
    """Wall seconds of `runs` runs of `argv` to completion, after one uncounted warm-up."""
    out = []
    for i in range(runs + 1):
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if i:
            out.append(time.perf_counter() - start)
    return out


def heavy_modules(args: list[str] | None) -> list[str]:
    """The heavy libraries a fresh interpreter imported for `import vrl` (None) or `vrl ARGS`."""
    proc = subprocess.run([sys.executable, "-c", _MODULES, json.dumps(args), json.dumps(HEAVY)],
                          check=True, capture_output=True, text=True)
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("HEAVY="))
    return json.loads(line.removeprefix("HEAVY="))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="counted runs per command")
    parser.add_argument("--out", help="also write the numbers to this JSON file")
    args = parser.parse_args()
    vrl = shutil.which("vrl") or os.path.join(os.path.dirname(sys.executable), "vrl")
    cases = [
        ("python -c pass", [sys.executable, "-c", "pass"], None),
        ('python -c "import vrl"', [sys.executable, "-c", "import vrl"], "import"),
        ("vrl --help", [vrl, "--help"], ["--help"]),
        ("vrl train --help", [vrl, "train", "--help"], ["train", "--help"]),
        ("vrl plugins", [vrl, "plugins"], ["plugins"]),
    ]
    rows = []
    for label, argv, probe in cases:
        times = wall_times(argv, args.runs)
        heavy = None if probe is None else heavy_modules(None if probe == "import" else probe)
        rows.append({"command": label, "median_s": statistics.median(times), "min_s": min(times),
                     "max_s": max(times), "runs": len(times), "heavy_imported": heavy})
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"{platform.node()}: {os.cpu_count()} cores, python {platform.python_version()}, "
          f"load average {load:.2f} at the end" if load is not None else platform.node())
    print("\n| command | median | min | max | heavy modules imported |\n|---|---|---|---|---|")
    for r in rows:
        heavy = "—" if r["heavy_imported"] is None else (", ".join(r["heavy_imported"]) or "none")
        print(f"| `{r['command']}` | {r['median_s']:.3f} s | {r['min_s']:.3f} s | {r['max_s']:.3f} s | {heavy} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"python": platform.python_version(), "cores": os.cpu_count(), "load_average": load,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
