"""Model name resolution, offline loading errors, the GGUF cache folder and HF loaders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tempering.models import gguf, registry
from tempering.models.hf import load_causal_lm, load_tokenizer
from tempering.models.registry import ModelNotFoundError, resolve_model_path


@pytest.fixture
def offline_by_default(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)


@pytest.mark.parametrize("name", ["no-such-org/no-such-model", "/nonexistent/model/dir"])
def test_missing_model_gives_one_actionable_offline_error(offline_by_default, name):
    with pytest.raises(ModelNotFoundError) as e:
        load_tokenizer(name)
    msg = str(e.value)
    assert repr(name) in msg
    assert "neither a local folder nor in the Hugging Face cache" in msg
    assert "offline" in msg and "HF_HUB_OFFLINE=1" in msg
    for fix in ("local folder", "tiny-arith", "smollm2-135m-instruct", "huggingface-cli download"):
        assert fix in msg, fix
    with pytest.raises(ModelNotFoundError, match="neither a local folder"):
        load_causal_lm(name)
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # set by default for libraries and children


def test_online_opt_in_passes_hub_ids_through(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert resolve_model_path("some-org/some-model") == "some-org/some-model"
    assert not registry.hub_offline()


def test_local_folder_and_registered_names(tmp_path, monkeypatch):
    assert resolve_model_path(tmp_path) == str(tmp_path)
    monkeypatch.setattr(registry, "TINY_ARITH_DIR", tmp_path / "tiny-arith")
    with pytest.raises(ModelNotFoundError, match="'tiny-arith' is not built yet"):
        resolve_model_path("tiny-arith")
    (tmp_path / "tiny-arith").mkdir()
    (tmp_path / "tiny-arith" / "config.json").write_text("{}")
    assert resolve_model_path("tiny-arith") == str(tmp_path / "tiny-arith")

    registry.register_model("test-placeholder", lambda: tmp_path / "x")
    try:
        assert resolve_model_path("test-placeholder") == str(tmp_path / "x")
        with pytest.raises(ValueError, match="already registered"):
            registry.register_model("test-placeholder", lambda: tmp_path)
    finally:
        registry.MODEL_REGISTRY.pop("test-placeholder")


def test_repo_tiny_arith_path_is_under_the_repo():
    assert registry.TINY_ARITH_DIR == Path(__file__).resolve().parents[2] / "models" / "tiny-arith"


def test_smollm2_gguf_ships_in_the_package():
    path = gguf.smollm2_gguf_path()
    assert path.name.endswith(".gguf") and path.stat().st_size > 50_000_000


def test_smollm2_cache_folder_is_reused_and_half_written_ones_are_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TEMPERING_CACHE_DIR", str(tmp_path))
    assert gguf.tempering_cache_dir() == tmp_path
    folder = tmp_path / "models" / gguf.SMOLLM2_NAME
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert not gguf.is_converted(folder)  # no completion marker: a crash mid-write
    (folder / gguf._DONE_MARKER).write_text("done")
    # A finished folder is returned as is: no conversion (which would take ~30 s).
    assert gguf.ensure_smollm2_hf() == folder
    assert resolve_model_path("smollm2-135m-instruct") == str(folder)


def test_loaders_read_a_saved_model_with_dtype_and_pad(tmp_path):
    from tempering.models.tiny_arith import build_untrained

    folder = build_untrained(tmp_path / "m")
    tok = load_tokenizer(folder)
    assert tok.pad_token_id is not None and tok.chat_template
    m32 = load_causal_lm(folder)
    mbf = load_causal_lm(str(folder), dtype=torch.bfloat16)
    assert next(m32.parameters()).dtype == torch.float32 and not m32.training
    assert next(mbf.parameters()).dtype == torch.bfloat16


def test_the_configured_chat_template_replaces_the_tokenizers():
    from tempering.algorithms.common import load_run_tokenizer
    from tempering.config.schemas import PolicyConfig

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tokenizer = load_run_tokenizer(PolicyConfig(tokenizer={"chat_template": template}))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<user>hi"
    assert load_run_tokenizer(PolicyConfig()).chat_template != template  # default: the model's
