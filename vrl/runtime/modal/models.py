"""A local `--model` on Modal: a GGUF file or a model folder on this machine, put on the run's Volume once.

Modal's containers cannot read this machine's files. A Hub id reaches the GPU workers through the Volume's
Hugging Face cache (`vrl modal prepare --model ID`); a local model is uploaded into the Volume, under a name
made from its content, so that a second run (or another machine with the same file) uploads nothing::

    models/gguf-<sha256 of the GGUF file, 16 hex>-<dtype>/   a GGUF file's conversion (vrl/gguf.py), made here
    models/dir-<sha256 of the folder's model files, 16 hex>/  a Hugging Face folder's model files
    models/<key>/vrl_model.json                               what it came from; written last, in the same batch

Where it goes is settled before the run directory exists (`place`, from `ModalRuntime.check`, which the
preflight and `launch_detached` call): the file is checked (a missing file, a GGUF architecture transformers
cannot dequantize, a folder without safetensors weights: one line each) and its Volume folder recorded as
`runtime.modal.model_folder` beside `model` (the path the user gave) in the run's config. The upload itself
(`upload`: one `Volume.batch_upload`, which writes the Volume's committed state from anywhere, no commit) runs
when the app has started, before the first worker call. The workers load `/vrl/models/<key>`
(`workers.engine_config`); a detached orchestrator that trains (GRPO) loads a container-local copy of it
(`local_copy`: a model loaded on the CPU keeps its safetensors mapped, and a mapped file of the Volume blocks
the orchestrator's commits).
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from vrl import gguf, local_model
from vrl.errors import ModelUnavailable, UsageError
from vrl.local_model import is_local, model_files, names_gguf, source
from vrl.runtime.modal.workers import MODELS_DIR, VOLUME_ROOT, worker_dtype

log = logging.getLogger(__name__)

#: Written last into a model's Volume folder: the upload finished (a batch upload lands whole or not at all).
RECORD = "vrl_model.json"


def place(config: Any) -> None:
    """Refuse, in one line, a local `--model` that cannot go to the Volume, and record its Volume folder
    (`runtime.modal.model_folder`). Where the file is absent but a folder is recorded (the detached orchestrator's
    container, a run resumed on another machine) the Volume holds it already."""
    rt, name = config.runtime.modal, config.model
    if not is_local(name):
        if rt.model_folder is not None:
            raise UsageError(f"runtime.modal.model_folder={rt.model_folder!r} is where vrl puts a local --model on the "
                             f"Volume, and --model {name} is not one: leave it unset")
        return
    if rt.model_folder is not None and not source(name).exists():
        return
    folder = volume_folder(name, worker_dtype(config))  # a GGUF file: converted in the workers' dtype
    if rt.model_folder is not None and rt.model_folder != folder:
        raise UsageError(f"--model {name} is no longer what the run put on the Volume as {rt.model_folder} (it is "
                         f"{folder} now): resume with the file the run started from, or start a new run (--name)")
    rt.model_folder = folder


def volume_folder(name: str, dtype: str) -> str:
    """`models/<key>` for local model `name` (checked first: one line naming what is wrong)."""
    if names_gguf(name):
        gguf.check(name)  # exists, is GGUF, transformers can dequantize it
        return f"{MODELS_DIR}/gguf-{local_model.digest(name)[:16]}-{dtype}"
    from vrl.hub import check_model

    check_model(name)  # exists and is a directory
    base = source(name)
    files = model_files(base)
    names = {p.name for p in files}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise ModelUnavailable(f"model folder {name} has no config.json and .safetensors weights, which Modal's workers "
                               "load (save it with save_pretrained), or give a GGUF file or a Hugging Face model id")
    return f"{MODELS_DIR}/dir-{local_model.digest(name)[:16]}"


def on_volume(volume: Any, folder: str) -> dict[str, Any] | None:
    """The record of a finished upload of `folder` on the Volume (written last), or None."""
    try:
        return json.loads(b"".join(volume.read_file(f"{folder}/{RECORD}")))
    except Exception as exc:  # noqa: BLE001 - absent: modal raises NotFoundError or FileNotFoundError
        import modal.exception

        if isinstance(exc, modal.exception.AuthError):
            raise
        return None


def upload(config: Any, volume: Any) -> dict[str, Any]:
    """Put the run's local model into `runtime.modal.model_folder` on `volume` unless it is there (a GGUF file is
    converted here first, once: vrl/gguf.py); what is there: {"model", "folder", "path", "files", "bytes",
    "uploaded"}."""
    folder, name = config.runtime.modal.model_folder, config.model
    info = {"model": name, "folder": folder, "path": f"{VOLUME_ROOT}/{folder}"}
    record = on_volume(volume, folder)
    if record is not None:
        log.info("%s is on the Volume already (%s): nothing to upload", name, folder)
        return {**info, "files": record["files"], "bytes": record["bytes"], "uploaded": False}
    if not source(name).exists():
        raise ModelUnavailable(f"model {name} is not on this machine and the Volume has no {folder}; give the file "
                               "the run started from")
    local = gguf.convert(name, worker_dtype(config)) if gguf.is_gguf(name) else source(name)
    files = model_files(Path(local))
    rel = [p.relative_to(local).as_posix() for p in files]
    size = sum(p.stat().st_size for p in files)
    t0 = time.perf_counter()
    log.info("uploading %s (%d files, %.2f GB) to the Volume as %s, once", name, len(files), size / 1e9, folder)
    record = {"source": name, "files": rel, "bytes": size, "uploaded_at": time.time()}
    with volume.batch_upload(force=True) as batch:  # force: the leftovers of an upload that failed midway
        for path, r in zip(files, rel):
            batch.put_file(str(path), f"{folder}/{r}")
        batch.put_file(io.BytesIO(json.dumps(record, indent=2).encode()), f"{folder}/{RECORD}")
    log.info("uploaded %s in %.1f s", folder, time.perf_counter() - t0)
    return {**info, "files": rel, "bytes": size, "uploaded": True}


def local_copy(root: str | Path, folder: str) -> Path:
    """A copy, on this container's own disk, of the model folder `folder` of the Volume mounted at `root` (made
    once per container: the folder's name is its content)."""
    target = Path(tempfile.gettempdir()) / "vrl-models" / Path(folder).name
    if not (target / RECORD).is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            shutil.copytree(Path(root) / folder, tmp, dirs_exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
