"""The Modal app's structure: roles, images, GPU/CPU/memory, volumes, secrets, sandboxes, config plumbing.

The app is built for real with the installed `modal` package (building needs no account); the
Modal service itself is absent, so `.map()` is exercised against a stand-in object that yields
outputs the way Modal's does (a mock of the service, nothing else), and commands that would reach
Modal are checked to fail with a clear message.
"""

from __future__ import annotations

import sys

import pytest

from vrl.config import ConfigError, build, dump
from vrl.runtime import make_runtime
from vrl.runtime.modal.app import build_app
from vrl.runtime.modal.images import installed_plugins, orchestrator_recipe, verifier_recipe
from vrl.runtime.modal.runtime import ModalCaller, ModalRuntime
from vrl.runtime.modal.sandbox import ModalSandbox

pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning:vrl")  # vrl's own deprecations fail


CUSTOM = {
    "app_name": "vrl-test", "gpu": "A100-80GB", "cpu": 8.0, "memory_mb": 131072, "timeout_s": 1234, "retries": 3,
    "max_containers": 12, "scaledown_window_s": 77, "volume": "vrl-vol", "secrets": ["huggingface", "wandb"],
    "orchestrator_gpu": "L40S",
}


@pytest.fixture(autouse=True)
def modal_token(monkeypatch, tmp_path):
    """A syntactically valid token: the runtime checks one is configured; nothing here contacts Modal."""
    monkeypatch.setenv("HOME", str(tmp_path))  # ignore any ~/.modal.toml
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-test")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-test")


@pytest.fixture(scope="module")
def built():
    cfg = build({"runtime": {"kind": "modal", "modal": CUSTOM}})
    return cfg, build_app(cfg)


def spec_of(fn):
    return fn._spec_


def same(public, internal) -> bool:
    """A public Modal object (as `build_app` returns it) is the internal one a function spec holds."""
    from modal._utils.async_utils import synchronizer

    return synchronizer._translate_in(public) is internal


def test_gpu_worker_is_declared_with_the_configured_resources(built):
    _, app = built
    spec = spec_of(app.sample)
    assert (spec.gpus, spec.cpu, spec.memory) == ("A100-80GB", 8.0, 131072)
    assert list(spec.volumes) == ["/vrl"] and same(app.volume, spec.volumes["/vrl"])
    # Workers load from the Volume: no named secrets; Modal carries `env=` (Hub off) as an inline secret.
    assert [repr(x) for x in spec.secrets if "from_name" in repr(x)] == []
    assert "HF_HUB_OFFLINE" in repr(spec.secrets)
    assert same(app.images["gpu"], spec.image) and not same(app.images["orchestrator"], spec.image)
    assert app.options["gpu"] == {"gpu": "A100-80GB", "cpu": 8.0, "memory": 131072, "timeout": 1234, "retries": 3,
                                  "max_containers": 12, "scaledown_window": 77}
    # A plain function, no class: its handle crosses into the detached orchestrator (a class handle cannot)
    import modal

    assert isinstance(app.sample, modal.Function) and not isinstance(app.sample, modal.Cls)


def test_prepare_and_orchestrator_get_the_secrets_and_the_volume(built):
    _, app = built
    for fn in (app.prepare_model, app.orchestrate):
        spec = spec_of(fn)
        named = [x for x in spec.secrets if "from_name" in repr(x)]
        assert len(named) == 2 and all(same(a, b) for a, b in zip(app.secrets, named))
        assert same(app.volume, spec.volumes["/vrl"])
    assert spec_of(app.prepare_model).gpus is None  # downloading needs no GPU
    assert same(app.images["orchestrator"], spec_of(app.prepare_model).image)  # nor the GPU image's 15-min build
    assert app.options["orchestrator"]["memory"] == 131072  # a GPU orchestrator trains: the workers' memory
    assert spec_of(app.orchestrate).gpus == "L40S"
    assert same(app.images["orchestrator"], spec_of(app.orchestrate).image)
    assert app.options["orchestrator"]["retries"] == 0  # a loop is resumed, not silently re-run


def test_app_name_and_volume_name_come_from_the_config(built):
    _, app = built
    assert app.app.name == "vrl-test"
    assert "vrl-vol" in repr(app.volume)
    assert [repr(s) for s in app.secrets] == ["modal.Secret.from_name('huggingface')", "modal.Secret.from_name('wandb')"]


def test_role_images_carry_what_the_case_study_used_plus_vrl_and_plugins(built):
    _, app = built
    gpu, orch = app.recipes["gpu"], app.recipes["orchestrator"]
    names = lambda r: {p.split(">")[0].split("=")[0].split(";")[0].strip() for p in r.pip}
    client = f"{sys.version_info.major}.{sys.version_info.minor}"  # serialized functions load only on the client's Python
    assert gpu.base is None and gpu.python == client and orch.python == client
    assert {"vllm", "torch", "transformers", "datasets"} <= names(gpu)
    assert {"vllm==0.26.0", "torch==2.11.0"} <= set(gpu.pip)  # the pair tested on the GPU machine
    assert {"requests", "tqdm", "numpy", "pydantic", "pluggy"} <= names(orch)
    # orchestrator_gpu is set (GRPO's learner): the GPU torch, not the CPU index
    assert orch.extra_index_url is None and "torch==2.11.0" in orch.pip
    light = orchestrator_recipe()  # no GPU: no CUDA wheels in the light image
    assert light.extra_index_url and "cpu" in light.extra_index_url
    # Judging attempts itself (verify_in=local: a detached python-tests run), it needs the jail's bubblewrap;
    # verification in sandboxes (the default) leaves the loop's image without it.
    assert orch.apt == () and light.apt == ()
    local = build_app(build({"runtime": {"kind": "modal", "modal": {"verify_in": "local"}}}))
    assert local.recipes["orchestrator"].apt == ("bubblewrap",)
    # vrl as an installed distribution (a wheel of this checkout); countdown is built in, so no plugin goes in
    for recipe in (gpu, orch):
        assert recipe.distributions == ("vrl-core",) and recipe.dists[0].wheel.endswith(".whl")


@pytest.mark.slow
def test_verifier_image_builds_on_the_plugin_image():
    lean = next(p for p in installed_plugins() if p.name == "lean")
    recipe = verifier_recipe(lean, base="projectnumina/kimina-lean-server:2.0.0")
    assert recipe.role == "verifier:lean" and recipe.base == "projectnumina/kimina-lean-server:2.0.0"
    assert recipe.distributions == ("vrl-core", "vrl-lean")  # only the plugin that verifies, not the others
    assert recipe.apt == ()  # a registry image is left as its maker built it
    assert recipe.build() is not None


def test_sandboxes_get_the_configured_limits_and_no_network():
    cfg = build({"runtime": {"kind": "modal", "modal": {
        "sandbox_cpu": 3.0, "sandbox_memory_mb": 4096, "sandbox_timeout_s": 900, "sandbox_start_timeout_s": 42.0,
        "sandboxes": 5, "sandbox_mode": "per_attempt"}}})
    runtime = ModalRuntime(cfg, app=build_app(cfg))  # nothing starts until used
    pool = runtime.sandboxes(cfg)
    assert (pool.size, pool.mode, pool.start_timeout_s, pool.lifetime_s) == (5, "per_attempt", 42.0, 840.0)
    handle = pool.factory()
    assert isinstance(handle, ModalSandbox)
    assert handle.options["cpu"] == 3.0 and handle.options["memory"] == 4096 and handle.options["timeout"] == 900
    assert handle.options["block_network"] is True
    assert "secrets" not in handle.options  # model-written code never sees credentials
    assert handle.argv[:3] == ["python", "-m", "vrl.runtime.modal.verify_server"]

    open_net = build({"runtime": {"kind": "modal", "modal": {"block_network": False}}})
    assert ModalRuntime(open_net, app=build_app(open_net)).sandboxes(open_net).factory().options["block_network"] is False


@pytest.mark.slow
def test_pool_is_sized_from_the_iteration_when_not_fixed():
    cfg = build({"runtime": {"kind": "modal"}, "tasks_per_iteration": 4, "es": {"population_size": 30},
                 "verifier": {"batch_size": 64, "concurrency": 16}})
    # The trainer passes the iteration's attempts: tasks × samples per task (ES: the population).
    assert ModalRuntime(cfg, app=build_app(cfg)).sandboxes(cfg, 4 * 30).size == 2  # 120 attempts / 64 per batch


@pytest.mark.slow
def test_verify_in_local_keeps_the_verifier_in_the_orchestrator():
    from vrl.plugins import registry

    cfg = build({"runtime": {"kind": "modal", "modal": {"verify_in": "local"}}})
    runtime = ModalRuntime(cfg, app=build_app(cfg))
    verifier = registry().environment("countdown").verifier()
    pool = runtime.verification(verifier, cfg)
    try:
        assert pool.verifier is verifier and runtime.sandbox_pool is None
    finally:
        pool.close()
    cfg = build({"runtime": {"kind": "modal"}})
    runtime = ModalRuntime(cfg, app=build_app(cfg))
    pool = runtime.verification(registry().environment("countdown").verifier(), cfg)
    try:
        assert pool.verifier is runtime.sandbox_pool
        assert pool.timeout_s is None  # the sandbox pool bounds each request and each start itself (defect 10)
    finally:
        pool.close()


def test_make_runtime_builds_the_modal_runtime():
    cfg = build({"runtime": {"kind": "modal"}})
    runtime = make_runtime(cfg)
    assert isinstance(runtime, ModalRuntime) and isinstance(runtime.caller, ModalCaller)


def test_unknown_runtime_kind_names_both_choices():
    with pytest.raises(ConfigError, match="unknown runtime 'cluster'; installed: local, modal"):
        build({"runtime": {"kind": "cluster"}})


def test_secrets_are_names_only_in_the_recorded_config(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_supersecretvalue")
    cfg = build({"runtime": {"kind": "modal", "modal": {"secrets": ["huggingface"]}}})
    assert "hf_supersecretvalue" not in repr(dump(cfg))
    assert dump(cfg)["runtime"]["modal"]["secrets"] == ["huggingface"]


class FakeFunction:
    """Stands in for a Modal Function's `.spawn` (the Modal service is what is mocked here): call i returns
    when the test releases it; `cancel()` is recorded."""

    def __init__(self, n: int, fail_at: int | None = None):
        import threading

        self.release = [threading.Event() for _ in range(n)]
        self.fail_at, self.cancelled, self.spawned = fail_at, [], []

    def spawn(self, *args, **kwargs):
        fn, index = self, len(self.spawned)
        self.spawned.append((args, kwargs))

        class Call:
            object_id = f"fc-{index}"

            def get(self):
                if not fn.release[index].wait(30):
                    raise TimeoutError(f"call {index} was never released")
                if index in fn.cancelled:
                    raise RuntimeError("Function call was cancelled")
                if index == fn.fail_at:
                    raise ValueError(f"member {index} failed")
                return sum(args), kwargs["k"]

            def cancel(self):
                fn.cancelled.append(index)
                fn.release[index].set()

        return Call()


def test_modal_caller_streams_results_as_calls_finish_and_cancels_what_an_abandoned_stream_left():
    caller = ModalCaller()
    fake = FakeFunction(3)
    stream = caller.imap(fake, [(1, 2), (3, 4), (5, 6)], {"k": "shared"})
    fake.release[2].set()
    assert next(stream) == (2, (11, "shared"))  # the call that finished first comes first
    assert fake.spawned == [((1, 2), {"k": "shared"}), ((3, 4), {"k": "shared"}), ((5, 6), {"k": "shared"})]
    fake.release[0].set()
    assert next(stream) == (0, (3, "shared"))
    stream.close()  # the iteration is abandoned: the call still running is cancelled, not left billed
    assert fake.cancelled == [1]
    failing = FakeFunction(2, fail_at=0)
    for event in failing.release:
        event.set()
    outs = dict(caller.imap(failing, [(1, 2), (3, 4)], {"k": "shared"}))
    assert isinstance(outs[0], ValueError) and outs[1] == (7, "shared") and failing.cancelled == []


def test_without_credentials_the_runtime_and_commands_say_how_to_set_up(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from vrl.cli import main

    monkeypatch.delenv("MODAL_TOKEN_ID")
    monkeypatch.delenv("MODAL_TOKEN_SECRET")
    with pytest.raises(RuntimeError, match="modal setup"):
        make_runtime(build({"runtime": {"kind": "modal"}}))
    runner = CliRunner()
    for args in (["modal", "prepare", "--model", "Qwen/Qwen2.5-0.5B", "--secret", "huggingface"],
                 ["train", "--runtime", "modal", "--detach", "--name", "x", "-n", "1"],
                 ["train", "--runtime", "modal", "-n", "1", "--set", f"logging.runs_dir={tmp_path}"]):
        result = runner.invoke(main, args)
        assert result.exit_code == 2, (args, result.output)
        assert "modal setup" in result.output
    assert not list(tmp_path.glob("countdown-*"))  # no run directory was left behind


def test_detach_needs_the_modal_runtime_and_a_name():
    from click.testing import CliRunner

    from vrl.cli import main

    result = CliRunner().invoke(main, ["train", "--detach", "-n", "1"])
    assert result.exit_code == 2 and "--runtime modal" in result.output
    result = CliRunner().invoke(main, ["train", "--runtime", "modal", "--detach", "-n", "1"])
    assert result.exit_code == 2 and "--name" in result.output


def test_without_the_modal_package_modal_commands_say_how_to_install_it(monkeypatch):
    """`vrl modal resume` with no modal package installed: one line naming the extra, exit 2."""
    import sys

    from click.testing import CliRunner

    from vrl.cli import main

    monkeypatch.setitem(sys.modules, "modal.config", None)  # what a missing package looks like to `import`
    result = CliRunner().invoke(main, ["modal", "resume", "lean-es", "--iterations", "3"])
    assert result.exit_code == 2, result.output
    assert "pip install 'vrl-core[modal]'" in result.output and "Traceback" not in result.output
