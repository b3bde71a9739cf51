"""Memory and disk are checked before a model is downloaded: a 65 GB hub model that cannot fit is refused by name
without fetching a byte. The hub is mocked; nothing here downloads."""

from __future__ import annotations

import huggingface_hub
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from usd import loading
from usd.loading import GiB, LoadError, load_model

BIG = "qwen2.5-32b-instruct"  # about 65 GB of bf16 safetensors on the hub, not gated


@pytest.fixture
def downloads(monkeypatch, tmp_path):
    """Every download the hub is asked for. Nothing is in the local hub cache, and a download stops right there."""
    asked = []

    def snapshot_download(repo_id, local_files_only=False, **kwargs):
        if local_files_only:
            raise LocalEntryNotFoundError(f"{repo_id} is not cached")
        asked.append(repo_id)
        raise OSError("the test stops at the download")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("USD_CHAT_CACHE", str(tmp_path / "usd"))
    return asked


def test_a_model_too_big_for_memory_is_refused_before_any_download(catalog, downloads, monkeypatch):
    monkeypatch.setattr(loading, "available_bytes", lambda device: 16 * GiB)
    monkeypatch.setattr(loading, "free_disk_bytes", lambda path: 10_000 * GiB)
    with pytest.raises(LoadError, match=rf"{BIG} needs about \d+\.\d GiB .* only 16\.0 GiB is free"):
        load_model(catalog.get(BIG), device="cpu", log=lambda m: None)
    assert downloads == []


def test_a_model_too_big_for_the_disk_is_refused_before_any_download(catalog, downloads, monkeypatch):
    monkeypatch.setattr(loading, "available_bytes", lambda device: 10_000 * GiB)
    monkeypatch.setattr(loading, "free_disk_bytes", lambda path: 20 * GiB)
    with pytest.raises(LoadError, match=rf"{BIG} is a download of about 6\d\.\d GiB, but only 20\.0 GiB is free"):
        load_model(catalog.get(BIG), device="cpu", log=lambda m: None)
    assert downloads == []


def test_a_model_that_fits_is_downloaded(catalog, downloads, monkeypatch):
    """The other side of the two tests above: with room, the download does start (here: the mocked one)."""
    monkeypatch.setattr(loading, "available_bytes", lambda device: 10_000 * GiB)
    monkeypatch.setattr(loading, "free_disk_bytes", lambda path: 10_000 * GiB)
    with pytest.raises(LoadError, match="could not reach the hub"):
        load_model(catalog.get(BIG), device="cpu", log=lambda m: None)
    assert downloads == ["Qwen/Qwen2.5-32B-Instruct"]


def test_free_disk_bytes_measures_the_nearest_existing_folder(tmp_path):
    assert loading.free_disk_bytes(tmp_path / "not" / "yet" / "there") > 0
