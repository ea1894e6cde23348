"""Problems with answers from your own files: GRPO data (``data.dataset_name=problems``) and
`tempering eval` tasks.

Sources (``data.train_data_path`` / ``data.val_data_path``):

- a data file (`records.iter_rows`): JSONL, one problem per line: ``{"<problem_key>": str,
  "<answer_key>": str | number}`` — the defaults, ``problem`` / ``expected_answer``, are
  OpenMathInstruct-2's (NeMo RL's math example) — or a JSON array, Parquet or CSV file of
  such rows; errors name ``file:line`` (``row <index>``) and the field;
- a Hugging Face dataset: a ``save_to_disk`` folder (a ``DatasetDict`` gives its split) or a
  hub id already in the local HF cache (offline); errors name ``row <index>``.

Prompt text as NeMo RL builds it: ``data.prompt_file`` is a template with one ``{}`` where the
problem goes, ``data.system_prompt_file`` a system message; with ``data.use_chat_template``
the tokenizer's chat template renders ``[system, user]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tempering.data.records import (
    DATA_FILE_SUFFIXES,
    DataFormatError,
    OnBadRow,
    RowError,
    RowIssues,
    iter_rows,
)
from tempering.errors import DataFileNotFoundError, UserInputError

__all__ = ["apply_prompt_template", "load_problem_rows", "read_prompt_file"]


def _converter(problem_key: str, answer_key: str):
    def convert(row: dict[str, Any]) -> tuple[str, str]:
        for key in (problem_key, answer_key):
            if key not in row or row[key] is None:
                raise RowError(
                    f"missing field {key!r} (problem key {problem_key!r}, answer key "
                    f"{answer_key!r}; set data.problem_key / data.answer_key to your column names)"
                )
        problem, answer = row[problem_key], row[answer_key]
        if not isinstance(problem, str) or not problem.strip():
            raise RowError(f"field {problem_key!r} must be a non-empty string, got {problem!r:.60}")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise RowError(f"field {answer_key!r} must be a string or a number, got {answer!r:.60}")
        if not str(answer).strip():
            raise RowError(f"field {answer_key!r} is empty")
        return problem, str(answer).strip()

    return convert


def load_problem_rows(
    source: str | Path,
    problem_key: str = "problem",
    answer_key: str = "expected_answer",
    split: str = "train",
    on_bad_row: OnBadRow = "error",
) -> list[tuple[str, str]]:
    """``(problem, answer)`` pairs from a JSONL file or a Hugging Face dataset."""
    convert = _converter(problem_key, answer_key)
    path = Path(source)
    issues = RowIssues(str(source), on_bad_row)
    rows: list[tuple[str, str]] = []
    if path.is_file() or path.suffix in DATA_FILE_SUFFIXES:  # errors name file:line (or row)
        for where, obj in iter_rows(path, issues):
            if (row := issues.convert(where, obj, convert)) is not None:
                rows.append(row)
    else:
        for i, obj in enumerate(_hf_rows(source, split)):
            present = {k: v for k, v in obj.items() if v is not None}
            if (row := issues.convert(f"row {i}", present, convert)) is not None:
                rows.append(row)
    if not rows:
        raise DataFormatError(f"{source}: no problems (keys {problem_key!r} / {answer_key!r})")
    return issues.finish(path.name, rows).examples


def _hf_rows(source: str | Path, split: str) -> Any:
    import datasets  # heavy import; only Hugging Face sources need it

    path = Path(source)
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataFormatError(f"{source}: no split {split!r}; it has {sorted(ds)}")
            ds = ds[split]
        return ds
    if str(source).startswith(("/", ".", "~")):
        raise DataFileNotFoundError(f"data file {str(source)!r} does not exist; check the path")
    from tempering.models.registry import hub_offline

    if hub_offline():  # a hub id: only what the local HF cache holds (HF_HUB_OFFLINE=0 opts out)
        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        return datasets.load_dataset(str(source), split=split)
    except Exception as err:
        raise DataFileNotFoundError(
            f"{source!r} is neither a local file/folder nor a dataset in the local Hugging Face "
            f"cache ({type(err).__name__}: {str(err)[:200]}); download it on a connected machine "
            "and copy the cache, or save it with Dataset.save_to_disk"
        ) from err


def read_prompt_file(path: str | None, what: str) -> str | None:
    """The text of a prompt/system-prompt file (None when unset)."""
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise DataFileNotFoundError(f"data.{what}={path!r} does not exist; check the path")
    text = file.read_text(encoding="utf-8")
    if what == "prompt_file":  # refused by name here, before any problem is built
        check_prompt_template(text, f"data.prompt_file={path!r}")
    return text


class PromptTemplateError(ValueError, UserInputError):
    """A prompt template without exactly one ``{}``."""


def check_prompt_template(template: str, where: str = "the prompt template") -> None:
    if template.count("{}") != 1:
        raise PromptTemplateError(
            f"{where} must hold exactly one '{{}}' where the problem goes; it has "
            f"{template.count('{}')}: {template[:80]!r}"
        )


def apply_prompt_template(template: str | None, problem: str) -> str:
    """NeMo RL's prompt files: the problem goes where ``{}`` is."""
    if template is None:
        return problem
    check_prompt_template(template)
    return template.replace("{}", problem)
