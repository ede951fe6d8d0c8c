"""The emulator's fork servers (tests/modal_emulator/zygote.py): a container forked from one sees what a
fresh container of its kind sees, and the emulator's lifecycle handles it as it handles a fresh one."""

from __future__ import annotations

import secrets
import time


def _facts_app(token: str):
    import modal

    app = modal.App("zygote")
    vol = modal.Volume.from_name("zygote-data", create_if_missing=True)

    @app.function(serialized=True, volumes={"/data": vol}, env={"ZYGOTE_TOKEN": token}, max_containers=1)
    def facts():
        import os
        import pathlib
        import sys

        status = pathlib.Path("/proc/self/status").read_text()
        return {"modules": sorted(sys.modules), "env": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv,
                "path": sys.path, "pid": os.getpid(), "processes": sorted(p for p in os.listdir("/proc") if p.isdigit()),
                "data": sorted(os.listdir("/data")), "uid": os.getuid(), "session_leader": os.getsid(0) == os.getpid(),
                "caps": [line for line in status.splitlines() if line.startswith("Cap")],
                "main": sys.modules["__main__"].__spec__.name, "stdin": os.readlink("/proc/self/fd/0")}

    return app, vol, facts


def test_a_container_forked_from_a_zygote_sees_what_a_fresh_one_sees(emu, monkeypatch):
    """The first container of a kind starts fresh and reports its modules; once it has run an input the
    kind's zygote starts, and the next container forks from it: same modules, environment (its own ids),
    argv, sys.path, working directory, Volume view, PID namespace (the container is PID 2, as under
    bwrap), uid, capabilities, session and stdin as the fresh one."""
    from tests.modal_emulator import zygote

    monkeypatch.delenv(zygote.FRESH, raising=False)  # about the zygote: on even where the run opts out
    token = secrets.token_hex(4)
    app, _vol, facts = _facts_app(token)  # a kind of its own: no zygote yet
    (emu.volume("zygote-data") / "seed.txt").write_text("committed")
    seen = []
    with app.run():
        for _ in range(2):
            forked = zygote.starts["forked"]
            got = facts.remote()
            got["forked"] = zygote.starts["forked"] > forked
            seen.append(got)
            deadline = time.monotonic() + 120  # the zygote imports in the background
            while not [z for k, z in zygote._zygotes.items() if ("ZYGOTE_TOKEN", token) in k[3] and z.ready] \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
            emu.kill(got["env"]["MODAL_TASK_ID"])  # the next call needs a new container
            while got["env"]["MODAL_TASK_ID"] in emu.live_containers():
                time.sleep(0.05)
    fresh, forked = seen
    assert not fresh["forked"] and forked["forked"]
    for key in ("modules", "cwd", "argv", "path", "pid", "processes", "data", "uid", "session_leader", "caps", "main",
                "stdin"):
        assert forked[key] == fresh[key], key
    assert fresh["pid"] == 2 and fresh["main"] == "modal._container" and fresh["data"] == ["seed.txt"]
    ids = ("MODAL_TASK_ID", "VRL_MODAL_EMULATOR_CONTAINER")
    assert {k: v for k, v in forked["env"].items() if k not in ids} == {k: v for k, v in fresh["env"].items()
                                                                         if k not in ids}
    assert forked["env"]["MODAL_TASK_ID"] != fresh["env"]["MODAL_TASK_ID"]
