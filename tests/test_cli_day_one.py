"""The small things a new user meets on day one (issue 26): an unwritable runs directory is named, `--seed`,
log lines that stay whole in a file, one short line for a broken plugin, a test script that installs no
system package unasked, no PyTorch scheduler warning from GRPO, W&B's missing key, an ill-formed task in
`vrl verify`."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from rich.console import Console

import vrl
from tests.test_cli_errors import SMALL, cli, one_line_error
from tests.test_cli_errors import vrl as vrl_cmd
from tests.test_plugins import make_dist
from vrl.cli import main
from vrl.errors import RunDirError

ROOT = Path(__file__).resolve().parents[1]


# -- logging.runs_dir ---------------------------------------------------------------------------------------
def test_a_runs_dir_blocked_by_a_file_is_named_in_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    for runs_dir in (tmp_path / "afile", tmp_path / "afile" / "runs"):
        line = cli("train", "--plugin", "letters", "--set", f"logging.runs_dir={runs_dir}", *SMALL)
        assert f"logging.runs_dir={runs_dir}: cannot create run directories there (a file is in the way)" in line
    with pytest.raises(RunDirError, match=r"^logging\.runs_dir=.*afile: cannot create run directories there"):
        vrl.Trainer(vrl.TrainConfig(plugin="letters", logging={"runs_dir": str(tmp_path / "afile")}))


@pytest.mark.slow
def test_a_runs_dir_the_system_refuses_is_named_with_exit_2(tmp_path, monkeypatch):
    """A directory the kernel refuses to create even for root (sysfs); a read-only file system (EROFS) used to
    exit 1 with raw errno text from the same place. In-process (click's runner, as the file-in-the-way case
    above): the kernel's refusal and the one line with exit 2 do not depend on a process of its own; the
    read-only case below keeps a real process (bubblewrap mounts the tree read-only for it)."""
    target = Path("/sys/vrl-runs-test")
    try:
        target.mkdir()
    except OSError as exc:
        reason = exc.strerror
    else:  # pragma: no cover - a /sys that takes directories: nothing to refuse here
        target.rmdir()
        pytest.skip("/sys accepts new directories on this machine")
    line = cli("train", "--plugin", "letters", "--set", f"logging.runs_dir={target}", *SMALL)
    assert f"logging.runs_dir={target}: cannot create run directories there ({reason})" in line, line
    assert "--set logging.runs_dir=PATH" in line, line


def test_a_runs_dir_on_a_read_only_file_system_is_named_with_exit_2(tmp_path):
    """A real read-only file system: the whole tree bind-mounted read-only by bubblewrap (this used to exit 1
    with raw errno text)."""
    bwrap = shutil.which("bwrap")
    probe = bwrap and subprocess.run([bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "true"],
                                     capture_output=True)
    if not probe or probe.returncode != 0:
        pytest.skip("needs a working bubblewrap to mount the tree read-only")
    res = subprocess.run([bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", sys.executable, "-m",
                          "vrl.cli", "train", "--plugin", "letters", "--set", f"logging.runs_dir={tmp_path / 'runs'}",
                          *SMALL], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                         env={**os.environ, "COLUMNS": "80"})
    one_line_error(res, f"logging.runs_dir={tmp_path / 'runs'}: cannot create run directories there "
                        "(Read-only file system)")


# -- --seed ---------------------------------------------------------------------------------------------------
def test_seed_flag_is_the_seed_field(tmp_path):
    shown = CliRunner().invoke(main, ["config", "--plugin", "letters", "--seed", "7"])
    assert shown.exit_code == 0 and yaml.safe_load(shown.stdout)["seed"] == 7
    common = ["--plugin", "letters", "-n", "1", "--set", f"logging.runs_dir={tmp_path}", *SMALL]
    for name, seed in (("flag", ["--seed", "3"]), ("set", ["--set", "seed=3"]), ("zero", [])):
        res = CliRunner().invoke(main, ["train", *common, "--name", name, *seed])
        assert res.exit_code == 0, res.output
    texts = {n: [json.loads(line)["completion"] for line in (tmp_path / n / "samples.jsonl").read_text().splitlines()]
             for n in ("flag", "set", "zero")}
    assert json.loads((tmp_path / "flag" / "config.json").read_text())["seed"] == 3
    assert texts["flag"] == texts["set"] and texts["flag"] != texts["zero"]  # seeded sampling: the same, or not
    line = cli("train", "--resume", str(tmp_path / "flag"), "--seed", "4")
    assert "--seed cannot be given" in line


def test_eval_takes_seed():
    args = ["eval", "--plugin", "letters", "--limit", "2", "--k", "2", "--json", "--set", "sampling.max_new_tokens=4"]
    flag = CliRunner().invoke(main, [*args, "--seed", "5"])
    assert flag.exit_code == 0, flag.output
    assert json.loads(flag.stdout) == json.loads(CliRunner().invoke(main, [*args, "--set", "seed=5"]).stdout)


# -- output -----------------------------------------------------------------------------------------------------
def test_iteration_lines_are_not_wrapped_when_the_output_is_not_a_terminal(tmp_path):
    """click's runner gives a pipe-like stream (as `vrl train > log` does): rich would wrap at 80 columns."""
    res = CliRunner().invoke(main, ["train", "--plugin", "letters", "-n", "2", "--name", "r",
                                    "--set", f"logging.runs_dir={tmp_path}", *SMALL])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.output.splitlines() if "iter " in line and ": reward" in line]
    assert len(lines) == 2, res.output
    for line in lines:
        assert len(line) > 80 and line.rstrip().endswith("s") and " loop " in line, line


def test_a_failed_plugin_warns_in_one_line_per_command(tmp_path):
    make_dist(tmp_path, "vrl-broken", "vrl_broken_plugin", "import not_a_real_module_xyz\n", ep_name="broken")
    make_dist(tmp_path, "vrl-raises", "vrl_raises_plugin", """
        import vrl

        @vrl.hookimpl
        def register_environments(register):
            raise RuntimeError("database not configured")

        @vrl.hookimpl
        def register_commands(cli):
            raise RuntimeError("no commands today")
    """, ep_name="raises")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "COLUMNS": "80"}
    res = vrl_cmd("config", "--plugin", "letters", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    warned = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(warned) == 2, res.stderr  # one line per broken plugin, however many of its hooks failed
    broken, raises = sorted(warned)
    assert "plugin 'broken' failed (ModuleNotFoundError) and was skipped; `vrl plugins` shows the error" in broken
    assert "plugin 'raises' failed (RuntimeError)" in raises
    listed = vrl_cmd("plugins", "--json", cwd=tmp_path, env=env)
    errors = {p["name"]: p["error"] for p in json.loads(listed.stdout)}
    assert "not_a_real_module_xyz" in errors["broken"]
    assert "database not configured" in errors["raises"] and "no commands today" in errors["raises"]


# -- scripts/test ---------------------------------------------------------------------------------------------
def _fake_system(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A PATH with the usual tools but no `bwrap`, and an `apt-get` that records its calls instead of installing."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "apt-calls"
    bin_dir.mkdir()
    for tool in ("bash", "env", "id", "cat", "dirname"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    (bin_dir / "apt-get").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (bin_dir / "apt-get").chmod(0o755)
    return {"PATH": str(bin_dir), "HOME": str(tmp_path)}, calls


def test_the_test_script_names_the_system_package_it_needs_and_installs_nothing_unasked(tmp_path):
    script = ROOT / "scripts" / "system-packages"
    env, calls = _fake_system(tmp_path)
    res = subprocess.run([str(script)], env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert "bubblewrap" in res.stderr and "apt-get install bubblewrap" in res.stderr
    assert "VRL_INSTALL_SYSTEM_PACKAGES=1" in res.stderr
    assert not calls.exists()  # nothing was installed
    if os.getuid() == 0:  # the opt-in installs (CI sets it)
        res = subprocess.run([str(script)], env={**env, "VRL_INSTALL_SYSTEM_PACKAGES": "1"}, capture_output=True,
                             text=True, stdin=subprocess.DEVNULL)
        assert res.returncode == 0, res.stderr
        assert "install -y -qq bubblewrap" in calls.read_text()
    test = (ROOT / "scripts" / "test").read_text()
    assert "apt-get" not in test and test.index("./scripts/system-packages") < test.index(".venv/bin/pip install")
    assert "VRL_INSTALL_SYSTEM_PACKAGES=1" in (ROOT / ".ci" / "run").read_text()


# -- GRPO's learning-rate schedule -----------------------------------------------------------------------------
def test_grpo_training_and_resume_emit_no_scheduler_warning(tmp_path):
    """PyTorch warns ("optimizer.step() has been overridden after learning rate scheduler initialization")
    when the optimizer's step is replaced after the schedule wraps it; vrl's GRPO never does."""
    layer = {"plugin": "letters", "optimizer": "grpo", "iterations": 2, "tasks_per_iteration": 2,
             "sampling.max_new_tokens": 4, "grpo.num_generations": 2, "grpo.lr_scheduler_type": "linear",
             "grpo.warmup_steps": 1, "logging.runs_dir": str(tmp_path), "logging.name": "g"}
    quiet = Console(file=io.StringIO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vrl.Trainer(vrl.resolve_config(layer), console=quiet).run()
        from vrl.rundir import RunDir

        more = vrl.resolve_config({"iterations": 3}, base=RunDir.open(tmp_path / "g").config())
        assert vrl.Trainer(more, run_dir=RunDir.open(tmp_path / "g"), console=quiet).run()["status"] == "finished"
    scheduler = [str(w.message) for w in caught if "lr_scheduler" in w.filename or "scheduler" in str(w.message)]
    assert scheduler == []


# -- W&B --------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_wandb_without_a_key_suggests_offline_mode(tmp_path, monkeypatch):
    """Real wandb, no API key and no login (a fresh HOME): it refuses at `wandb.init`; the one line says how to
    go on without an account."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    env = {"HOME": str(tmp_path), "WANDB_MODE": "online", "WANDB_CONFIG_DIR": str(tmp_path / "wandb"),
           "WANDB_SILENT": "true"}
    res = vrl_cmd("train", "--plugin", "letters", "--name", "w", "--set", "logging.wandb=true", *SMALL, cwd=tmp_path,
                  env=env)
    line = one_line_error(res, "metric sink wandb could not start", "WANDB_MODE=offline", "WANDB_API_KEY")
    assert "logging.sinks_best_effort=true" in line
    assert not (tmp_path / "runs" / "w").exists()


# -- vrl verify ---------------------------------------------------------------------------------------------------
def test_verify_refuses_an_ill_formed_task_with_one_line_and_writes_nothing(tmp_path):
    lines = "\n".join([
        json.dumps({"task": {"numbers": [3, 5, 7], "target": 22}, "completion": "<answer>3 * 5 + 7</answer>"}),
        json.dumps({"task": {"numbers": [3, 5]}, "completion": "<answer>3 * 5</answer>"}),
    ]) + "\n"
    out = tmp_path / "verdicts.jsonl"
    line = cli("verify", "-", "--out", str(out), input=lines)
    assert line.startswith("error: line 2: ill-formed task for environment 'countdown': id: Field required; "
                           "prompt: Field required;"), line
    assert "nothing was verified" in line and not out.exists()
