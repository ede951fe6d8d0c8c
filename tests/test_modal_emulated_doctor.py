"""`vrl modal doctor` end to end on the Modal emulator (tests/modal_emulator).

Emulated: the Modal service (the run's images as filesystems of the venv's distributions, containers as
processes, calls whose handles cross modal's own serializer, the Volume's commit and reload, Sandboxes).
The emulator has no GPU and no vllm (the venv has none): the checklist must say so rather than pass.
"""

from __future__ import annotations

from click.testing import CliRunner

from vrl.cli import main


def test_doctor_checks_images_handles_volume_gpu_and_a_sandbox_and_says_what_is_missing(emu, tmp_path):
    """Every check runs and prints its time and cost; the orchestrator receives a run's real arguments
    (with the old class-instance worker it failed here with DeserializationError), the Volume round-trips
    a file, a countdown verifier sandbox comes up; no CUDA and no vllm in the GPU container: exit 1."""
    result = CliRunner().invoke(main, ["modal", "doctor", "--quiet", "--set", "runtime.modal.max_containers=1"])
    lines = [" ".join(line.split()) for line in result.output.splitlines()]
    text = "\n".join(lines)
    assert result.exit_code == 1, text

    def line(start: str) -> str:
        found = [ln for ln in lines if ln.startswith(start)]
        assert len(found) == 1, (start, text)
        return found[0]

    assert line("ok app starts")
    assert "vrl " in line("ok orchestrator image imports vrl, torch; the handles crossed")
    assert line("ok Volume round trip")
    assert "vllm not importable" in line("FAIL GPU image imports vrl, torch, vllm")
    assert "CUDA not available" in line("FAIL CUDA sees the GPU (H100)")
    assert line("ok verifier sandbox (countdown) ready")
    assert all(" s, " in ln and " ¢ — " in ln for ln in lines if ln.startswith(("ok ", "FAIL ")))
    assert line("ok model tiny on the Volume (workers load it offline)")
    assert "5/7 checks passed" in text
    assert not list((emu.volume("vrl") / "doctor").glob("*"))  # its files are removed


def _lines(result):
    return [" ".join(line.split()) for line in result.output.splitlines()]


def test_doctor_says_in_one_line_why_the_app_did_not_start(emu, monkeypatch):
    """Issue 54 item 6. A token Modal refuses, a Secret that does not exist, an image that does not build:
    each is the checklist's one FAIL line (and exit 1), not a traceback. Emulated: the service refuses an
    unknown token at the client's first call (AuthError), a missing Secret at `app.run()` (NotFoundError),
    and a build step after a mounted local file (InvalidError, Modal's message)."""
    from vrl.runtime.modal import images

    quiet = ["modal", "doctor", "--quiet"]
    with monkeypatch.context() as wrong:
        wrong.setenv("MODAL_TOKEN_SECRET", "as-not-this-one")
        refused = CliRunner().invoke(main, quiet)
    missing = CliRunner().invoke(main, [*quiet, "--set", "runtime.modal.secrets=['huggingface']"])
    built = images.ImageRecipe.build

    def unbuildable(recipe):  # a build step after a local file that is mounted, not copied
        return built(recipe).add_local_file(__file__, "/opt/here.py").pip_install("six")

    monkeypatch.setattr(images.ImageRecipe, "build", unbuildable)
    broken = CliRunner().invoke(main, quiet)
    for result, line in ((refused, "FAIL Modal accepts this token: "), (missing, "FAIL Secrets exist (huggingface): "),
                         (broken, "FAIL app starts (images build, functions register): ")):
        text = "\n".join(_lines(result))
        assert result.exit_code == 1 and "Traceback" not in text, text
        assert [ln for ln in _lines(result) if ln.startswith(("ok ", "FAIL "))][0].startswith(line), text
        assert "0/1 checks passed" in text
    assert "AuthError" in refused.output and "NotFoundError: Secret 'huggingface' not found" in missing.output
    assert "InvalidError: An image tried to run a build step after using `image.add_local_*`" in broken.output


def test_doctor_names_bubblewrap_when_the_verifier_sandbox_cannot_make_its_sandbox(emu, tmp_path):
    """Issue 54. python-tests' verifier sandbox, with bubblewrap broken in it (as under gVisor when it cannot
    make its namespaces): the doctor's sandbox line is the plugin's own one-line reason naming bubblewrap,
    not SandboxUnavailable's wrapping of it nor a traceback. And where bubblewrap works under gVisor's
    rules, the sandbox comes up, priced at the memory it gets."""
    from tests.modal_emulated import modal_config
    from vrl.runtime.modal.app import build_app
    from vrl.runtime.modal.doctor import _sandbox_check, format_check

    cfg = modal_config(tmp_path, plugin="python-tests", runtime={"verify_in": "sandbox"})
    app = build_app(cfg)
    with app.app.run():
        ready = _sandbox_check(cfg, app)
        emu.refuse_bwrap("bwrap: No permissions to creating new namespace, likely because the kernel does not allow "
                         "non-privileged user namespaces.")
        broken = _sandbox_check(cfg, app)
    assert ready.ok and ready.detail == "ready (8 GiB)", format_check(ready)
    line = format_check(broken)
    assert not broken.ok and "\n" not in line and "bubblewrap cannot create its sandbox here" in broken.detail, line
    assert broken.detail.startswith("cannot build the 'python-tests' verifier: "), line


def test_doctor_prices_a_sandbox_at_the_memory_its_spec_asks_for(monkeypatch):
    """A Lean sandbox asks 8 GiB per REPL (4 REPLs: 32 GiB); the doctor priced it at runtime.modal.sandbox_memory_mb
    (8 GiB). The sandbox check alone, with a pool that starts at once (no Modal here)."""
    from types import SimpleNamespace

    from vrl.config import build
    from vrl.runtime.modal import doctor
    from vrl.runtime.modal.runtime import ModalRuntime

    class Started:
        async def start(self):
            pass

        async def aclose(self):
            pass

    monkeypatch.setattr(ModalRuntime, "sandboxes", lambda self, config: Started())
    monkeypatch.setattr(ModalRuntime, "__init__", lambda self, config, app: None)
    cfg = build({"plugin": "lean", "runtime": {"kind": "modal", "modal": {"verify_in": "sandbox"}}})
    check = doctor._sandbox_check(cfg, SimpleNamespace())
    assert check.detail == "ready (32 GiB)"
    per_second = doctor._cents(1.0, cores=cfg.runtime.modal.sandbox_cpu * doctor.SANDBOX_CPU_FACTOR, memory_gib=32)
    assert abs(check.cents - per_second * check.seconds) < 1e-9
