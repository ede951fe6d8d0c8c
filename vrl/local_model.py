"""A `--model` on this machine (a GGUF file or a model folder): what it names, its files, its content digest.

A local model is named by a path the user may overwrite between two commands: a new checkpoint saved into the
same folder, a GGUF file downloaded again at another quantization. The digest names it by what it holds
instead: Modal's Volume folder (`vrl.runtime.modal.models`) and a run's `model.json` (`vrl.rundir`) use it.
A resume or an export compares `model.json` with the files as they are now, because both rebuild from the
base weights (ES's θ is the base plus its recorded updates; a LoRA checkpoint is a delta on the base): a
changed file is refused in one line instead of continuing a run from weights it was never trained on.

Hashing reads every weight file once per process (sha256 at about 1-2 GB/s a core; `gguf.file_hash` keeps
it for a file of unchanged size and mtime), i.e. about what loading the model reads anyway.
"""

from __future__ import annotations

import fnmatch
import hashlib
from pathlib import Path

from vrl import gguf

#: The files of a model folder that make the model: config, weights, tokenizer, chat template. What Modal's
#: workers get on the Volume, and what a run's digest covers (with `*.bin`, which the hf backend also loads).
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")
WEIGHT_FILES = MODEL_FILES + ("*.bin",)


def names_gguf(name: str) -> bool:
    """`--model name` names a GGUF file, whether or not it exists (a missing one is refused naming it)."""
    return name.startswith(gguf.PREFIX) or name.lower().endswith(".gguf")


def is_local(name: str) -> bool:
    """Whether `--model name` names something on this machine (a GGUF file, a folder, a path) rather than a Hub
    id or `tiny`."""
    from vrl.hub import _looks_like_path

    if name == "tiny":
        return False
    return names_gguf(name) or Path(name).expanduser().exists() or _looks_like_path(name)


def source(name: str) -> Path:
    """The file or folder `--model name` names on this machine."""
    return gguf.gguf_path(name) if names_gguf(name) else Path(name).expanduser()


def model_files(folder: Path, patterns: tuple[str, ...] = MODEL_FILES) -> list[Path]:
    """The files of a model folder matching `patterns`, hidden folders (a download's `.cache`) left out."""
    return sorted(p for p in folder.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts)
                  and any(fnmatch.fnmatch(p.name, pattern) for pattern in patterns))


def digest(name: str, patterns: tuple[str, ...] = MODEL_FILES) -> str:
    """sha256 (hex) of what local model `name` holds: a GGUF file's bytes, or each of a folder's `patterns` files
    with its path in the folder."""
    path = source(name)
    if names_gguf(name):
        return gguf.file_hash(path)
    h = hashlib.sha256()
    for file in model_files(path, patterns):
        h.update(f"{file.relative_to(path).as_posix()}\0{gguf.file_hash(file)}\0".encode())
    return h.hexdigest()
