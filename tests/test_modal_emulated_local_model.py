"""A local `--model` on Modal (issue 57): a GGUF file, converted here, or a model folder, uploaded to the run's
Volume once under its content's name (vrl/runtime/modal/models.py); the GPU workers and the detached orchestrator
load it from there.

The conversion itself is stood in for (`gguf._write_folder` saves the tiny model as the "converted" folder): what
is under test is the carriage to Modal. The conversion of a real GGUF file: tests/test_real_model.py.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tests.modal_emulated import modal_config, run_detached
from vrl import gguf
from vrl.errors import ModelUnavailable, UsageError

gguf_package = pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install 'vrl-core[gguf]'")


def write_gguf(path, arch: str):
    """A GGUF file's header and one tensor (tests/test_gguf.py's): enough for the check and the file's hash."""
    import numpy as np

    writer = gguf_package.GGUFWriter(str(path), arch)
    writer.add_name("test model")
    writer.add_tensor("token_embd.weight", np.full((4, 8), 0.5, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def save_tiny(folder):
    from vrl.generate import tiny

    tiny.build_model().save_pretrained(folder)
    tiny.build_tokenizer().save_pretrained(folder)


def test_the_preflight_places_a_local_model_on_the_volume_or_refuses_it_in_one_line(tmp_path, monkeypatch):
    """Before a run directory exists and before any Modal call: a missing file, an architecture transformers cannot
    dequantize, a folder without safetensors weights are refused in one line; a readable GGUF file gets its Volume
    folder (by the file's hash and the workers' dtype), which the workers are sent instead of this machine's path."""
    from vrl.cli import main
    from vrl.envs.sums import SumsEnvironment
    from vrl.preflight import preflight
    from vrl.runtime.modal.workers import engine_config

    def config(model, **modal):
        return modal_config(tmp_path, plugin="sums", model=str(model), runtime=modal)

    for model, refusal in [(tmp_path / "absent.gguf", "does not exist"),
                           (write_gguf(tmp_path / "strange.gguf", "mamba9"), "architecture 'mamba9' cannot be dequantized"),
                           (tmp_path, "has no config.json and .safetensors weights")]:
        with pytest.raises(ModelUnavailable, match=refusal) as err:
            preflight(config(model), SumsEnvironment())
        assert "\n" not in str(err.value)
    model = write_gguf(tmp_path / "m.gguf", "llama")
    cfg = config(model)
    preflight(cfg, SumsEnvironment())
    folder = f"models/gguf-{gguf.file_hash(model)[:16]}-float32"  # generator.dtype of the emulated runs
    assert cfg.model == str(model) and cfg.runtime.modal.model_folder == folder
    sent = engine_config(cfg)
    assert sent["model"] == f"/vrl/{folder}" and sent["generator"]["revision"] is None
    with pytest.raises(UsageError, match="no longer what the run put on the Volume"):  # a resume with another file
        preflight(config(model, model_folder="models/gguf-0123456789abcdef-float32"), SumsEnvironment())
    with pytest.raises(UsageError, match="is not one: leave it unset"):
        preflight(config("Qwen/Qwen2.5-0.5B", model_folder=folder), SumsEnvironment())
    # `vrl modal prepare` checks the file before it asks for Modal credentials (none are set here)
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    res = CliRunner().invoke(main, ["modal", "prepare", "--model", str(tmp_path / "strange.gguf")])
    assert res.exit_code == 2 and "architecture 'mamba9'" in res.output, res.output
    assert len([line for line in res.output.splitlines() if line.strip()]) == 1


def test_a_gguf_model_reaches_the_detached_orchestrator_and_the_workers_through_the_volume_once(emu, tmp_path,
                                                                                                 monkeypatch):
    """A detached GRPO run on a GGUF file: the file is converted here and uploaded (one batch) before the run
    starts; the workers sample from the Volume's copy and the orchestrator trains a copy of it (the path the user
    gave exists in no container: on the code before, the workers lost every call). The recorded config names the
    file and the Volume folder. `vrl modal prepare` of the same file afterwards uploads nothing; of a model folder,
    it uploads the folder once. A missing file is refused before an app starts."""
    import modal

    from vrl.runtime.modal.launch import launch_detached, prepare

    monkeypatch.setenv("VRL_GGUF_CACHE", str(tmp_path / "cache"))
    converted = []

    def convert(path, dtype, out):  # stands in for transformers' dequantization (test_real_model.py runs it)
        converted.append(dtype)
        save_tiny(out)

    monkeypatch.setattr(gguf, "_write_folder", convert)
    with pytest.raises(ModelUnavailable, match="does not exist"):
        launch_detached(modal_config(tmp_path, name="absent", model=str(tmp_path / "absent.gguf")))
    assert not emu.apps  # refused before any app ran (nor anything uploaded)

    model = write_gguf(tmp_path / "m.gguf", "qwen2")
    cfg = modal_config(tmp_path, name="gguf-grpo", model=str(model), iterations=1, optimizer="grpo",
                       grpo={"num_generations": 2})
    summary = run_detached(cfg)
    assert summary["status"] == "finished" and summary["iterations_completed"] == 1
    folder = f"models/gguf-{gguf.file_hash(model)[:16]}-float32"
    volume = modal.Volume.from_name("vrl")
    recorded = json.loads(b"".join(volume.read_file("runs/gguf-grpo/config.json")))
    assert recorded["model"] == str(model) and recorded["runtime"]["modal"]["model_folder"] == folder
    files = {e.path: e.mtime for e in volume.listdir(folder)}
    assert {f"{folder}/config.json", f"{folder}/model.safetensors", f"{folder}/vrl_model.json"} <= set(files)
    assert converted == ["float32"]

    again = prepare(cfg, str(model))  # a second time: nothing converted, nothing uploaded
    assert again["downloaded"] is False and again["folder"] == folder and "model.safetensors" in again["files"]
    assert {e.path: e.mtime for e in volume.listdir(folder)} == files and converted == ["float32"]

    local = tmp_path / "folder"
    save_tiny(local)
    first, second = prepare(cfg, str(local)), prepare(cfg, str(local))
    assert first["downloaded"] is True and second["downloaded"] is False
    assert first["folder"] == second["folder"] and first["folder"].startswith("models/dir-")
    uploaded = b"".join(volume.read_file(f"{first['folder']}/model.safetensors"))
    assert uploaded == (local / "model.safetensors").read_bytes()
