"""`bwrap` as it behaves under gVisor (runsc), the kernel Modal runs every Function and Sandbox on.

The emulator puts this program where `bwrap` is in each of its containers and sandboxes whose image
installs bubblewrap (images.py `Layout.bwrap`), never on this machine's own PATH: what vrl's verifiers
run inside a Modal container meets gVisor's refusals, and everything else is the real bubblewrap
(this program execs it with the same arguments). The refusals, each as bwrap prints it under gVisor:

1. A network namespace that bwrap creates itself (`--unshare-net`, or `--unshare-all` not followed by
   `--share-net`): bwrap brings up `lo` in it and gVisor's new namespace already has `lo` up with
   127.0.0.1, so the address request fails with EEXIST:
   ``bwrap: loopback: Failed RTM_NEWADDR: File exists``.
   https://github.com/google/gvisor/issues/13438 (open; its fix, PR 13471, was closed unmerged),
   https://github.com/containers/bubblewrap/issues/745 (open). bwrap's own message: network.c
   `loopback_setup` ("loopback: Failed RTM_NEWADDR").
2. `--disable-userns`: bwrap writes /proc/sys/user/max_user_namespaces, which gVisor does not have:
   ``bwrap: cannot open /proc/sys/user/max_user_namespaces: No such file or directory``.
   https://github.com/google/gvisor/issues/11210 (open). bwrap's message: bubblewrap.c, after
   `loopback_setup` (so rule 1 is reported first when both apply).

The options are read as bwrap reads them (bubblewrap.c `parse_args_recurse`): in order, each with its
own number of values, up to the command (or `--`); `--unshare-all` sets the network flag and
`--share-net` clears it, whichever comes last wins; `--args FD` is read (NUL-separated) and handed on
to the real bwrap unchanged.

A test can break bubblewrap outright, as on a host where it cannot work at all: a file `refuse` beside
this program (the service's `refuse_bwrap`) makes every call print its text and exit 1.
"""

from __future__ import annotations

import os
import sys

#: Where the emulator binds this machine's bubblewrap inside a container (images.py `Layout.bwrap`); the
#: plugins' tests run this program on the host through tests/fixtures/gvisor/bwrap, which names the real one.
REAL = os.environ.get("VRL_GVISOR_REAL_BWRAP", "/opt/emu/real-bwrap")
#: Beside this program in a container: when present, every call is refused with its text.
REFUSE = "/opt/emu/gvisor/refuse"

LOOPBACK = "bwrap: loopback: Failed RTM_NEWADDR: File exists"
NO_MAX_USERNS = "bwrap: cannot open /proc/sys/user/max_user_namespaces: No such file or directory"

# How many values each option of bubblewrap 0.8-0.11 takes (bwrap --help); any other `--x` takes none.
_VALUES = {
    **dict.fromkeys(("--args", "--argv0", "--userns", "--userns2", "--pidns", "--uid", "--gid", "--hostname",
                     "--chdir", "--unsetenv", "--lock-file", "--sync-fd", "--remount-ro", "--exec-label",
                     "--file-label", "--proc", "--dev", "--tmpfs", "--mqueue", "--dir", "--seccomp",
                     "--add-seccomp-fd", "--block-fd", "--userns-block-fd", "--info-fd", "--json-status-fd",
                     "--cap-add", "--cap-drop", "--perms", "--size", "--overlay-src", "--tmp-overlay",
                     "--ro-overlay"), 1),
    **dict.fromkeys(("--setenv", "--bind", "--bind-try", "--dev-bind", "--dev-bind-try", "--ro-bind",
                     "--ro-bind-try", "--bind-fd", "--ro-bind-fd", "--file", "--bind-data", "--ro-bind-data",
                     "--symlink", "--chmod"), 2),
    "--overlay": 3,
}


def options(argv: list[str], read_fd=None) -> list[str]:
    """The options bwrap acts on, in order (their values left out), `--args FD` expanded through
    `read_fd(fd) -> bytes`; parsing stops at the command, as bwrap's does."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            break
        if not arg.startswith("-"):
            break
        values = _VALUES.get(arg, 0)
        if arg == "--args" and i + 1 < len(argv) and read_fd is not None:
            data = read_fd(int(argv[i + 1]))
            out += options([a.decode() for a in data.split(b"\0") if a], read_fd)
        out.append(arg)
        i += 1 + values
    return out


def refusal(argv: list[str], read_fd=None) -> str | None:
    """What bwrap prints (and then exits 1) under gVisor for `argv`, or None when gVisor lets it run."""
    unshare_net = disable_userns = False
    for opt in options(argv, read_fd):
        if opt in ("--unshare-all", "--unshare-net"):
            unshare_net = True  # bubblewrap.c: --unshare-all sets opt_unshare_net (among others)
        elif opt == "--share-net":
            unshare_net = False
        elif opt == "--disable-userns":
            disable_userns = True
    if unshare_net:  # gVisor #13438, bubblewrap #745: loopback_setup runs first
        return LOOPBACK
    if disable_userns:  # gVisor #11210
        return NO_MAX_USERNS
    return None


def _read_args_fd(fd: int) -> bytes:
    """`--args FD`'s bytes, put back on the same descriptor (a fresh memfd at its start) for the real bwrap."""
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    data = b"".join(chunks)
    again = os.memfd_create("bwrap-args", 0)
    os.write(again, data)
    os.lseek(again, 0, os.SEEK_SET)
    os.dup2(again, fd, inheritable=True)
    os.close(again)
    return data


def main(argv: list[str]) -> int:
    if os.path.exists(REFUSE):
        with open(REFUSE) as f:
            sys.stderr.write(f.read().rstrip("\n") + "\n")
        return 1
    why = refusal(argv, _read_args_fd)
    if why is not None:
        sys.stderr.write(why + "\n")
        return 1
    os.execv(REAL, ["bwrap", *argv])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
