"""The documentation site's reference pages, generated from the code so they cannot go stale.

`tools/mkdocs_hooks.py` calls these while `mkdocs build` runs; the tests call them too
(tests/unit/test_docs_site.py). Each returns one Markdown page:

- `config_page()`: every key of every master config (SFT, DPO, KTO, RM, GRPO, distillation)
  with its type, default, allowed values and description, read from the pydantic schemas;
- `cli_page()`: every ``tempering`` subcommand with its arguments, from the argparse parser;
- `metrics_page()`: every metric key the loops log, from `tempering.utils.metric_docs`;
- `errors_page()`: every exception class a user can meet, read from the sources (AST).

Run it to print one page: ``uv run python tools/docs_reference.py config``.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import sys
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tempering.config.loader import schema_leaves  # noqa: E402
from tempering.config.schemas import MASTER_CONFIGS  # noqa: E402

_MASTER_NAMES = {"sft": "SFT", "dpo": "DPO", "kto": "KTO", "rm": "RM", "grpo": "GRPO",
                 "distillation": "Distillation"}  # fmt: skip


# ------------------------------------------------------------------------------ config keys
def _type_name(ann: Any) -> str:
    origin = get_origin(ann)
    if origin is Literal:
        return "choice"
    if origin in (Union, type(int | None)):
        return " | ".join(_type_name(a) for a in get_args(ann))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in get_args(ann))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if ann is type(None):
        return "null"
    return getattr(ann, "__name__", str(ann)).replace("typing.", "")


def _allowed(field: FieldInfo) -> str:
    """Literal choices and numeric bounds, as one short text."""
    parts: list[str] = []
    for ann in (field.annotation, *get_args(field.annotation)):
        if get_origin(ann) is Literal:
            parts.append(", ".join(f"`{v}`" for v in get_args(ann)))
    bounds = {annotated_types.Gt: ">", annotated_types.Ge: ">=", annotated_types.Lt: "<",
              annotated_types.Le: "<="}  # fmt: skip
    for meta in field.metadata:
        for kind, sign in bounds.items():
            if isinstance(meta, kind):
                parts.append(f"{sign} {getattr(meta, kind.__name__.lower())}")
    return "; ".join(parts)


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined:
        value = field.default_factory() if field.default_factory else "(required)"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
    return f"`{text}`" if str(text) != "" else '`""`'


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_rows(master: str) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, allowed, description) for every leaf key of one master config."""
    schema = MASTER_CONFIGS[master]
    refused = getattr(schema, "UNREAD_KEYS", {})
    rows = []
    for path, field in schema_leaves(schema):
        doc = field.description or ""
        if path in refused:
            doc = f"{doc} **Refused by {_MASTER_NAMES[master]}** unless at its default: {refused[path]}"
        rows.append((path, _type_name(field.annotation), _default(field), _allowed(field), doc))
    return rows


def config_page() -> str:
    """One table per top-level section; a section shared by several algorithms with the same
    keys is written once and says which algorithms read it."""
    sections: dict[tuple[str, tuple], list[str]] = {}
    for master in MASTER_CONFIGS:
        by_section: dict[str, list[tuple]] = {}
        for row in config_rows(master):
            by_section.setdefault(row[0].split(".")[0], []).append(row)
        for section, rows in by_section.items():
            sections.setdefault((section, tuple(rows)), []).append(_MASTER_NAMES[master])
    out = [
        "# Configuration keys",
        "",
        "Generated from the pydantic schemas in `tempering/config/` when the site is built: every",
        "key of every master config, its type, default, allowed values and description. Set any",
        "of them in a YAML file (`--config FILE`) or on the command line (`dotted.key=value`);",
        "a key that is not here is refused with the nearest valid one. An example config may set",
        "other values than these defaults: `uv run examples/run_grpo_math.py --help` prints the",
        "keys, and `logs/<run>/config.yaml` the values a run used.",
        "",
        "| algorithm | master config | entry point |",
        "|---|---|---|",
    ]
    scripts = {"sft": "run_sft.py", "dpo": "run_dpo.py", "kto": "run_kto.py", "rm": "run_rm.py",
               "grpo": "run_grpo_math.py, run_grpo_multiturn.py, run_grpo_nemo_gym.py",
               "distillation": "run_distillation.py"}  # fmt: skip
    for master, schema in MASTER_CONFIGS.items():
        out.append(
            f"| {_MASTER_NAMES[master]} | `{schema.__name__}` | `examples/{scripts[master]}` |"
        )
    seen_titles: dict[str, int] = {}
    for (section, rows), masters in sections.items():
        n = seen_titles[section] = seen_titles.get(section, 0) + 1
        title = section if n == 1 else f"{section} ({', '.join(masters)})"
        out += [
            "",
            f"## {title}",
            "",
            f"Read by: {', '.join(masters)}.",
            "",
            "| key | type | default | allowed | description |",
            "|---|---|---|---|---|",
        ]
        for key, kind, default, allowed, doc in rows:
            out.append(
                f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(allowed)} | {_cell(doc)} |"
            )
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ the CLI
def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def cli_page() -> str:
    from tempering.cli import build_parser

    parser = build_parser()
    subparsers = _subparsers(parser)
    helps = {a.dest: a.help or "" for a in subparsers._choices_actions}
    out = [
        "# The `tempering` command",
        "",
        "Generated from the argparse parser in `tempering/cli.py` when the site is built. Every",
        "subcommand below is `uv run tempering SUBCOMMAND ...`; `--help` on any of them prints",
        "the same text. The training entry points are the example scripts",
        "(`uv run examples/run_<algorithm>.py [--config FILE] [dotted.key=value ...]`,",
        "their keys in [Configuration keys](config.md)).",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
    ]
    for name, sub in subparsers.choices.items():
        sub.prog = f"tempering {name}"
        out += [
            "",
            f"## tempering {name}",
            "",
            helps.get(name, ""),
            "",
            "```text",
            sub.format_help().rstrip(),
            "```",
        ]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ metrics
def metrics_page() -> str:
    from tempering.utils.metric_docs import METRICS

    out = [
        "# Metrics",
        "",
        "Every key the training loops write to `<logger.log_dir>/metrics.jsonl` (and to",
        "TensorBoard, W&B and MLflow), generated from `tempering/utils/metric_docs.py` when the",
        "site is built. A `<name>` part stands for a family of keys (an environment, a role, a",
        "reward function). The slow tier checks every key a real run logs against this list.",
    ]
    for group, entries in METRICS.items():
        out += ["", f"## {group}", "", "| key | meaning |", "|---|---|"]
        out += [f"| `{key}` | {_cell(meaning)} |" for key, meaning in entries.items()]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ errors
_BUILTIN_ERRORS = {
    name for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, BaseException)
}  # fmt: skip


def error_classes() -> list[tuple[str, str, list[str], str]]:
    """(class, module, bases, docstring) for every exception class defined in tempering/."""
    found: dict[str, tuple[str, list[str], str]] = {}
    for path in sorted((REPO / "tempering").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                found[node.name] = (module, bases, ast.get_docstring(node) or "")
    errors: set[str] = set()
    grew = True
    while grew:
        grew = False
        for name, (_, bases, _) in found.items():
            if name not in errors and any(b in _BUILTIN_ERRORS or b in errors for b in bases):
                errors.add(name)
                grew = True
    return sorted(
        ((n, found[n][0], found[n][1], found[n][2]) for n in errors), key=lambda r: (r[1], r[0])
    )


def errors_page() -> str:
    out = [
        "# Errors",
        "",
        "Every exception class tempering defines, generated from the sources when the site is",
        "built. Those that derive from `UserInputError` are your input's fault: the entry points",
        "print their message (which names the thing, the value and the fix) and exit with status",
        "2, without a traceback. What each failure looks like from the outside, and what is kept,",
        "is in [When things go wrong](../troubleshooting.md).",
        "",
        "| error | where | derives from | what it means |",
        "|---|---|---|---|",
    ]
    for name, module, bases, doc in error_classes():
        first = doc.split("\n\n")[0].replace("\n", " ")
        out.append(f"| `{name}` | `{module}` | {', '.join(bases)} | {_cell(first)} |")
    return "\n".join(out) + "\n"


PAGES = {"config": config_page, "cli": cli_page, "metrics": metrics_page, "errors": errors_page}

if __name__ == "__main__":
    print(PAGES[sys.argv[1]]())
