"""The Modal emulator's gVisor rules for bubblewrap (tests/modal_emulator/gvisor.py) against a real gVisor.

Runs only where a runsc of release 20240729 or later is installed (`VRL_RUNSC`, else `runsc` on PATH) and this
process is root (`runsc do` needs it); otherwise skipped with the reason. Debian sid ships that build
(`apt-get download runsc/sid`, then `dpkg -x` it anywhere); bookworm's 20221219 cannot run bwrap at all (its
/proc lacks kernel/overflowuid). Modal runs a newer gVisor than any Debian build (docs/modal.md, "Tried on a
real gVisor"), so these tests check the rules a stand-in enforces, not the whole of Modal's kernel:

- rule 1 (a network namespace bwrap makes fails in its loopback set-up; google/gvisor#13438): the real
  refusal and the emulator's share bwrap's own message up to the errno (`loopback: Failed RTM_NEWADDR`), the
  part vrl's jail keys on;
- rule 2's cause (no /proc/sys/user/max_user_namespaces, which `--disable-userns` writes; google/gvisor#11210);
- bubblewrap itself runs there (its own pid and ipc namespaces), so the rules are the refusals, not all of it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EMULATED = Path(__file__).parent / "fixtures" / "gvisor" / "bwrap"
LOOPBACK = "bwrap: loopback: Failed RTM_NEWADDR"


def _runsc() -> tuple[str | None, str]:
    path = os.environ.get("VRL_RUNSC") or shutil.which("runsc")
    if path is None:
        return None, "no runsc (gVisor): set VRL_RUNSC or install one of release 20240729 or later"
    if os.geteuid() != 0:
        return None, "runsc do needs root"
    if shutil.which("bwrap") is None:
        return None, "no bwrap on PATH"
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    found = re.search(r"(20\d{6})", out)
    if not found or int(found.group(1)) < 20240729:
        return None, f"runsc {out.split(chr(10))[0]!r} is older than 20240729 (it cannot run bwrap at all)"
    return path, ""


RUNSC, WHY = _runsc()
pytestmark = pytest.mark.skipif(RUNSC is None, reason=WHY)


def under_gvisor(*argv: str) -> subprocess.CompletedProcess:
    """`argv` run by `runsc do`; tried again (3 tries) when runsc itself dies, exit 2 with nothing written: the
    Debian 20240729 build's sentry panics now and then (`assertTaskGoroutine`), whatever the program does."""
    for _ in range(3):
        res = subprocess.run([RUNSC, "--network=none", "do", *argv], capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL)
        if not (res.returncode == 2 and not res.stdout and not res.stderr):
            return res
    return res


def test_the_emulated_loopback_refusal_is_the_real_one_up_to_the_errno():
    bwrap = shutil.which("bwrap")
    real = under_gvisor(bwrap, "--ro-bind", "/", "/", "--unshare-net", "/bin/true")
    emulated = subprocess.run([str(EMULATED), "--ro-bind", "/", "/", "--unshare-net", "/bin/true"],
                              capture_output=True, text=True, timeout=60)
    assert real.returncode != 0 and LOOPBACK in real.stderr, real.stderr
    assert emulated.returncode != 0 and LOOPBACK in emulated.stderr, emulated.stderr
    # bwrap itself runs there (a shell inside it crashes the 20240729 Debian build's sentry every time)
    ok = under_gvisor(bwrap, "--ro-bind", "/", "/", "--unshare-pid", "--unshare-ipc", "/bin/echo", "ran")
    assert ok.returncode == 0 and ok.stdout.strip() == "ran", ok.stdout + ok.stderr


def test_gvisor_has_no_max_user_namespaces_which_disable_userns_writes():
    res = under_gvisor("/bin/sh", "-c", "test -e /proc/sys/user/max_user_namespaces && echo present || echo absent")
    assert res.stdout.strip() == "absent", res.stdout + res.stderr
    assert Path("/proc/sys/user/max_user_namespaces").exists()  # as on Linux: the rule is gVisor's


def test_the_jail_says_in_one_line_what_stops_it_under_gvisor():
    """runsc before 20240923 refuses every bwrap user namespace (gVisor bug f229b3e, fixed since); the jail's
    probe must then refuse in one line naming bubblewrap's error, never start half a sandbox."""
    probe = ("import sys; sys.path.insert(0, %r)\nfrom vrl import jail\ntry:\n    print('started', jail.probe())\n"
             "except jail.Unavailable as exc:\n    print('refused', exc)\n") % str(Path(__file__).parents[1])
    res = under_gvisor(sys.executable, "-I", "-c", probe)
    out = res.stdout.strip()
    assert res.returncode == 0 and len(out.splitlines()) == 1, res.stdout + res.stderr
    if out.startswith("refused"):
        assert "bubblewrap cannot create its sandbox here: bwrap: Failed to make / slave" in out
    else:  # a gVisor with the fix: the loopback rule makes the jail share the sandbox's network
        assert "network='shared'" in out and "gVisor" in out
