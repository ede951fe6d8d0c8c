#!/usr/bin/env python3
"""A stand-in for `lake env lean`, for testing the re-check host's plumbing without Lean.

Real Lean + Mathlib cannot run on the test machine. This script takes the two command shapes the host
uses and acts them out, as a separate process, as the host would see Lean do:

    fake_lean.py -o OUT.olean IN.lean          compile: writes OUT (the source, as a stand-in .olean)
    fake_lean.py --run CHECKER CAND REF NAME   check: prints the checker's JSON line for NAME

What each does is scripted by the JSON file named in $LEAN_FAKE_SCRIPT (the host keeps LEAN* variables
in its sandboxes), keyed by the compiled file's stem (`candidate` / `reference`) and `check`:
    {"candidate": "ok" | "error" | "hang" | "tamper" | "daemon" | "write_project" | "show_env",
     "reference": "ok" | "error",
     "check": "<fixture name>" | "compare" | "hang" | "crash" | "garbage"}
A compile that runs code, as a candidate whose compile ran the model's code would:
  `tamper` writes over the reference's .olean at once (and fails the compile if it cannot);
  `daemon` double-forks a daemon that, 0.5 s after the compile returned, writes the candidate's text over
    every reference .olean of the job it can reach, so that a checker reading it would find the two equal;
  `write_project` tries to plant files in the Lean project (Mathlib) and in $LEAN_FAKE_TOOLCHAIN.
`compare` answers like the real checker on these stand-in .oleans (their text): the types match when
the reference and the candidate state the same theorem, after a 1 s pause (the daemon's window).
The theorem `vrl_selftest` is always compared so, as the host's self-test needs an honest checker.
The checker's other lines are the hand-written ones in fixtures/recheck (see its README).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "recheck"


def _statement(text: str) -> str:
    """The `theorem ...` line of a stand-in .olean (the compiled source)."""
    return next((ln.strip() for ln in text.splitlines() if ln.startswith("theorem ")), "")


def _daemon(out: Path, text: str) -> None:
    if os.fork():
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    time.sleep(0.5)
    job = out.parent.parent
    for target in (job / "reference" / "reference.olean", job / "check" / "reference.olean"):
        try:
            target.write_text(text)
        except OSError:
            pass
    os._exit(0)


def _plant(out: Path) -> None:
    targets = [Path.cwd() / "Mathlib.olean"]
    if os.environ.get("LEAN_FAKE_TOOLCHAIN"):
        targets.append(Path(os.environ["LEAN_FAKE_TOOLCHAIN"]) / "Init.olean")
    for target in targets:
        try:
            target.write_text("planted")
            print(f"planted {target}")
        except OSError as exc:
            print(f"could not plant {target}: {exc}")


def _attack(out: Path) -> dict[str, str]:
    """Try what code in a compile would try: read host files and other jobs' folders, connect to a host
    socket, write outside its folder, take memory, write a huge file. Each answer: what happened."""
    import socket

    found: dict[str, str] = {}
    for path in json.loads(os.environ.get("LEAN_FAKE_READ", "[]")):
        try:
            found[f"read {path}"] = Path(path).read_text()[:200]
        except OSError as exc:
            found[f"read {path}"] = f"denied: {type(exc).__name__}"
    for path in json.loads(os.environ.get("LEAN_FAKE_SOCKETS", "[]")):
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(b"pwned")
            found[f"connect {path}"] = "connected"
        except OSError as exc:
            found[f"connect {path}"] = f"denied: {type(exc).__name__}"
    for path in json.loads(os.environ.get("LEAN_FAKE_WRITE", "[]")):
        try:
            Path(path).write_text("planted")
            found[f"write {path}"] = "written"
        except OSError as exc:
            found[f"write {path}"] = f"denied: {type(exc).__name__}"
    try:
        block = bytearray(int(os.environ.get("LEAN_FAKE_ALLOC_MB", "64")) << 20)
        block[::4096] = b"x" * len(block[::4096])
        found["memory"] = "allocated"
    except MemoryError:
        found["memory"] = "denied: MemoryError"
    try:
        (out.parent / "big").write_bytes(b"x" * (int(os.environ.get("LEAN_FAKE_FILE_MB", "4")) << 20))
        found["big file"] = "written"
    except OSError as exc:
        found["big file"] = f"denied: {type(exc).__name__}"
    return found


def main(argv: list[str]) -> int:
    script = json.loads(Path(os.environ["LEAN_FAKE_SCRIPT"]).read_text())
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
        if act == "attack":  # what code run by the compile could reach on the host (the round-5 host attacks)
            print("attack: " + json.dumps(_attack(out)))
            return 1
        if act == "symlink":  # leave the .olean as a link to something of the host's
            out.symlink_to(os.environ.get("LEAN_FAKE_LINK", "/proc/self/environ"))
            return 0
        if act == "flood":  # print far more than anyone should keep
            chunk = "x" * (1 << 20)
            for _ in range(int(os.environ.get("LEAN_FAKE_FLOOD_MB", "400"))):
                sys.stdout.write(chunk)
            return 1
        if act == "show_env":  # what code run by the compile could read
            print("env: " + " ".join(sorted(os.environ)))
            return 1
        if act == "tamper":
            try:
                (out.parent.parent / "reference" / "reference.olean").write_text("forged")
            except OSError as exc:
                print(f"tamper failed: {exc}")
                return 1
        if act == "daemon":
            _daemon(out, text)
        if act == "write_project":
            _plant(out)
        out.write_text(text)
        print(f"{src}:5:0: warning: declaration uses 'sorry'" if stem == "reference" else "")
        return 0
    if argv[:1] == ["--run"]:
        checker, cand, ref, name = argv[1:5]
        assert Path(checker).name == "VrlCheck.lean" and Path(checker).is_file(), checker
        assert Path(cand).is_file() and Path(ref).is_file()
        act = script.get("check", "agree")
        if name == "vrl_selftest":
            act = "compare"
        if act == "compare":
            time.sleep(1.0)
        else:
            assert "sorry" in Path(ref).read_text()
        if act == "hang":
            time.sleep(60)
        if act == "crash":
            print("VrlCheck could not run: no .olean", file=sys.stderr)
            return 1
        if act == "garbage":
            print("not json")
            return 0
        print("some warning Lean printed while compiling the checker")
        if act == "compare":
            same = _statement(Path(cand).read_text()) == _statement(Path(ref).read_text())
            line = json.loads((FIXTURES / f"{'agree' if same else 'type_mismatch'}.json").read_text())
        else:
            line = json.loads((FIXTURES / f"{act}.json").read_text())
        line["name"] = name
        line["fake_heartbeats"] = argv[5] if len(argv) > 5 else None  # what the host passed the checker
        print(json.dumps(line))
        return 0
    print(f"fake_lean: unexpected arguments {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
