"""The Modal emulator's own tests: each rule it enforces bites (tests/modal_emulator/service.py lists them).

The emulated functions below are defined inside `make_app` (pickled by value, as a serialized function
defined in a test would be) and touch only the standard library and `modal`: the containers hold the
image's files, not this checkout.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import sys
import threading
import time
import warnings

import pytest


def make_app(**options):
    """An app with one function of each kind the rules need (built after the emulator swapped `modal` in)."""
    import modal

    app = modal.App("emulator-self-test")
    vol = modal.Volume.from_name("data", create_if_missing=True)
    opts = {"serialized": True, "volumes": {"/data": vol}, **options}

    @app.function(**opts)
    def whoami(x=None, sleep=0.0):
        import os
        import time

        time.sleep(sleep)
        return os.environ["MODAL_TASK_ID"], x

    @app.function(**opts)
    def fail_once(marker):
        import pathlib

        flag = pathlib.Path("/tmp") / marker  # per container: a retry on the same container sees it
        if not flag.exists():
            flag.write_text("x")
            raise ValueError("first attempt fails")
        return "second attempt"

    @app.function(**opts)
    def write(path, text, commit=True, keep_open=False, keep_mapped=False):
        import mmap
        import pathlib

        import modal

        pathlib.Path("/data", path).write_text(text)
        held = open(pathlib.Path("/data", path)) if keep_open or keep_mapped else None  # noqa: SIM115
        mapped = mmap.mmap(held.fileno(), 0, access=mmap.ACCESS_READ) if keep_mapped else None
        if keep_mapped:
            held.close()  # only the mapping holds the file now, as safetensors' safe_open does
        try:
            if commit:
                modal.Volume.from_name("data").commit()
        finally:
            if mapped is not None:
                mapped.close()
            elif held:
                held.close()
        return True

    @app.function(**opts)
    def read(path, reload=False):
        import pathlib

        import modal

        if reload:
            modal.Volume.from_name("data").reload()
        p = pathlib.Path("/data", path)
        return p.read_text() if p.exists() else None

    @app.cls(serialized=True, max_containers=1)
    class Warm:
        tag: str = modal.parameter(default="a")

        @modal.enter()
        def boot(self):
            import os

            self.entered = getattr(self, "entered", 0) + 1
            self.pid_ns_task = os.environ.get("MODAL_TASK_ID", "here")

        @modal.method()
        def state(self):
            return self.tag, self.entered, self.pid_ns_task

    return app, vol, {"whoami": whoami, "fail_once": fail_once, "write": write, "read": read, "Warm": Warm}


# -- names --------------------------------------------------------------------------------------------


def test_the_fake_client_uses_modal_1_6_4_names_and_keywords(emu):
    """Every keyword the fake accepts is one modal 1.6.4 accepts (read from the installed package)."""
    import importlib.machinery
    import importlib.util

    import modal as fake

    spec = importlib.machinery.PathFinder.find_spec("modal", [p for p in sys.path if "modal_emulator" not in p])
    if spec is None or "site-packages" not in (spec.origin or ""):
        pytest.skip("the real modal package is not installed")
    del sys.modules["modal"]  # load the real one next to the fake, briefly
    saved = {k: v for k, v in sys.modules.items() if k.startswith("modal.")}
    for k in saved:
        del sys.modules[k]
    real = importlib.util.module_from_spec(spec)
    sys.modules["modal"] = real
    try:
        spec.loader.exec_module(real)
        assert real.__version__ == fake.__version__ == "1.6.4"

        def names(fn):
            return {p for p in inspect.signature(fn).parameters if p not in ("self", "args", "kwargs", "packages",
                                                                             "modules", "_warn_parentheses_missing")}

        assert names(real.App.function) == fake.FUNCTION_OPTIONS
        assert names(real.App.cls) == fake.CLS_OPTIONS
        fake_sandbox = names(fake.Sandbox._create) - {"options"}
        assert names(real.Sandbox.create) == fake_sandbox | fake.SANDBOX_OPTIONS
        pairs = [(real.Image.debian_slim, fake.Image.debian_slim), (real.Image.from_registry, fake.Image.from_registry),
                 (real.Image.uv_pip_install, fake.Image.uv_pip_install), (real.Image.pip_install, fake.Image.pip_install),
                 (real.Image.env, fake.Image.env), (real.Image.add_local_python_source, fake.Image.add_local_python_source),
                 (real.Volume.from_name, fake.Volume.from_name), (real.Secret.from_name, fake.Secret.from_name),
                 (real.App.__init__, fake.App.__init__), (real.App.run, fake.App.run), (real.parameter, fake.parameter),
                 (real.enter, fake.enter), (real.method, fake.method), (real.FunctionCall.from_id, fake.FunctionCall.from_id),
                 (real.Volume.batch_upload, fake.Volume.batch_upload), (real.Volume.listdir, fake.Volume.listdir),
                 (real.Image.add_local_file, fake.Image.add_local_file), (real.Image.add_local_dir, fake.Image.add_local_dir),
                 (real.Image.run_commands, fake.Image.run_commands), (real.Image.apt_install, fake.Image.apt_install)]
        for r, f in pairs:
            assert names(f) <= names(r), (f.__qualname__, names(f) - names(r))
        for name in fake.__all__:
            assert hasattr(real, name), name
        for name in ("AuthError", "InvalidError", "NotFoundError", "ExecutionError", "DeserializationError",
                     "SerializationError", "AsyncUsageWarning", "RemoteError", "FunctionTimeoutError"):
            assert hasattr(real.exception, name), name
        assert real.io_streams.MAX_BUFFER_SIZE == fake.MAX_BUFFER_SIZE == 2 * 1024 * 1024
    finally:
        for k in [k for k in sys.modules if k == "modal" or k.startswith("modal.")]:
            del sys.modules[k]
        sys.modules["modal"] = fake
        sys.modules.update(saved)


# -- containers -----------------------------------------------------------------------------------------


def test_each_container_is_a_process_with_its_own_warm_state(emu):
    app, _vol, fns = make_app()
    with app.run():
        a, b = fns["Warm"](tag="a"), fns["Warm"](tag="b")
        first = [a.state.remote() for _ in range(3)]
        assert [s[:2] for s in first] == [("a", 1)] * 3  # @enter ran once in its container
        assert len({s[2] for s in first}) == 1
        other = b.state.remote()
        assert other[:2] == ("b", 1) and other[2] != first[0][2]  # other parameters: another container
        local = fns["Warm"](tag="c")
        assert local.state.local()[:2] == ("c", 1) and local.state.local()[:2] == ("c", 1)


def test_map_assigns_inputs_at_random_and_returns_them_as_they_finish(emu):
    app, _vol, fns = make_app(max_containers=2)
    with app.run():
        unordered = list(fns["whoami"].map(range(12), order_outputs=False))
        ordered = list(fns["whoami"].map(range(12)))
    assert sorted(x for _, x in unordered) == list(range(12))
    assert [x for _, x in unordered] != list(range(12))  # out of order
    assert [x for _, x in ordered] == list(range(12))
    assert len({cid for cid, _ in unordered + ordered}) <= 2  # max_containers


def test_arguments_and_results_cross_as_pickles(emu):
    import modal

    app = modal.App("pickles")

    @app.function(serialized=True)
    def echo(x):
        return x

    @app.function(serialized=True)
    def make_generator():
        return (i for i in range(3))

    with app.run():
        assert echo.remote({"a": [1, 2]}) == {"a": [1, 2]}
        with pytest.raises(TypeError, match="pickle"):
            echo.remote(threading.Lock())
        with pytest.raises(modal.exception.SerializationError, match="Failed to serialize result"):
            make_generator.remote()


def test_handles_cross_by_modal_1_6_4s_own_serializer(emu):
    """Arguments and results holding Modal handles go through the installed client's `modal._serialization`
    (emulated: the fake handles stand in as hydrated real ones). A Function handle round-trips, in both
    directions (the container's result too); a class handle or an instance of one does not: 1.6.4 drops the
    class's metadata, and the receiving container fails with DeserializationError. An unhydrated handle
    (its app stopped) cannot be serialized at all."""
    import modal
    from modal import _real

    if _real.real() is None:
        pytest.skip("the real modal package is not installed")
    app, _vol, fns = make_app()

    @app.function(serialized=True)
    def echo(x):
        return x

    with app.run():
        handle = echo.remote({"fn": fns["whoami"]})["fn"]
        assert handle.remote("again")[1] == "again"  # a handle that came back from a container still calls
        for refused in (fns["Warm"], fns["Warm"](tag="b")):
            with pytest.raises(modal.exception.DeserializationError, match="deserializing"):
                echo.remote([refused])
        stopped, _vol2, fns2 = make_app()
        with stopped.run():
            pass
        with pytest.raises(modal.exception.InvalidError, match="hasn't been hydrated"):
            echo.spawn(fns2["whoami"])


def test_exceptions_retries_and_return_exceptions(emu):
    import modal

    app, _vol, fns = make_app(max_containers=1)
    with app.run():
        with pytest.raises(ValueError, match="first attempt"):
            fns["fail_once"].remote("no-retries")
        results = list(fns["fail_once"].map(["m1"], return_exceptions=True))
        assert isinstance(results[0], ValueError)
    app2, _vol, fns2 = make_app(max_containers=1, retries=1)
    with app2.run():
        assert fns2["fail_once"].remote("retried") == "second attempt"
    with pytest.raises(modal.exception.ExecutionError, match="not running"):
        fns2["whoami"].remote()


def test_spawn_function_call_from_id_get_and_cancel(emu):
    import modal

    app, _vol, fns = make_app()
    with app.run():
        call = fns["whoami"].spawn("x", sleep=3.0)
        again = modal.FunctionCall.from_id(call.object_id)
        with pytest.raises(TimeoutError):
            again.get(timeout=0.1)
        assert again.get()[1] == "x"
        slow = fns["whoami"].spawn("y", sleep=30.0)
        slow.cancel()
        with pytest.raises(modal.exception.RemoteError, match="cancelled"):
            slow.get(timeout=5)


def test_a_cancelled_running_input_raises_input_cancellation_and_its_container_goes_on(emu):
    """`FunctionCall.cancel()` of a running input: modal/_container_entrypoint.py sends the container SIGUSR1,
    whose handler raises InputCancellation in the user code; the container stays and takes the next input."""
    import modal

    app = modal.App("cancel")

    @app.function(serialized=True, max_containers=1)
    def nap(sleep):
        import os
        import pathlib
        import time

        seen = pathlib.Path("/tmp/seen")
        if sleep < 0:
            return seen.read_text() if seen.exists() else None, os.environ["MODAL_TASK_ID"]
        try:
            time.sleep(sleep)
        except BaseException as exc:
            seen.write_text(type(exc).__name__)
            raise
        return "slept", os.environ["MODAL_TASK_ID"]

    with app.run():
        slow = nap.spawn(60)
        _wait_for(lambda: any(row["call"] == slow.object_id for row in emu.log))
        started = time.monotonic()
        slow.cancel()
        seen, container = nap.remote(-1)
        assert (seen, time.monotonic() - started < 30) == ("InputCancellation", True)
        assert container == [row["container"] for row in emu.log if row["call"] == slow.object_id][0]


def test_local_runs_in_this_process_without_the_volume(emu):
    app, _vol, fns = make_app()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyError):  # no MODAL_TASK_ID here: the body runs in this process
            fns["whoami"].local()
    assert any("will not have access to the mounted Volume" in str(w.message) for w in caught)


def test_preemption_restarts_the_input_on_another_container_without_using_a_retry(emu):
    app, _vol, fns = make_app()  # retries=0: a restart after preemption is not a retry
    started = []
    emu.on("input_started", lambda container, **_: started.append(container))
    with app.run():
        call = fns["whoami"].spawn("p", sleep=5.0)
        _wait_for(lambda: started)
        emu.preempt(started[0])
        cid, x = call.get(timeout=60)
    assert x == "p" and cid != started[0] and len(started) == 2


def test_a_crashed_container_has_its_input_rescheduled(emu):
    app, _vol, fns = make_app()
    started = []
    emu.on("input_started", lambda container, **_: started.append(container))
    with app.run():
        call = fns["whoami"].spawn("c", sleep=5.0)
        _wait_for(lambda: started)
        emu.kill(started[0])
        cid, _ = call.get(timeout=60)
    assert cid != started[0]


def test_nonpreemptible_functions_are_not_preempted_and_cannot_have_a_gpu(emu):
    import modal

    app, _vol, fns = make_app(nonpreemptible=True)
    started = []
    emu.on("input_started", lambda container, **_: started.append(container))
    with app.run():
        call = fns["whoami"].spawn(sleep=1.0)
        _wait_for(lambda: started)
        with pytest.raises(ValueError, match="nonpreemptible"):
            emu.preempt(started[0])
        call.get(timeout=30)
    app2, _vol, _fns = make_app(nonpreemptible=True, gpu="H100")
    with pytest.raises(modal.exception.InvalidError, match="GPU"):
        with app2.run():
            pass


def test_a_serialized_function_needs_the_clients_python_in_the_image(emu):
    import modal

    app = modal.App("versions")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "version_info", (3, 12, 0, "final", 0))  # the client that defines them

        @app.function(serialized=True, image=modal.Image.debian_slim(python_version="3.11"))
        def f():
            return 1

        @app.function(serialized=True)  # debian_slim's default: the client's Python
        def g():
            return 2

    with app.run():
        with pytest.raises(modal.exception.DeserializationError, match="version mismatch"):
            f.remote()
        assert g.remote() == 2


def test_the_container_holds_the_image_not_the_developer_venv(emu, monkeypatch):
    """A fresh interpreter in the image (VRL_MODAL_EMULATOR_FRESH: no fork server, tests/modal_emulator/zygote.py),
    as on Modal: the image's packages and files only, not the developer's venv or checkout."""
    import modal

    monkeypatch.setenv("VRL_MODAL_EMULATOR_FRESH", "1")

    app = modal.App("image")
    image = modal.Image.debian_slim().add_local_python_source("vrl", "vrl_python_tests")

    @app.function(serialized=True, image=image)
    def facts():
        import importlib.metadata as md
        import os
        import pathlib

        def installed(name):
            try:
                md.distribution(name)
                return True
            except md.PackageNotFoundError:
                return False

        import vrl  # importable: /root is on PYTHONPATH

        return {"cwd": os.getcwd(), "vrl": vrl.__file__, "checkout": pathlib.Path("/work").exists(),
                "vrl_core": installed("vrl-core"), "torch": installed("torch"),
                "entry_points": sorted(ep.name for ep in md.entry_points(group="vrl")),
                "data": pathlib.Path("/root/vrl_python_tests/data/tasks.jsonl").exists()}

    with app.run():
        got = facts.remote()
    assert got["cwd"] == "/root" and got["vrl"] == "/root/vrl/__init__.py" and not got["checkout"]
    assert not got["torch"] and not got["vrl_core"]  # only what the image installs: here, nothing
    assert got["entry_points"] == [] and not got["data"]  # no plugin metadata, only *.py files


def test_local_distributions_installed_in_the_image_are_real_installs(emu, tmp_path):
    """pip_install of a project the image holds installs it (metadata, entry points, package data);
    a build step after a mounted (copy=False) local layer is refused, as Modal refuses it."""
    import modal

    project = tmp_path / "proj"
    (project / "emu_probe").mkdir(parents=True)
    (project / "emu_probe" / "__init__.py").write_text("VALUE = 7\n")
    (project / "emu_probe" / "data.txt").write_text("packaged")
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "emu-probe"\nversion = "1.2.3"\n'
        '[project.entry-points.emu_probe_group]\nprobe = "emu_probe"\n'
        '[tool.setuptools.package-data]\nemu_probe = ["*.txt"]\n')
    installed = modal.Image.debian_slim().add_local_dir(project, "/src/proj", copy=True).pip_install("/src/proj")
    app = modal.App("installs")

    @app.function(serialized=True, image=installed)
    def probe():
        import importlib.metadata as md
        import importlib.resources

        import emu_probe

        return (md.version("emu-probe"), [ep.name for ep in md.entry_points(group="emu_probe_group")],
                importlib.resources.files("emu_probe").joinpath("data.txt").read_text(), emu_probe.VALUE)

    with app.run():
        assert probe.remote() == ("1.2.3", ["probe"], "packaged", 7)
    mounted = modal.Image.debian_slim().add_local_dir(project, "/src/proj").pip_install("/src/proj")
    app2 = modal.App("mounted")

    @app2.function(serialized=True, image=mounted)
    def nothing():
        return None

    with pytest.raises(modal.exception.InvalidError, match="build step after using `image.add_local_\\*`"):
        with app2.run():
            pass


# -- volumes --------------------------------------------------------------------------------------------


def test_commit_and_reload_only_inside_a_container(emu):
    app, vol, _fns = make_app()
    with pytest.raises(RuntimeError, match="commit\\(\\) can only be called on a mounted volume inside a container"):
        vol.commit()
    with pytest.raises(RuntimeError, match="inside a container"):
        vol.reload()


def test_a_write_is_seen_elsewhere_only_after_commit_and_reload(emu):
    app, vol, fns = make_app()
    with app.run():
        assert fns["read"].remote("a.txt") is None  # this container now mounts the state without a.txt
        reader = emu.running("read")[0]
        fns["write"].remote("a.txt", "uncommitted", commit=False)
        with pytest.raises(FileNotFoundError):
            b"".join(vol.read_file("a.txt"))  # the client sees committed state only
        fns["write"].remote("a.txt", "one")
        assert b"".join(vol.read_file("a.txt")) == b"one"
        assert fns["read"].remote("a.txt") is None  # same reader container: no reload yet
        assert emu.running("read") == [reader]
        assert fns["read"].remote("a.txt", reload=True) == "one"


def test_reload_is_refused_while_a_file_of_the_volume_is_open(emu):
    app, _vol, fns = make_app()
    with app.run():
        with pytest.raises(RuntimeError, match="there are open files preventing the operation: path /data/b.txt"):
            fns["write"].remote("b.txt", "x", keep_open=True)  # commit() reloads
        # A memory-mapped file (safetensors maps the weights it loads) holds the Volume open too.
        with pytest.raises(RuntimeError, match="there are open files preventing the operation: path /data/m.txt"):
            fns["write"].remote("m.txt", "x", keep_mapped=True)


def test_concurrent_writers_last_commit_wins_per_file(emu):
    import modal

    app = modal.App("writers")
    vol = modal.Volume.from_name("shared", create_if_missing=True)

    @app.cls(serialized=True, volumes={"/v": vol})
    class Writer:
        who: str = modal.parameter()

        @modal.method()
        def write(self, name, text):
            import pathlib

            pathlib.Path("/v", name).write_text(text)

        @modal.method()
        def commit(self):
            modal.Volume.from_name("shared").commit()

    with app.run():
        a, b = Writer(who="a"), Writer(who="b")
        a.write.remote("same.txt", "from a")
        b.write.remote("same.txt", "from b")
        a.write.remote("only-a.txt", "a")
        b.write.remote("only-b.txt", "b")
        b.commit.remote()
        a.commit.remote()  # later: its same.txt wins; b's other file survives
    files = {p.name: p.read_text() for p in emu.volume("shared").iterdir()}
    assert files == {"same.txt": "from a", "only-a.txt": "a", "only-b.txt": "b"}


def test_a_graceful_exit_commits_and_a_crash_loses_uncommitted_writes(emu):
    app, vol, fns = make_app()
    with app.run():
        fns["write"].remote("kept.txt", "k", commit=False)
    _wait_for(lambda: not emu.running("write"))  # the app stopped: its containers end gracefully
    assert (emu.volume("data") / "kept.txt").read_text() == "k"
    with app.run():
        fns["write"].remote("lost.txt", "l", commit=False)
        emu.kill(emu.running("write")[0])
        _wait_for(lambda: not emu.running("write"))
    assert not (emu.volume("data") / "lost.txt").exists()


def test_batch_upload_writes_the_committed_volume_from_the_client(emu, tmp_path):
    import modal

    vol = modal.Volume.from_name("up", create_if_missing=True)
    (tmp_path / "w.bin").write_bytes(b"abc")
    app = modal.App("up")

    @app.function(serialized=True, volumes={"/up": vol})
    def size(path):
        import os

        return os.path.getsize(path)

    with app.run():
        with vol.batch_upload() as batch:
            batch.put_file(tmp_path / "w.bin", "/weights/v1.bin")
        assert size.remote("/up/weights/v1.bin") == 3
        with pytest.raises(FileExistsError):
            with vol.batch_upload() as batch:
                batch.put_file(tmp_path / "w.bin", "/weights/v1.bin")


# -- sandboxes ------------------------------------------------------------------------------------------


def _sandbox(app, *argv, **options):
    import modal

    return modal.Sandbox.create(*argv, app=app, **options)


def test_sandbox_stdin_is_capped_at_2_mib_per_drain_and_stdout_arrives_as_lines(emu):
    import modal

    app = modal.App("sb")
    with app.run():
        sb = _sandbox(app, "python", "-c", "import sys\nfor line in sys.stdin: print(len(line))")
        with pytest.raises(BufferError, match="Buffer size exceed limit"):
            sb.stdin.write("x" * (2 * 1024 * 1024 + 1))
        sb.stdin.write("y" * 1000 + "\n")
        sb.stdin.write("z" * (2 * 1024 * 1024 - 1001))  # exactly 2 MiB buffered: allowed
        with pytest.raises(BufferError):
            sb.stdin.write("!")
        sb.stdin.write_eof()
        sb.stdin.drain()

        async def lines():
            return [line async for line in sb.stdout]

        got = asyncio.run(lines())
        sb.wait()
    assert got == ["1001\n", f"{2 * 1024 * 1024 - 1001}\n"] and sb.returncode == 0
    with pytest.raises(modal.exception.InvalidError, match="App"):
        modal.Sandbox.create("true")


def test_blocking_sandbox_calls_in_an_event_loop_warn_like_modal(emu):
    import modal

    app = modal.App("sb")
    with app.run():
        async def go():
            sb = await modal.Sandbox.create.aio("sleep", "30", app=app)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert await sb.poll.aio() is None  # the async interface: no warning
                assert not caught
                sb.poll()  # the blocking one inside the loop
            await sb.terminate.aio()
            return caught

        caught = asyncio.run(go())
    assert [w.category for w in caught] == [modal.exception.AsyncUsageWarning]


def test_sandbox_env_network_and_workdir(emu, monkeypatch):
    import modal

    monkeypatch.setenv("SECRET_OF_THE_CLIENT", "s3cret")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    probe = ("import os, socket, sys\nprint(os.getcwd(), os.environ.get('SECRET_OF_THE_CLIENT'), os.environ.get('X'))\n"
             f"s = socket.socket()\ntry:\n s.connect(('127.0.0.1', {port})); print('net')\nexcept OSError: print('nonet')")
    app = modal.App("sb")
    try:
        with app.run():
            out = []
            for options in ({"block_network": False, "env": {"X": "1"}}, {"block_network": True, "workdir": "/tmp"}):
                sb = _sandbox(app, "python", "-c", probe, **options)
                sb.wait()
                out.append(sb.stdout.read())
    finally:
        server.close()
    assert out == ["/root None 1\nnet\n", "/tmp None None\nnonet\n"]


def _wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


# -- timeouts, call identity, Dicts (issue 25: a detached run that survives) ----------------------------


def test_the_fake_dict_call_id_and_remove_file_use_modal_1_6_4_names(emu):
    """The names added for the run lease exist in modal 1.6.4 with these keywords (read from its source)."""
    import ast
    import importlib.machinery
    from pathlib import Path

    import modal as fake

    spec = importlib.machinery.PathFinder.find_spec("modal", [p for p in sys.path if "modal_emulator" not in p])
    if spec is None or "site-packages" not in (spec.origin or ""):
        pytest.skip("the real modal package is not installed")
    root = Path(spec.origin).parent

    def real_params(relpath: str, qualname: str) -> set[str]:
        tree = ast.parse((root / relpath).read_text())
        cls, _, fn = qualname.rpartition(".")
        scope = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls) if cls else tree
        node = next(n for n in ast.walk(scope) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == fn)
        args = node.args
        return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs} - {"self"}

    def fake_params(fn) -> set[str]:
        return set(inspect.signature(getattr(fn, "fn", fn)).parameters) - {"self"}

    assert fake_params(fake.Dict.from_name) <= real_params("dict.py", "_Dict.from_name")
    for name in ("get", "put", "pop", "contains"):
        assert fake_params(vars(fake.Dict)[name]) <= real_params("dict.py", f"_Dict.{name}"), name
    assert fake_params(fake.Volume.remove_file) <= real_params("volume.py", "_Volume.remove_file")
    assert "current_function_call_id" in (root / "__init__.py").read_text()


def test_dict_put_skip_if_exists_is_atomic_and_shared_with_containers(emu):
    import modal

    app = modal.App("dict-test")

    @app.function(serialized=True)
    def claim(key, who):
        import modal

        return modal.Dict.from_name("leases").put(key, who, skip_if_exists=True)

    with pytest.raises(modal.exception.NotFoundError):
        modal.Dict.from_name("leases").get("x")
    leases = modal.Dict.from_name("leases", create_if_missing=True)
    assert leases.put("a", "client", skip_if_exists=True) is True
    with app.run():
        won = list(claim.map(["b"] * 4, ["w1", "w2", "w3", "w4"]))
        assert sorted(won) == [False, False, False, True]  # exactly one writer wins a key
        assert claim.remote("a", "container") is False
    assert leases["a"] == "client" and leases.get("b") in {"w1", "w2", "w3", "w4"} and "b" in leases
    assert leases.pop("a") == "client" and leases.get("a", "gone") == "gone"


def test_a_restarted_input_keeps_its_call_id_and_a_running_call_polls_as_timeout(emu):
    import modal

    app = modal.App("call-id-test")

    @app.function(serialized=True, volumes={"/data": modal.Volume.from_name("data", create_if_missing=True)})
    def who(sleep):
        import os
        import time

        import modal

        seen = modal.current_function_call_id()
        time.sleep(sleep)
        return seen, os.environ["MODAL_TASK_ID"]

    started: list[str] = []
    emu.on("input_started", lambda container, **_: started.append(container))
    assert modal.current_function_call_id() is None  # the client is no container
    with app.run():
        call = who.spawn(3.0)
        _wait_for(lambda: started)
        with pytest.raises(TimeoutError):  # the builtin, as modal's poll_function raises it
            modal.FunctionCall.from_id(call.object_id).get(timeout=0)
        emu.preempt(started[0])
        seen, container = call.get(timeout=60)
    assert seen == call.object_id and container != started[0] and len(started) == 2


def test_an_input_past_its_timeout_is_terminated_retried_then_fails(emu):
    import modal

    app = modal.App("timeout-test")

    @app.function(serialized=True, timeout=1, retries=1)
    def slow(sleep):
        import time

        time.sleep(sleep)
        return "done"

    started: list[str] = []
    emu.on("input_started", lambda container, **_: started.append(container))
    with app.run():
        assert slow.remote(0.0) == "done"
        with pytest.raises(modal.exception.FunctionTimeoutError):
            slow.remote(30.0)
    assert len(started) == 3  # the fast call, then the slow one's attempt and its retry


def test_remove_file_changes_the_committed_volume_from_the_client(emu, tmp_path):
    import modal

    emu.volume("files")  # created, as the first app that mounts it would
    vol = modal.Volume.from_name("files")
    (tmp_path / "w").write_bytes(b"x")
    with vol.batch_upload() as up:
        up.put_file(tmp_path / "w", "runs/a/w1")
        up.put_file(tmp_path / "w", "runs/a/w2")
    vol.remove_file("runs/a/w1")
    assert [e.path for e in vol.listdir("runs/a")] == ["runs/a/w2"]
    with pytest.raises(IsADirectoryError):
        vol.remove_file("runs/a")
    vol.remove_file("runs", recursive=True)
    assert vol.listdir("/") == []


def test_idle_containers_scale_down_but_not_below_min_containers(emu):
    """`scaledown_window`: an idle container stops after it; `min_containers`: that many stay running."""
    for minimum, alive in ((0, 0), (1, 1)):
        app, _vol, fns = make_app(scaledown_window=2, min_containers=minimum)
        with app.run():
            cid, _ = fns["whoami"].remote()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(emu.running("whoami")) != alive:
                time.sleep(0.2)
            time.sleep(3)  # past the window again: the kept one stays
            assert len(emu.running("whoami")) == alive, minimum
            if alive:
                assert fns["whoami"].remote()[0] == cid  # still warm: the same container


def test_a_sandbox_without_stdin_for_its_idle_timeout_is_terminated(emu):
    """`idle_timeout` (modal.com/docs/guide/sandbox): no exec, no stdin write, no tunnel for that long and
    the sandbox ends; writing stdin keeps it alive."""
    import modal

    app = modal.App("sb-idle")
    with app.run():
        idle = modal.Sandbox.create("sleep", "60", app=app, idle_timeout=2)
        busy = modal.Sandbox.create("cat", app=app, idle_timeout=2)
        for _ in range(8):  # 4 s of writes, every half second
            busy.stdin.write("x\n")
            busy.stdin.drain()
            time.sleep(0.5)
        assert idle.poll() is not None and busy.poll() is None
        busy.terminate()


def test_a_killed_container_leaves_no_process_below_it():
    """The emulator kills a container's or sandbox's whole process tree, not only its top process: bwrap's
    PID 1 inside the namespace outlived a container about once a suite run when the outer bwrap was
    killed just after it forked. Here a shell whose background child ignores its parent's death (no
    namespace, no death signal) stands for that PID 1: killing the shell alone leaves the child."""
    import subprocess

    from tests.modal_emulator.service import _kill
    from vrl import reaper

    proc = subprocess.Popen(["bash", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    [identity] = [i for i in reaper.children(proc.pid) if i[0] == child]
    _kill(proc)
    proc.wait()
    deadline = time.monotonic() + 5
    while reaper.alive(identity) and time.monotonic() < deadline:  # a killed zombie counts as ended
        time.sleep(0.05)
    assert not reaper.alive(identity)


# -- gVisor's rules for bubblewrap (issue 54) --------------------------------------------------------------

BWRAP_CASES = [  # bwrap's options before `--ro-bind / / --proc /proc --dev /dev true`, and what gVisor answers
    ("--unshare-all", "loopback"),
    ("--unshare-net --unshare-pid", "loopback"),
    ("--share-net --unshare-all", "loopback"),  # in order: --unshare-all sets the network flag again
    ("--unshare-all --share-net --unshare-user --disable-userns", "userns"),
    ("--unshare-all --unshare-user --disable-userns", "loopback"),  # bwrap sets up loopback first
    ("--unshare-all --share-net", "runs"),  # the sandbox starts, in its own user, pid, ipc, uts namespaces
    ("--setenv X --unshare-net --unshare-pid", "runs"),  # a value, not an option
]
BWRAP_PROBE = "\n".join(f'bwrap {args} --ro-bind / / --proc /proc --dev /dev true 2>&1; echo "=> $?"'
                        for args, _ in BWRAP_CASES)


def _bwrap_answers(out: str) -> list[str]:
    """Each case's outcome from BWRAP_PROBE's output: runs, loopback, userns, or what bwrap printed."""
    from tests.modal_emulator.gvisor import LOOPBACK, NO_MAX_USERNS

    answers, printed = [], []
    for line in out.splitlines():
        if not line.startswith("=> "):
            printed.append(line)
            continue
        text = "\n".join(printed)
        answers.append("runs" if line == "=> 0" and not text else "loopback" if text == LOOPBACK and line == "=> 1"
                       else "userns" if text == NO_MAX_USERNS and line == "=> 1" else f"{line}: {text}")
        printed = []
    return answers


def test_bwrap_in_containers_and_sandboxes_refuses_what_gvisor_refuses(emu):
    """Issue 54. Modal runs containers and Sandboxes on gVisor, where bwrap cannot set up loopback in a
    network namespace of its own (gVisor #13438, bubblewrap #745) nor open max_user_namespaces for
    --disable-userns (gVisor #11210). The emulator's containers and sandboxes refuse both, with bwrap's
    messages, and run the real bubblewrap (a nested sandbox of its own namespaces) otherwise; an image
    without bubblewrap has none; this machine's bwrap is untouched; `refuse_bwrap` breaks it outright."""
    import subprocess

    import modal

    expected = [answer for _, answer in BWRAP_CASES]
    image = modal.Image.debian_slim().apt_install("bubblewrap")
    app = modal.App("gvisor")

    @app.function(image=image, serialized=True)
    def probe(script):
        import subprocess

        return subprocess.run(["sh", "-c", script], capture_output=True, text=True).stdout

    def sandbox(script, **options):
        sb = modal.Sandbox.create("sh", "-c", script, app=app, **options)
        sb.wait()
        return sb.stdout.read()

    with app.run():
        assert _bwrap_answers(sandbox(BWRAP_PROBE, image=image)) == expected
        assert _bwrap_answers(probe.remote(BWRAP_PROBE)) == expected
        assert sandbox("command -v bwrap || echo none") == "none\n"  # debian_slim: no bubblewrap
        emu.refuse_bwrap("bwrap: setting up uid map: Permission denied")
        assert sandbox("bwrap --ro-bind / / true 2>&1; echo $?", image=image) == \
            "bwrap: setting up uid map: Permission denied\n1\n"
    host = subprocess.run(["bwrap", "--unshare-net", "--ro-bind", "/", "/", "true"], capture_output=True, text=True)
    assert host.returncode == 0, host.stderr  # the tests' own bubblewrap is this machine's


def test_the_gvisor_shim_reads_options_as_bwrap_does():
    """The shim's parser (no container): option values are skipped by each option's arity, parsing stops at
    the command, and `--args FD` is read and handed on unchanged to the real bwrap."""
    import os

    from tests.modal_emulator import gvisor

    assert gvisor.refusal(["--ro-bind", "/", "/", "--", "sh", "--unshare-net"]) is None  # the command's argument
    assert gvisor.refusal(["--chmod", "0755", "--unshare-all", "/x", "true"]) is None  # a value of --chmod
    assert gvisor.refusal(["--overlay", "a", "b", "c", "--unshare-net", "true"]) == gvisor.LOOPBACK
    read, write = os.pipe()
    os.write(write, b"--unshare-all\0--share-net\0--disable-userns\0")
    os.close(write)
    try:
        assert gvisor.refusal(["--args", str(read), "true"], gvisor._read_args_fd) == gvisor.NO_MAX_USERNS
        assert os.read(read, 100) == b"--unshare-all\0--share-net\0--disable-userns\0"  # for the real bwrap
    finally:
        os.close(read)
