import pytest

# setuptools swaps in its own distutils the first time it is imported, and asserts that the swap worked;
# torch's inductor imports it on its first compile. Imported after other tests changed the process's
# import state, the assertion failed: tests/test_grpo_compile.py, run in one process after
# tests/test_modal_{images,app,sandbox,lease}.py (as pytest-xdist's workers may). Imported here, first,
# a file passes or fails the same whatever ran before it.
import setuptools  # noqa: F401, I001
import torch

from vrl.plugins import registry

# One intra-op thread: the tiny models gain nothing from more, and on a loaded 2-core machine torch's
# thread pool makes generation 10-100x slower (measured while several test runs shared the cores).
torch.set_num_threads(1)


# The longest test files, in seconds of test time (each file's tests' times summed from a junit report of the
# fresh-clone run of `./scripts/test`, 4 workers on the idle 2-core machine, inductor's cache cold, session 25; docs/testing.md).
# scripts/test hands files to pytest-xdist's workers longest
# first (`--dist loadfile --no-loadscope-reorder`): a long file that starts last keeps one worker busy
# after the others have finished. Only the order depends on these figures; a file not named here runs
# after them, in collection order. Refresh them when a file's cost changes by much.
LONGEST = {"tests/test_grpo_compile.py": 170, "tests/test_driver_process.py": 100, "tests/test_cli_errors.py": 90,
           "tests/test_grpo_fsdp.py": 90, "tests/test_modal_emulated_sandboxes.py": 80,
           "tests/test_modal_emulated_detached.py": 70, "plugins/lean/tests/test_lean_wasm.py": 60,
           "tests/test_modal_emulated_lease.py": 60, "tests/test_modal_emulator.py": 50,
           "plugins/lean/tests/test_lean_recheck.py": 40, "tests/test_sinks.py": 40, "tests/test_es_torchrun.py": 30,
           "tests/test_modal_emulated_volumes.py": 30, "tests/test_modal_emulated_containers.py": 30,
           "tests/test_modal_app.py": 20, "tests/test_guess.py": 20, "tests/test_docs.py": 20,
           "tests/test_grpo.py": 20, "tests/test_python_api.py": 20, "tests/test_es_trainer.py": 20,
           "tests/test_modal_images.py": 20, "tests/test_export.py": 20, "tests/test_report.py": 20,
           "plugins/lean/tests/test_lean_env.py": 20, "tests/test_cli_day_one.py": 20,
           "tests/test_real_model.py": 20, "tests/test_modal_generation.py": 20, "tests/test_dataset_env.py": 20}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that starts the Modal emulator (`emu`, `module_emu`: containers in processes of their own,
    typically 10-70 s on the 2-core machine) is `slow`: `-m "not slow"` leaves it out. The files of
    `LONGEST` come first, longest first (a stable sort: each file's tests stay together and in order)."""
    for item in items:
        if {"emu", "module_emu"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -LONGEST.get(item.nodeid.split("::")[0], 0))


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each test sees the plugins installed at that moment (some tests install or break plugins)."""
    registry.cache_clear()
    yield
    registry.cache_clear()


@pytest.fixture
def emu(tmp_path, monkeypatch):
    """An emulated Modal service (tests/modal_emulator) with the fake `modal` package swapped in."""
    from tests.modal_emulator import emulated_service

    yield from emulated_service(tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def module_emu(tmp_path_factory):
    """One emulated Modal service for a whole test module (its apps, containers and Volumes outlive each
    test: each test uses its own run names). Not together with `emu` in one module: one fake `modal` at a time."""
    from tests.modal_emulator import emulated_service

    with pytest.MonkeyPatch.context() as monkeypatch:
        yield from emulated_service(tmp_path_factory.mktemp("emulated"), monkeypatch)


@pytest.fixture(scope="module")
def small_qwen2_dir(tmp_path_factory):
    """A 2-layer Qwen2 (hidden 256, untied lm_head) with random weights and the byte tokenizer of
    `vrl.generate.tiny`, saved for engines to load (the vLLM GPU tests)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vrl.generate import tiny

    path = tmp_path_factory.mktemp("qwen2-small")
    cfg = Qwen2Config(vocab_size=257, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=256, eos_token_id=256, pad_token_id=256,
                      initializer_range=0.05)  # sharper logits than the default: fewer near-ties in greedy
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = 256
    model.save_pretrained(path)
    tiny.build_tokenizer().save_pretrained(path)
    return str(path)
