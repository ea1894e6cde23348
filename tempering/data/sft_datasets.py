"""SFT dataset loaders: local files in, message logs out (no hub access).

Formats (each loader returns a :class:`~tempering.data.records.LoadedData` of message logs):

- **SQuAD JSON** (:func:`load_squad_json`), the shape of NeMo RL's README SFT example::

      {"data": [{"title": ..., "paragraphs": [{"context": ...,
                 "qas": [{"question": ..., "answers": [{"text": ...}, ...]}]}]}]}

  One example per question: user = ``"Context: <context>\\n\\nQuestion: <question>"``,
  assistant = the first answer's text. A JSON document has no per-row line numbers, so
  errors name the JSON path instead (``squad.json:data[0].paragraphs[1].qas[2]: ...``).
- **OpenAI-messages JSONL** (:func:`load_messages_jsonl`): ``{"messages": [{"role",
  "content"}, ...]}`` per line; must contain at least one assistant message. Tool calls
  (assistant ``tool_calls``, ``tool`` messages) and a row's ``tools`` specs are read as
  `data/messages.py` describes (TRL's ``messages`` + ``tools`` columns); such a row is a
  :class:`~tempering.data.messages.Conversation`, the loss on the assistant turns only.
- **Prompt/response JSONL** (:func:`load_prompt_response_jsonl`): ``{"<prompt_key>": str,
  "<response_key>": str}`` per line -> user = prompt, assistant = response. Either may be a
  list of messages instead (TRL's conversational prompt-completion rows: ``response_key=
  completion``); the loss is then on the response's assistant turns only, not on assistant
  turns inside the prompt (few-shot examples). A row's ``tools`` are read as above.
- **Plain text** (:func:`load_text_rows`): ``{"<text_key>": str}`` per line, TRL's
  language-modelling rows: a :class:`~tempering.data.messages.Text`, every token trained on.
- **Hugging Face datasets** (:func:`load_hf_sft`): a folder written by
  ``Dataset.save_to_disk`` (read with ``datasets.load_from_disk``) or local data files (the
  reader above, concatenated); each row is read by its columns as TRL reads them
  (``messages``, else ``prompt_key``/``response_key``, else ``text_key``). Errors name
  ``row <index>`` (a line in JSONL).

The "JSONL" loaders read any data file `records.iter_rows` reads: JSON Lines, a JSON array,
Parquet or CSV. Bad rows raise :class:`~tempering.data.records.DataFormatError` naming file,
line (or row) and field, or are skipped and counted with ``on_bad_row="skip"``.

:func:`load_sft_splits` is the one entry point a config uses: ``data.dataset_name`` picks the
loader (:data:`SFT_LOADERS`), and without a validation file the last-resort validation split
is held out of the training file deterministically (:func:`~tempering.data.records.split_off_val`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, NamedTuple

from tempering.data.messages import (
    Conversation,
    Text,
    as_prompt,
    as_response,
    check_message_log,
    check_tool_turns,
    row_tools,
)
from tempering.data.records import (
    DataFormatError,
    LoadedData,
    MessageLog,
    OnBadRow,
    RowError,
    RowIssues,
    hold_out,
    load_rows,
    require,
)
from tempering.errors import DataFileNotFoundError


def prompt_response_log(prompt: str, response: str, system: str | None = None) -> MessageLog:
    """The message log of one single-turn example."""
    log: MessageLog = [{"role": "system", "content": system}] if system else []
    log += [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return log


def _messages_converter(messages_key: str):
    def convert(row: dict[str, Any]) -> MessageLog | Conversation:
        require(row, messages_key, [messages_key], list)
        log = check_message_log(row[messages_key], messages_key)
        if not any(m["role"] == "assistant" for m in log):
            raise RowError(f"field {messages_key!r} has no assistant message to train on")
        check_tool_turns(log, messages_key)
        tools = row_tools(row)
        return Conversation(log, tools) if tools else log

    return convert


def _prompt_response_converter(prompt_key: str, response_key: str):
    keys = [prompt_key, response_key]

    def convert(row: dict[str, Any]) -> MessageLog | Conversation:
        prompt = as_prompt(require(row, prompt_key, keys, (str, list)), prompt_key)
        response = as_response(require(row, response_key, keys, (str, list)), response_key)
        log = prompt + response
        check_tool_turns(log, f"{prompt_key} + {response_key}")
        tools = row_tools(row)
        if tools or any(m["role"] == "assistant" for m in prompt):  # train on the response only
            return Conversation(log, tools, loss_from=len(prompt))
        return log

    return convert


def _text_converter(text_key: str):
    def convert(row: dict[str, Any]) -> Text:
        text = require(row, text_key, [text_key], str)
        if not text.strip():
            raise RowError(f"field {text_key!r} is empty: nothing to train on")
        return Text(text)

    return convert


def _any_converter(prompt_key: str, response_key: str, text_key: str):
    """A Hugging Face dataset's rows by their columns, as TRL reads them: ``messages`` (a
    conversation; UltraChat's rows also carry its first turn as ``prompt``), else
    ``prompt_key``/``response_key`` (prompt-completion), else ``text_key`` (language
    modelling)."""
    pairs = _prompt_response_converter(prompt_key, response_key)
    messages, text = _messages_converter("messages"), _text_converter(text_key)

    def convert(row: dict[str, Any]) -> MessageLog | Conversation | Text:
        if "messages" in row and response_key not in row:
            return messages(row)
        if prompt_key in row or response_key in row:
            return pairs(row)
        if text_key in row:
            return text(row)
        raise RowError(
            f"no columns to train on: expected 'messages' (a conversation), {prompt_key!r} and "
            f"{response_key!r} (data.prompt_key, data.response_key) or {text_key!r} "
            f"(data.text_key, plain text); the row has {sorted(row)}"
        )

    return convert


def load_text_rows(
    path: str | Path, text_key: str = "text", on_bad_row: OnBadRow = "error"
) -> LoadedData:
    """Plain-text rows (``{"text": ...}``, TRL's language-modelling format): each a `Text`."""
    return load_rows(path, on_bad_row, _text_converter(text_key))


def load_messages_jsonl(
    path: str | Path, messages_key: str = "messages", on_bad_row: OnBadRow = "error"
) -> LoadedData:
    """OpenAI-messages JSONL: one ``{"messages": [...]}`` object per line."""
    return load_rows(path, on_bad_row, _messages_converter(messages_key))


def load_prompt_response_jsonl(
    path: str | Path,
    prompt_key: str = "prompt",
    response_key: str = "response",
    on_bad_row: OnBadRow = "error",
) -> LoadedData:
    """Prompt/response JSONL with configurable keys."""
    return load_rows(path, on_bad_row, _prompt_response_converter(prompt_key, response_key))


def _squad_log(qa: Any, context: str) -> MessageLog:
    if not isinstance(qa, dict):
        raise RowError(f"expected an object with question and answers, got {type(qa).__name__}")
    question = require(qa, "question", ["question", "answers"], str)
    answers = require(qa, "answers", ["question", "answers"], list)
    if not answers:
        raise RowError("field 'answers' is empty (an unanswerable SQuAD v2 question?)")
    if not isinstance(answers[0], dict) or not isinstance(answers[0].get("text"), str):
        raise RowError("field 'answers'[0].text is missing or not a string")
    user = f"Context: {context}\n\nQuestion: {question}"
    return prompt_response_log(user, answers[0]["text"])


def load_squad_json(path: str | Path, on_bad_row: OnBadRow = "error") -> LoadedData:
    """SQuAD-format JSON: one SFT example per question (first answer)."""
    path = Path(path)
    if not path.is_file():
        raise DataFileNotFoundError(f"SQuAD file {str(path)!r} does not exist; check the path")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataFormatError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from err
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise DataFormatError(f"{path}: missing top-level field 'data' (a list of articles)")
    issues = RowIssues(str(path), on_bad_row)
    logs: list[MessageLog] = []
    for a, article in enumerate(doc["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            issues.bad(f"data[{a}]", "missing field 'paragraphs' (a list)")
            continue
        for p, para in enumerate(paragraphs):
            where = f"data[{a}].paragraphs[{p}]"
            if not isinstance(para, dict) or not isinstance(para.get("context"), str):
                issues.bad(where, "missing field 'context' (a string)")
                continue
            if not isinstance(para.get("qas"), list):
                issues.bad(where, "missing field 'qas' (a list)")
                continue
            convert = functools.partial(_squad_log, context=para["context"])
            for q, qa in enumerate(para["qas"]):
                if (log := issues.convert(f"{where}.qas[{q}]", qa, convert)) is not None:
                    logs.append(log)
    return issues.finish(path.stem, logs)


def load_hf_sft(
    path_or_files: str | Path | list[str],
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str | None = None,
    split: str = "train",
    on_bad_row: OnBadRow = "error",
    text_key: str = "text",
) -> LoadedData:
    """A Hugging Face dataset folder written by ``save_to_disk``, or data files (any that
    `records.iter_rows` reads: JSONL, JSON, Parquet, CSV), concatenated in order.

    Rows map by ``messages_key`` when given, else by their columns (`_any_converter`:
    ``prompt_key``/``response_key``, ``messages`` or ``text_key``). ``split`` picks the split
    of a saved ``DatasetDict`` (ignored for a single ``Dataset``).
    """
    convert = (
        _messages_converter(messages_key)
        if messages_key
        else _any_converter(prompt_key, response_key, text_key)
    )
    if isinstance(path_or_files, list) or not Path(path_or_files).is_dir():
        files = path_or_files if isinstance(path_or_files, list) else [path_or_files]
        parts = [load_rows(f, on_bad_row, convert) for f in files]
        return LoadedData(
            Path(files[0]).stem,
            [log for part in parts for log in part.examples],
            sum(part.num_skipped for part in parts),
            [reason for part in parts for reason in part.skipped_reasons],
        )
    import datasets  # heavy import; only a saved dataset folder needs it

    source = str(path_or_files)
    ds = datasets.load_from_disk(source)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise KeyError(f"{source}: no split {split!r}; it has {sorted(ds)}")
        ds = ds[split]
    issues = RowIssues(source, on_bad_row)
    logs = []
    for i, row in enumerate(ds):
        # Arrow unifies columns across rows, so a field a row lacks reads back as None.
        present = {k: v for k, v in row.items() if v is not None}
        if (log := issues.convert(f"row {i}", present, convert)) is not None:
            logs.append(log)
    return issues.finish(Path(source).stem, logs)


def _load_squad(path: str, keys: RowKeys, on_bad_row: OnBadRow):
    return load_squad_json(path, on_bad_row)


def _load_messages(path: str, keys: RowKeys, on_bad_row: OnBadRow):
    return load_messages_jsonl(path, on_bad_row=on_bad_row)


def _load_prompt_response(path: str, keys: RowKeys, on_bad_row: OnBadRow):
    return load_prompt_response_jsonl(path, keys.prompt, keys.response, on_bad_row)


def _load_text(path: str, keys: RowKeys, on_bad_row: OnBadRow):
    return load_text_rows(path, keys.text, on_bad_row)


def _load_hf(path: str, keys: RowKeys, on_bad_row: OnBadRow):
    return load_hf_sft(path, keys.prompt, keys.response, on_bad_row=on_bad_row, text_key=keys.text)


class RowKeys(NamedTuple):
    """The columns a data file's rows are read by (``data.prompt_key``, ``data.response_key``,
    ``data.text_key``)."""

    prompt: str = "prompt"
    response: str = "response"
    text: str = "text"


# data.dataset_name -> loader(path, keys, on_bad_row) for local files.
SFT_LOADERS = {
    "squad": _load_squad,
    "messages": _load_messages,
    "prompt_response": _load_prompt_response,
    "text": _load_text,
    "hf": _load_hf,
}


def load_sft_splits(
    name: str,
    train_data_path: str | None,
    val_data_path: str | None = None,
    prompt_key: str = "prompt",
    response_key: str = "response",
    on_bad_row: OnBadRow = "error",
    num_val: int = 256,
    seed: int = 0,
    text_key: str = "text",
) -> tuple[list[Any], list[Any]]:
    """``(train, val)`` message logs of a file-based dataset named by ``data.dataset_name``.

    With ``val_data_path`` the validation logs come from that file; otherwise ``num_val``
    logs are held out of the training file by :func:`hold_out` with ``seed`` (at most half;
    a cap is logged).
    """
    if name not in SFT_LOADERS:
        raise ValueError(
            f"data.dataset_name={name!r} is not a file-based SFT dataset; use one of "
            f"{sorted(SFT_LOADERS)} (or 'arithmetic' / 'gsm8k', which are built in)"
        )
    if not train_data_path:
        raise ValueError(f"data.dataset_name={name!r} needs data.train_data_path=<file or folder>")
    load, keys = SFT_LOADERS[name], RowKeys(prompt_key, response_key, text_key)
    train = load(train_data_path, keys, on_bad_row).examples
    if val_data_path:
        return train, load(val_data_path, keys, on_bad_row).examples
    return hold_out(train, num_val, seed, f"data.train_data_path={train_data_path!r}")
