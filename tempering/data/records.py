"""Shared pieces of every data loader: message logs, bad-row handling, JSONL reading, splits.

A *message log* is a list of OpenAI chat messages (``{"role", "content"}`` dicts, tool calls
included: `data/messages.py` checks them) — the unit every SFT loader returns and every
chat-template tokenizer consumes.

Bad input is never dropped silently. Each loader wraps its per-row conversion in a
:class:`RowIssues` collector: with ``on_bad_row="error"`` (the default) the first bad row
raises :class:`DataFormatError` whose message names the file, the line (or row / JSON path)
and the field, e.g. ``data/train.jsonl:17: missing field 'response' (expected keys: prompt,
response)``; with ``on_bad_row="skip"`` the row is skipped, counted in ``num_skipped`` of
the returned :class:`LoadedData` and logged once per file with the first few reasons.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from tempering.errors import DataFileNotFoundError, UserInputError

logger = logging.getLogger(__name__)

Message = dict[str, Any]  # checked by data/messages.py
MessageLog = list[Message]
OnBadRow = Literal["error", "skip"]

T = TypeVar("T")


class DataFormatError(ValueError, UserInputError):
    """A row of a data file does not have the expected shape; the message says where and why."""


class RowError(ValueError):
    """Raised by a row converter; :class:`RowIssues` adds the file and line to its message."""


@dataclass
class LoadedData:
    """What every loader returns: the examples, a name, and how many bad rows were skipped."""

    name: str
    examples: list[Any]
    num_skipped: int = 0
    skipped_reasons: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.examples)


class RowIssues:
    """Applies a converter to rows, raising or counting the bad ones per ``on_bad_row``."""

    def __init__(self, source: str, on_bad_row: OnBadRow) -> None:
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row={on_bad_row!r} is not valid; use 'error' or 'skip'")
        self.source = source
        self.on_bad_row = on_bad_row
        self.reasons: list[str] = []

    def bad(self, where: str, reason: str) -> None:
        """Record a bad row at ``where`` (e.g. ``"17"`` or ``"row 3"``); raise unless skipping."""
        message = f"{self.source}:{where}: {reason}"
        if self.on_bad_row == "error":
            raise DataFormatError(
                message + " (data.on_bad_row=skip skips and counts such rows instead)"
            )
        self.reasons.append(message)

    def convert(self, where: str, row: Any, converter: Callable[[Any], T]) -> T | None:
        """``converter(row)``, or ``None`` after recording the row as bad."""
        try:
            return converter(row)
        except RowError as err:
            self.bad(where, str(err))
            return None

    def finish(self, name: str, examples: list[Any]) -> LoadedData:
        if self.reasons:
            logger.warning(
                "%s: skipped %d bad row(s); first: %s",
                self.source,
                len(self.reasons),
                "; ".join(self.reasons[:3]),
            )
        return LoadedData(name, examples, len(self.reasons), list(self.reasons))


# the suffixes `iter_rows` reads as files (any other suffix is read as JSON Lines too)
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def iter_rows(path: str | Path, issues: RowIssues) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(where, object)`` for each row of a data file; a bad row goes to ``issues``.

    JSON Lines (``where`` is the line number); a JSON array of objects (a file that is not
    ``.jsonl`` and starts with ``[``, as Alpaca-style ``.json`` datasets ship; ``"row <i>"``);
    Parquet (a Hugging Face dataset's own files); CSV with a header line. A column a Parquet
    row lacks (Arrow gives it ``None``) is left out of that row, as in a JSON file."""
    path = Path(path)
    if not path.is_file():
        raise DataFileNotFoundError(f"data file {str(path)!r} does not exist; check the path")
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    text = _read_text(path)
    if path.suffix == ".csv":
        for i, row in enumerate(csv.DictReader(io.StringIO(text, newline=""))):
            # a short row's missing cells (None) are missing fields; extra cells are dropped
            yield f"row {i}", {k: v for k, v in row.items() if k is not None and v is not None}
        return
    if path.suffix != ".jsonl" and text.lstrip().startswith("["):  # a .jsonl is lines, always
        yield from _json_array_rows(path, text, issues)
        return
    # split at "\n" only: str.splitlines would also split inside a JSON string at U+2028
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            issues.bad(str(line_number), f"not valid JSON ({err.msg} at column {err.colno})")
            continue
        if not isinstance(obj, dict):
            issues.bad(str(line_number), f"expected a JSON object, got {type(obj).__name__}")
            continue
        yield str(line_number), obj


def _read_text(path: Path) -> str:
    """The file as text, without the byte-order mark Windows tools write; a file that is not
    UTF-8 (another encoding, or a binary format under a text suffix) is named."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DataFormatError(
            f"{path}: not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}). Data "
            "files are JSON Lines, a JSON array, CSV (UTF-8) or Parquet (a .parquet suffix); "
            "re-save it as UTF-8 or give a binary file its format's suffix"
        ) from err


def _json_array_rows(
    path: Path, text: str, issues: RowIssues
) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataFormatError(
            f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno}); the file "
            "starts with '[' so it is read as one JSON array of rows"
        ) from err
    for i, obj in enumerate(rows):
        if not isinstance(obj, dict):
            issues.bad(f"row {i}", f"expected a JSON object, got {type(obj).__name__}")
            continue
        yield f"row {i}", obj


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.lib
    import pyarrow.parquet as pq  # installed with datasets; only Parquet files need it

    try:
        table = pq.read_table(path)
    except pyarrow.lib.ArrowException as err:
        raise DataFormatError(f"{path}: not a readable Parquet file ({err})") from err
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i}", {k: v for k, v in row.items() if v is not None}


def load_rows(
    path: str | Path, on_bad_row: OnBadRow, convert: Callable[[dict[str, Any]], T]
) -> LoadedData:
    """Every row of a data file (`iter_rows`: JSONL, a JSON array, Parquet, CSV) through
    ``convert``; a row it rejects (`RowError`) is handled as ``on_bad_row`` says. Named
    after the file's stem."""
    issues = RowIssues(str(path), on_bad_row)
    rows = [
        converted
        for where, row in iter_rows(path, issues)
        if (converted := issues.convert(where, row, convert)) is not None
    ]
    return issues.finish(Path(path).stem, rows)


def require(row: dict[str, Any], key: str, expected: Sequence[str], kind: type | tuple) -> Any:
    """``row[key]`` checked for presence and type, else a :class:`RowError` naming the field."""
    if key not in row:
        raise RowError(f"missing field {key!r} (expected keys: {', '.join(expected)})")
    value = row[key]
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise RowError(f"field {key!r} must be {names}, got {type(value).__name__}")
    return value


def stable_hash(text: str) -> str:
    """Hex sha256 of ``text``: an ordering key that no library version can change."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def split_train_val(
    items: Sequence[T], val_fraction: float, seed: int = 0
) -> tuple[list[T], list[T]]:
    """Deterministic split with ``round(len(items) * val_fraction)`` items in val (see
    :func:`split_off_val`)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
    return split_off_val(items, round(len(items) * val_fraction), seed)


def hold_out(
    items: Sequence[T], num_val: int, seed: int, source: str, unit: str = "examples"
) -> tuple[list[T], list[T]]:
    """`split_off_val` with at most half of ``items`` held out: a training file too small for
    ``num_val`` (``data.num_val_samples``) keeps half to train on, logged, not silent."""
    held = min(num_val, len(items) // 2)
    if held < num_val:
        logger.warning(
            "data.num_val_samples=%d, but %s holds %d %s: %d (half) are held out for "
            "validation and %d train; pass data.val_data_path for a separate validation file",
            num_val, source, len(items), unit, held, len(items) - held,
        )  # fmt: skip
    return split_off_val(items, held, seed)


def data_source(train_data_path: str | None, dataset_name: str) -> str:
    """Where a run's training data comes from, as the user set it: the key and its value
    (the `data` section's fields, not the section: the config-key scan sees each read)."""
    if train_data_path:
        return f"data.train_data_path={train_data_path!r}"
    return f"data.dataset_name={dataset_name!r}"


def first_n(items: Sequence[T], n: int | None, source: str, unit: str) -> list[T]:
    """The first ``n`` training ``items`` (``data.num_train_samples`` of a dataset read from a
    file; None: all), logged when ``n`` cuts them or asks for more than there are."""
    if n is not None and n != len(items):
        logger.warning(
            "data.num_train_samples=%d: %s holds %d %s; training on %s",
            n, source, len(items), unit,
            f"the first {n}" if n < len(items) else "all of them",
        )  # fmt: skip
    return list(items[:n])


def first_val(items: Sequence[T], n: int, source: str, unit: str) -> list[T]:
    """The first ``n`` validation ``items`` (``data.num_val_samples``), logged when that cuts
    a validation set (a smaller one is validated whole: ``n`` is a cap)."""
    if n < len(items):
        logger.warning(
            "data.num_val_samples=%d: %s holds %d %s; validating on the first %d",
            n, source, len(items), unit, n,
        )  # fmt: skip
    return list(items[:n])


def split_off_val(items: Sequence[T], num_val: int, seed: int = 0) -> tuple[list[T], list[T]]:
    """Deterministic split: items ordered by sha256(f"{seed}:{index}"), the first ``num_val``
    go to val. Each split keeps the input order, so the split depends only on the item
    count, ``num_val`` and the seed."""
    if not 0 <= num_val < len(items):
        raise ValueError(
            f"cannot hold out {num_val} validation examples from {len(items)}; "
            "lower num_val_samples or pass a separate validation file"
        )
    order = sorted(range(len(items)), key=lambda i: stable_hash(f"{seed}:{i}"))
    val_idx = set(order[:num_val])
    train = [x for i, x in enumerate(items) if i not in val_idx]
    val = [x for i, x in enumerate(items) if i in val_idx]
    return train, val
