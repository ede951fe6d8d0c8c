"""GGUF files as `--model`: converted once to a Hugging Face folder, then loaded as any local folder.

Many users hold models as one GGUF file (Ollama, LM Studio, llama.cpp). `--model PATH.gguf` (or
`--model gguf:PATH`, for a file named otherwise) names one. transformers reads GGUF files (with the
`gguf` package installed: `pip install 'vrl-core[gguf]'`) and dequantizes their weights, but a model
loaded that way cannot be saved, vLLM cannot load it, and reading the file costs tens of seconds each
time. So the file is converted once: loaded with `gguf_file=`, its dequantized weights moved into a
plain model built from the same config, and saved, with the file's tokenizer and chat template, to

    ${VRL_GGUF_CACHE:-${XDG_CACHE_HOME:-~/.cache}/vrl/gguf}/<sha256 of the file, 16 hex>-<dtype>/

Every backend then gets that folder from the existing loaders (`vrl.generate.hf.load_model_and_tokenizer`,
`meta_model`, the vLLM engine, `vrl export`'s base model): `resolve(name, dtype)` is the one call they make.
The dtype is the run's (`generator.dtype`; 'auto': bfloat16 with a GPU, float32 without, as the hf
backend resolves it), so a CPU run and a GPU run of one file each convert once. A conversion finished by
another process (a test worker, a second engine) is reused; one under way is waited for (a file lock).

The weights are the GGUF quantization's, dequantized: a Q4 file gives a model that differs from the
original release. A GGUF whose architecture (or quantization type) transformers cannot dequantize is
refused in one line naming it, before anything is loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from vrl.errors import ModelUnavailable

log = logging.getLogger(__name__)

PREFIX = "gguf:"
MAGIC = b"GGUF"
#: Bumped when the folder's layout changes, so that old conversions are not reused.
FORMAT = 1
DTYPES = ("float32", "bfloat16", "float16")
_HASHES: dict[tuple[str, int, int], str] = {}


def is_gguf(name: str) -> bool:
    """Whether `--model name` names a GGUF file: `gguf:PATH`, or an existing file ending in .gguf."""
    if not isinstance(name, str):
        return False
    if name.startswith(PREFIX):
        return True
    return name.lower().endswith(".gguf") and Path(name).expanduser().is_file()


def gguf_path(name: str) -> Path:
    return Path(name.removeprefix(PREFIX)).expanduser()


def cache_root() -> Path:
    if os.environ.get("VRL_GGUF_CACHE"):
        return Path(os.environ["VRL_GGUF_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vrl" / "gguf"


def file_hash(path: Path) -> str:
    """sha256 of the file (hex), computed once per process for a file of unchanged size and mtime."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def default_dtype() -> str:
    """What 'auto' means where the model will run: bfloat16 with a CUDA GPU, float32 without."""
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def folder_for(name: str, dtype: str) -> Path:
    """Where the conversion of `name` in `dtype` lives (whether or not it exists yet)."""
    dtype = default_dtype() if dtype in ("auto", None) else dtype
    return cache_root() / f"{file_hash(gguf_path(name))[:16]}-{dtype}"


def read_header(path: Path) -> dict[str, Any]:
    """The file's architecture and tensor types (the `gguf` reader memory-maps the file; nothing is dequantized)."""
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise ModelUnavailable(f"model {str(path)!r} is not a GGUF file (no GGUF magic at its start)")
    gguf = _import_gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - a truncated or corrupt file: say so in one line
        raise ModelUnavailable(f"cannot read GGUF file {str(path)!r}: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
    name_field = reader.fields.get("general.name")
    model_name = bytes(name_field.parts[name_field.data[0]]).decode() if name_field is not None else ""
    return {"architecture": arch, "name": model_name, "tensor_types": sorted({t.tensor_type.name for t in reader.tensors})}


def check(name: str) -> dict[str, Any]:
    """Raise `ModelUnavailable` (one line) unless `name` is a GGUF file transformers can dequantize; its header."""
    path = gguf_path(name)
    if not path.is_file():
        raise ModelUnavailable(f"GGUF file {str(path)!r} does not exist" if not path.exists()
                               else f"{str(path)!r} is not a file; --model gguf:PATH names one GGUF file")
    done = _conversions(path)
    if done:  # converted before: its record holds the header, and nothing needs dequantizing again
        record = json.loads((done[0] / DONE).read_text())
        return {"architecture": record["architecture"], "name": record.get("name", ""),
                "tensor_types": record["tensor_types"]}
    header = read_header(path)  # parses every field, the vocabulary included: seconds for a real model
    supported, quants = _transformers_support()
    arch = header["architecture"]
    if supported is not None and arch not in supported and _alias(arch, header["name"]) not in supported:
        import transformers

        raise ModelUnavailable(f"GGUF file {path.name}: architecture {arch!r} cannot be dequantized by transformers "
                               f"{transformers.__version__} (it reads: {', '.join(sorted(supported))})")
    unknown = [t for t in header["tensor_types"] if quants is not None and t not in quants]
    if unknown:
        raise ModelUnavailable(f"GGUF file {path.name}: quantization type(s) {', '.join(unknown)} cannot be dequantized "
                               f"by the installed gguf package; re-quantize the model (e.g. Q4_K_M, Q8_0) or give an HF folder")
    return header


def resolve(name: str, dtype: str | None = "auto") -> str:
    """The Hugging Face folder to load for `--model name`: `name` itself unless it is a GGUF file, whose
    conversion in `dtype` ('auto': bfloat16 with a GPU, float32 without) is made now unless cached."""
    if not is_gguf(name):
        return name
    return str(convert(name, dtype or "auto"))


def resolve_any(name: str) -> str:
    """For what needs only the config (parameter names and shapes): any finished conversion of the file,
    else the conversion in this machine's default dtype (the one a run with generator.dtype=auto loads)."""
    if not is_gguf(name):
        return name
    done = _conversions(gguf_path(name))
    return str(done[0]) if done else resolve(name, "auto")


def _conversions(path: Path) -> list[Path]:
    """The finished conversions of the GGUF file at `path`, in any dtype."""
    root = cache_root()
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(file_hash(path)[:16] + "-*") if _finished(p))


DONE = "vrl_gguf.json"


def convert(name: str, dtype: str = "auto") -> Path:
    """Convert GGUF file `name` to a Hugging Face folder in `dtype` unless already converted; its path."""
    dtype = default_dtype() if dtype in ("auto", None) else dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} for a GGUF conversion; use one of {', '.join(DTYPES)} or auto")
    path = gguf_path(name)
    if not path.is_file():
        check(name)  # names what is wrong
    out = folder_for(name, dtype)
    if _finished(out):
        return out
    header = check(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.with_name(out.name + ".lock")):
        if _finished(out):  # another process converted it while this one waited
            return out
        t0 = time.perf_counter()
        log.info("converting GGUF file %s (%s) to a Hugging Face folder in %s, once: %s", path.name,
                 header["architecture"], dtype, out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            _write_folder(path, dtype, tmp)
            (tmp / DONE).write_text(json.dumps({
                "format": FORMAT, "source": str(path.resolve()), "sha256": file_hash(path), "dtype": dtype,
                "architecture": header["architecture"], "name": header["name"], "tensor_types": header["tensor_types"],
                "seconds": round(time.perf_counter() - t0, 1)}, indent=2) + "\n")
            if out.exists():  # an unfinished folder from an interrupted conversion
                shutil.rmtree(out)
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide it from other users of a shared cache
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("converted %s in %.1f s", path.name, time.perf_counter() - t0)
    return out


def _finished(out: Path) -> bool:
    try:
        return json.loads((out / DONE).read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def _write_folder(path: Path, dtype: str, out: Path) -> None:
    """Load the file with transformers (dequantized), move its weights into a plain model, save both halves."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    folder, file = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch_dtype)
    except ValueError as exc:  # transformers' "GGUF model with architecture X is not supported yet." and kin
        raise ModelUnavailable(f"GGUF file {path.name}: transformers cannot load it: {exc}".splitlines()[0]) from None
    # A model loaded from GGUF carries a quantization config and refuses save_pretrained; the same
    # architecture built from its config without one takes its (dequantized) weights and saves normally.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch_dtype
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    state = loaded.state_dict()
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if k not in _tied(plain)]
    if missing or unexpected:
        raise ModelUnavailable(f"GGUF file {path.name}: its weights do not fill a plain {type(plain).__name__} "
                               f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _tied(model: Any) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return set(keys if not isinstance(keys, dict) else keys.keys())


def _alias(arch: str, model_name: str) -> str:
    """The architecture name transformers maps a llama.cpp name to (as its GGUF loader does)."""
    if "llama" in arch and "mistral" in model_name.lower():
        return "mistral"
    return {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}.get(arch, arch)


def _transformers_support() -> tuple[set[str] | None, set[str] | None]:
    """The GGUF architectures transformers reads and the tensor types the gguf package dequantizes
    (None where the installed version does not say)."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES as archs
    except ImportError:
        archs = None
    try:
        from gguf.quants import _type_traits  # the quantization types it can dequantize

        quants = {t.name for t in _type_traits} | {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}
    except ImportError:
        quants = None
    return (set(archs) if archs is not None else None), quants


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ModelUnavailable("a GGUF --model needs the gguf package to read the file: pip install 'vrl-core[gguf]' "
                               "(or pip install gguf)") from None
    return gguf


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    import fcntl

    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
