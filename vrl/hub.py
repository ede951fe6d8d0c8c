"""Can a model or dataset be loaded? Answered in seconds, before a run directory exists.

Without these checks a missing path or an unreachable Hugging Face Hub surfaces deep inside
`from_pretrained` or `load_dataset`, after a minute of retries, as a long traceback. Here: a local
path must exist; a hub id must be well formed and either be in the local cache or be on a Hub that
answers. When the Hub is unreachable but the files are cached, the process switches to offline mode
so loading goes straight to the cache instead of retrying the network.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

from vrl.errors import DatasetUnavailable, ModelUnavailable

log = logging.getLogger(__name__)

#: Seconds to wait for the Hub to answer before calling it unreachable.
HUB_TIMEOUT_S = 5.0
_TRUE = {"1", "true", "yes", "on"}


def offline_requested() -> bool:
    """Whether the user asked for offline mode (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE)."""
    return any(os.environ.get(v, "").lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


@functools.cache
def hub_unreachable(timeout_s: float = HUB_TIMEOUT_S) -> str | None:
    """None when the Hub answers (any HTTP status), else why not, in a few words. Asked once per process."""
    if offline_requested():
        return "offline mode is set (HF_HUB_OFFLINE)"
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint(), method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None  # it answered, even if with an error status
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{endpoint()}: {reason}"
    return None


def go_offline() -> None:
    """Make huggingface_hub, transformers and datasets use only the local cache from now on."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"
    # Libraries read these once at import; patch the copies of those already imported.
    hub_constants = sys.modules.get("huggingface_hub.constants")
    if hub_constants is not None:
        hub_constants.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = datasets_config.HF_DATASETS_OFFLINE = True


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def cached(repo_id: str, revision: str | None = None, repo_type: Literal["model", "dataset"] = "model") -> bool:
    """Whether the repository's files for `revision` are in the local Hugging Face cache."""
    from huggingface_hub import constants, try_to_load_from_cache

    if repo_type == "model":
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
        return isinstance(found, str)
    # A dataset has no fixed file; a snapshot for the revision is what `load_dataset` reuses.
    folder = Path(constants.HF_HUB_CACHE) / f"datasets--{repo_id.replace('/', '--')}"
    ref = folder / "refs" / (revision or "main")
    return ref.is_file() and (folder / "snapshots" / ref.read_text().strip()).is_dir()


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") > 1 or name.endswith("/")


def check_model(name: str, revision: str | None = None) -> None:
    """Raise `ModelUnavailable` (one line: what is wrong, how to fix it) unless `name` can be loaded.

    'tiny', existing directories and GGUF files transformers can read (`vrl.gguf`) pass; a hub id passes
    when cached (then, with the Hub unreachable, the process goes offline) or when the Hub knows it.
    """
    if name == "tiny":
        return
    from vrl import gguf

    if name.startswith(gguf.PREFIX) or name.lower().endswith(".gguf"):
        gguf.check(name)  # exists, is GGUF, and transformers can dequantize its architecture
        return
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir():
            return
        raise ModelUnavailable(f"model {name!r} is a file; give a model directory (config.json and weights), "
                               "a GGUF file (gguf:PATH), a Hugging Face model id, or --model tiny")
    if _looks_like_path(name):
        raise ModelUnavailable(f"model directory {name} does not exist; give an existing directory, a Hugging Face "
                               "model id such as Qwen/Qwen2.5-0.5B-Instruct, or --model tiny")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ModelUnavailable(f"model {name!r} is neither an existing directory nor a valid Hugging Face model id "
                               "(org/name); give one of those, or --model tiny") from None
    at = f" at revision {revision!r}" if revision else ""
    if cached(name, revision):
        why = hub_unreachable()
        if why:
            log.info("the Hugging Face Hub is unreachable (%s); loading %s from the local cache", why, name)
            go_offline()
        return
    why = hub_unreachable()
    if why:
        raise ModelUnavailable(
            f"model {name!r}{at} is not in the local Hugging Face cache ({cache_dir()}) and the Hub cannot be "
            f"reached ({why}); connect to the network once to download it, or give a local model directory"
        )
    _check_on_hub(name, revision, "model")


def check_dataset(repo_id: str, revision: str | None = None, instead: str = "") -> None:
    """Raise `DatasetUnavailable` unless the dataset is cached or the Hub answers; cached + no Hub: go offline.

    `instead` is appended to the message: what the user can pass instead (e.g. a local file option).
    """
    if cached(repo_id, revision, "dataset"):
        if hub_unreachable():
            go_offline()
        return
    why = hub_unreachable()
    if why:
        raise DatasetUnavailable(
            f"dataset {repo_id!r} is not in the local Hugging Face cache ({cache_dir()}) and the Hub cannot be "
            f"reached ({why}); connect to the network once to download it{instead}"
        )


def _check_on_hub(repo_id: str, revision: str | None, repo_type: Literal["model", "dataset"]) -> None:
    """Ask the Hub whether the repository (and revision) exists and may be read."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    error = ModelUnavailable if repo_type == "model" else DatasetUnavailable
    try:
        HfApi().repo_info(repo_id, revision=revision, repo_type=repo_type, timeout=HUB_TIMEOUT_S * 2)
    except GatedRepoError:
        raise error(f"{repo_type} {repo_id!r} is gated: accept its terms on {endpoint()}/{repo_id} and set "
                    "HF_TOKEN (or run `hf auth login`)") from None
    except RevisionNotFoundError:
        raise error(f"{repo_type} {repo_id!r} has no revision {revision!r} on the Hub; check generator.revision") from None
    except RepositoryNotFoundError:
        raise error(f"no {repo_type} {repo_id!r} on the Hugging Face Hub (a private one needs HF_TOKEN or "
                    "`hf auth login`); check the name, or give a local directory") from None
    except Exception as exc:  # the Hub answered oddly: loading will say more; do not block on it
        log.debug("could not confirm %s %s on the Hub: %s", repo_type, repo_id, exc)
