"""GGUF files as `--model` (vrl/gguf.py), without the real model: which names are GGUF files, where their
conversion lives (keyed by the file's hash and the dtype), and the one-line refusals (a missing file, a file
that is not GGUF, an architecture transformers cannot dequantize). The conversion itself, on a real GGUF
file, is tests/test_real_model.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from vrl import gguf
from vrl.cli import main
from vrl.errors import ModelUnavailable
from vrl.hub import check_model

gguf_package = pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install 'vrl-core[gguf]'")


def write_gguf(path: Path, arch: str, values: float = 0.5) -> Path:
    """A GGUF file with one float32 tensor, written with the gguf package's own writer."""
    import numpy as np

    writer = gguf_package.GGUFWriter(str(path), arch)
    writer.add_name("test model")
    writer.add_tensor("token_embd.weight", np.full((4, 8), values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_what_names_a_gguf_file(tmp_path):
    model = write_gguf(tmp_path / "m.gguf", "llama")
    assert gguf.is_gguf(str(model)) and gguf.is_gguf(f"gguf:{model}") and gguf.is_gguf("gguf:/no/such/file")
    assert not gguf.is_gguf(str(tmp_path / "absent.gguf"))  # a missing .gguf: check_model names it, below
    assert not gguf.is_gguf("tiny") and not gguf.is_gguf("Qwen/Qwen2.5-0.5B") and not gguf.is_gguf(str(tmp_path))
    assert gguf.resolve("Qwen/Qwen2.5-0.5B", "bfloat16") == "Qwen/Qwen2.5-0.5B"  # anything else passes through
    assert gguf.gguf_path(f"gguf:{model}") == model


def test_the_conversion_is_keyed_by_the_files_hash_and_the_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("VRL_GGUF_CACHE", str(tmp_path / "cache"))
    a, b = write_gguf(tmp_path / "a.gguf", "llama", 0.5), write_gguf(tmp_path / "b.gguf", "llama", 0.25)
    same = write_gguf(tmp_path / "copy.gguf", "llama", 0.5)
    fa = gguf.folder_for(str(a), "float32")
    assert fa.parent == tmp_path / "cache" and fa.name == f"{gguf.file_hash(a)[:16]}-float32"
    assert gguf.folder_for(f"gguf:{same}", "float32") == fa  # the content, not the name
    assert gguf.folder_for(str(b), "float32") != fa
    assert gguf.folder_for(str(a), "bfloat16") == fa.with_name(fa.name.replace("float32", "bfloat16"))
    assert gguf.folder_for(str(a), "auto").name.endswith("-" + gguf.default_dtype())


def test_a_finished_conversion_is_reused_and_an_unfinished_one_is_redone(tmp_path, monkeypatch):
    monkeypatch.setenv("VRL_GGUF_CACHE", str(tmp_path / "cache"))
    model = write_gguf(tmp_path / "m.gguf", "llama")
    calls = []

    def fake_write(path, dtype, out):  # stands in for transformers' load and save (the real one: test_real_model)
        calls.append(dtype)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf, "_write_folder", fake_write)
    folder = gguf.folder_for(str(model), "float32")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{half}")  # an interrupted conversion left this, without its record
    assert gguf.resolve(str(model), "float32") == str(folder) and calls == ["float32"]
    assert (folder / "config.json").read_text() == "{}"
    assert gguf.resolve(f"gguf:{model}", "float32") == str(folder) and calls == ["float32"]  # reused
    assert gguf.resolve_any(str(model)) == str(folder)  # what needs only the config takes any dtype's
    with pytest.raises(ValueError, match="int8"):
        gguf.convert(str(model), "int8")
    # Once converted, checking the file (every `vrl train`/`eval` preflight) reads the record, not the file's fields
    monkeypatch.setattr(gguf, "read_header", lambda path: pytest.fail("parsed the GGUF file again"))
    assert gguf.check(str(model)) == {"architecture": "llama", "name": "test model", "tensor_types": ["F32"]}


def test_refusals_are_one_line_naming_the_cause(tmp_path):
    with pytest.raises(ModelUnavailable, match="does not exist"):
        check_model(str(tmp_path / "absent.gguf"))
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ModelUnavailable, match="not a GGUF file"):
        check_model(str(not_gguf))
    strange = write_gguf(tmp_path / "strange.gguf", "mamba9")
    with pytest.raises(ModelUnavailable, match=r"architecture 'mamba9' cannot be dequantized by transformers") as err:
        check_model(f"gguf:{strange}")
    assert "\n" not in str(err.value) and "llama" in str(err.value)  # names what it reads instead
    assert check_model(str(write_gguf(tmp_path / "ok.gguf", "llama"))) is None


def test_the_command_line_refuses_an_unreadable_gguf_model_in_one_line(tmp_path):
    strange = write_gguf(tmp_path / "strange.gguf", "mamba9")
    res = CliRunner().invoke(main, ["eval", "--plugin", "sums", "--model", str(strange), "--limit", "1"])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "architecture 'mamba9'" in lines[0], res.output


def test_the_vllm_engine_starts_on_the_conversion_in_its_own_dtype_without_a_revision(tmp_path, monkeypatch):
    """VLLMGenerator.from_config hands vLLM the converted folder (bfloat16 for generator.dtype=auto, as the engine
    runs), never the GGUF file or a Hub revision. vLLM itself is a stand-in here that records its arguments; the
    real engine on the real model: tests/test_real_model_gpu.py."""
    import dataclasses
    import types

    from vrl.config import build
    from vrl.generate import vllm as vllm_backend

    monkeypatch.setenv("VRL_GGUF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "_write_folder", lambda path, dtype, out: (out / "config.json").write_text("{}"))
    started = {}

    class Started(Exception):
        pass

    def llm(**kwargs):
        started.update(kwargs)
        raise Started

    fake = types.SimpleNamespace(LLM=llm, EngineArgs=dataclasses.make_dataclass("EngineArgs", ["model"]), __version__="0")
    monkeypatch.setattr(vllm_backend, "import_vllm", lambda: fake)
    model = write_gguf(tmp_path / "m.gguf", "llama")
    config = build({"model": str(model), "generator": {"backend": "vllm", "revision": "main"}})
    with pytest.raises(Started):
        vllm_backend.VLLMGenerator.from_config(config)
    assert started["model"] == str(gguf.folder_for(str(model), "bfloat16")) and started["dtype"] == "bfloat16"
    assert started["revision"] is None

