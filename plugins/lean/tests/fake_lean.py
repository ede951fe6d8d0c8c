#!/usr/bin/env python3
"""A stand-in for `lake env lean`, for testing the re-check host's plumbing without Lean.

Real Lean + Mathlib cannot run on the test machine. This script takes the two command shapes the host
uses and acts them out, as a separate process, as the host would see Lean do:

    fake_lean.py -o OUT.olean IN.lean          compile: writes OUT (the source, as a stand-in .olean)
    fake_lean.py --run CHECKER CAND REF NAME   check: prints the checker's JSON line for NAME

What each does is scripted by the JSON file named in $FAKE_LEAN_SCRIPT, keyed by the compiled
file's stem (`candidate` / `reference`) and `check`:
    {"candidate": "ok" | "error" | "hang" | "tamper", "reference": "ok" | "error",
     "check": "<fixture name>" | "hang" | "crash" | "garbage"}
`tamper` writes over the reference's .olean while "compiling" the candidate (a candidate that ran
code); the checker's lines are the hand-written ones in fixtures/recheck (see its README).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "recheck"


def main(argv: list[str]) -> int:
    script = json.loads(Path(os.environ["FAKE_LEAN_SCRIPT"]).read_text())
    if argv[:1] == ["-o"]:
        out, src = Path(argv[1]), Path(argv[2])
        stem = src.stem
        act = script.get(stem, "ok")
        text = src.read_text()
        if act == "hang":
            time.sleep(60)
        if act == "error":
            print(f"{src}:3:2: error: unknown identifier 'h₀'")
            return 1
        if act == "tamper":
            (out.parent.parent / "reference" / "reference.olean").write_text("forged")
        out.write_text(text)
        print(f"{src}:5:0: warning: declaration uses 'sorry'" if stem == "reference" else "")
        return 0
    if argv[:1] == ["--run"]:
        checker, cand, ref, name = argv[1:5]
        assert Path(checker).name == "VrlCheck.lean" and Path(checker).is_file(), checker
        assert "sorry" in Path(ref).read_text() and Path(cand).is_file()
        act = script.get("check", "agree")
        if act == "hang":
            time.sleep(60)
        if act == "crash":
            print("VrlCheck could not run: no .olean", file=sys.stderr)
            return 1
        if act == "garbage":
            print("not json")
            return 0
        print("some warning Lean printed while compiling the checker")
        line = json.loads((FIXTURES / f"{act}.json").read_text())
        line["name"] = name
        print(json.dumps(line))
        return 0
    print(f"fake_lean: unexpected arguments {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
