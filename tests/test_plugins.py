"""Plugin discovery through real entry points (dist-info metadata on sys.path), and failure isolation."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from vrl.plugins import Registry, UnknownNameError


def make_dist(root, dist, module, source, ep_name=None):
    """Install a plugin the way pip lays it out: a module plus a .dist-info with entry_points.txt."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-0.3.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3.1\n")
    (info / "entry_points.txt").write_text(f"[vrl]\n{ep_name or dist} = {module}\n")


GOOD = """
    import vrl
    from vrl.envs.countdown import CountdownEnvironment

    class Small(CountdownEnvironment):
        name = "small-countdown"

    @vrl.hookimpl
    def register_environments(register):
        register("small-countdown", Small)
"""


def test_installed_plugins_are_discovered():
    reg = Registry().load()
    assert {"countdown", "lean", "python-tests"} <= set(reg.names("environments"))
    assert reg.plugins["lean"].distribution == "vrl-lean"
    assert reg.plugins["python-tests"].distribution == "vrl-python-tests"
    assert reg.plugins["builtin"].registered["environments"] == ["countdown", "dataset", "guess", "letters", "sums"]


def test_third_party_entry_point_and_namespacing(tmp_path, monkeypatch):
    make_dist(tmp_path, "vrl-small", "vrl_small_plugin", GOOD, ep_name="small")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry().load()
    info = reg.plugins["small"]
    assert (info.distribution, info.version, info.error) == ("vrl-small", "0.3.1", None)
    assert info.registered["environments"] == ["small-countdown"]
    env = reg.environment("small-countdown", size=3)
    assert env.name == "small-countdown" and len(env.tasks()) == 3
    # every entry is also reachable as plugin:name
    assert reg.factory("environments", "builtin:countdown") is reg.factory("environments", "countdown")


def test_broken_plugin_is_reported_and_skipped(tmp_path, monkeypatch):
    make_dist(tmp_path, "vrl-broken", "vrl_broken_plugin", "import not_a_real_module_xyz\n", ep_name="broken")
    make_dist(tmp_path, "vrl-raises", "vrl_raises_plugin", """
        import vrl

        @vrl.hookimpl
        def register_environments(register):
            raise RuntimeError("database not configured")
    """, ep_name="raises")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry().load()
    assert "ModuleNotFoundError" in reg.plugins["broken"].error
    assert "not_a_real_module_xyz" in reg.plugins["broken"].error
    assert "register_environments raised RuntimeError: database not configured" in reg.plugins["raises"].error
    assert "countdown" in reg.names("environments")  # the rest still works
    with pytest.raises(UnknownNameError, match=r"unknown environment 'nope'; installed: .*countdown.*failed to load: broken, raises"):
        reg.environment("nope")


def test_conflicting_names_keep_the_first(tmp_path, monkeypatch):
    make_dist(tmp_path, "vrl-dup", "vrl_dup_plugin", """
        import vrl

        @vrl.hookimpl
        def register_environments(register):
            register("countdown", lambda **kw: None)
    """, ep_name="dup")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry().load()
    assert any("'countdown' registered by both 'builtin' and 'dup'" in c for c in reg.conflicts)
    assert reg.environment("countdown").name == "countdown"
    with pytest.raises(TypeError, match="not a vrl.Environment"):
        reg.environment("dup:countdown")


def test_cli_lists_plugins_and_survives_a_broken_one(tmp_path):
    make_dist(tmp_path, "vrl-broken", "vrl_broken_plugin", "raise SystemError('boom at import')\n", ep_name="broken")
    make_dist(tmp_path, "vrl-small", "vrl_small_plugin", GOOD, ep_name="small")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "vrl.cli", "plugins", "--json"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    plugins = {p["name"]: p for p in json.loads(out.stdout)}
    assert {"builtin", "lean", "python-tests", "small", "broken"} <= set(plugins)
    assert "SystemError: boom at import" in plugins["broken"]["error"]
    assert plugins["small"]["registered"]["environments"] == ["small-countdown"]
    table = subprocess.run([sys.executable, "-m", "vrl.cli", "plugins"], env=env, capture_output=True, text=True)
    assert table.returncode == 0 and "countdown" in table.stdout and "failed" in table.stdout


def test_threads_looking_names_up_at_once_all_find_them():
    """A pool's hosts look the run's environment up side by side (one thread each): the first collects the
    kind while the others wait for it, so none sees it half collected ("installed: none")."""
    import threading
    import time
    from types import SimpleNamespace

    import vrl
    from vrl.envs.letters import LettersEnvironment

    @vrl.hookimpl
    def register_environments(register):
        time.sleep(0.2)  # a plugin whose registration takes a moment (imports)
        register("slow-letters", LettersEnvironment)

    reg = Registry().load(entry_points=False, plugins={"slow": SimpleNamespace(register_environments=register_environments)})
    found, errors = [], []

    def look() -> None:
        try:
            found.append(reg.factory("environments", "slow-letters"))
        except Exception as exc:  # noqa: BLE001 - what the test counts
            errors.append(exc)

    threads = [threading.Thread(target=look) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and found == [LettersEnvironment] * 4
