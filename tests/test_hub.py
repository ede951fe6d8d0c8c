"""Model and dataset checks before a run: seconds and one line instead of a minute of retries."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vrl.hub as hub
from vrl.errors import DatasetUnavailable, ModelUnavailable

NO_HUB = "http://127.0.0.1:9"  # refuses connections: the Hub without network


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """An unreachable Hub and an empty private cache; the process's offline switches restored after."""
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_ENDPOINT", NO_HUB)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "0")  # recorded, so what go_offline sets is undone after the test
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    hub.hub_unreachable.cache_clear()
    yield tmp_path / "cache"
    hub.hub_unreachable.cache_clear()


def cache_tiny_model(cache: Path, repo_id: str) -> None:
    """Put the tiny model into a Hugging Face cache as if it had been downloaded (refs/main -> snapshot)."""
    from vrl.generate import tiny

    folder = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    snapshot = folder / "snapshots" / commit
    tiny.build_model().save_pretrained(snapshot)
    tiny.build_tokenizer().save_pretrained(snapshot)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)


def test_local_paths_and_malformed_ids(tmp_path, offline_hub):
    hub.check_model("tiny")
    hub.check_model(str(tmp_path))  # an existing directory: the loader takes it from here
    with pytest.raises(ModelUnavailable, match="does not exist"):
        hub.check_model(str(tmp_path / "missing" / "model"))
    with pytest.raises(ModelUnavailable, match="does not exist"):
        hub.check_model("./missing")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelUnavailable, match="is a file"):
        hub.check_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelUnavailable, match="neither an existing directory nor a valid Hugging Face model id"):
        hub.check_model("org/na me")


def test_uncached_model_with_no_hub_fails_naming_the_cache_and_the_reason(offline_hub):
    with pytest.raises(ModelUnavailable, match=rf"'org/model' at revision 'v2' is not in .*{offline_hub}.*{NO_HUB}"):
        hub.check_model("org/model", revision="v2")
    with pytest.raises(DatasetUnavailable, match=r"'org/data' is not in the local .*-o data=PATH"):
        hub.check_dataset("org/data", instead=", or pass -o data=PATH")


def test_cached_model_with_no_hub_switches_to_offline(offline_hub, monkeypatch):
    import huggingface_hub.constants as constants

    cache_tiny_model(offline_hub, "org/tiny")
    hub.check_model("org/tiny")
    assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE is True
    with pytest.raises(ModelUnavailable, match="at revision 'other'"):
        hub.check_model("org/tiny", revision="other")  # another revision is not cached


@pytest.mark.slow
def test_eval_of_a_cached_hub_model_runs_offline_without_retries(tmp_path):
    """The whole command against a cached model while the Hub refuses connections: it just works."""
    cache_tiny_model(tmp_path / "cache", "org/tiny")
    env = {**os.environ, "HF_ENDPOINT": NO_HUB, "HF_HUB_CACHE": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, "-m", "vrl.cli", "eval", "--model", "org/tiny", "--limit", "2", "--json",
                          "--set", "sampling.max_new_tokens=4"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[-1])["tasks"] == 2
    assert "retry" not in res.stderr.lower() and "Traceback" not in res.stderr


def test_a_hub_warning_is_printed_once(capfd):
    """huggingface_hub's own handler used to print each warning a second time beside ours."""
    from vrl.cli import _setup_logging

    _setup_logging(False)
    logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5]")
    assert capfd.readouterr().err.count("Retrying in 1s") == 1
