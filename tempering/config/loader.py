"""Load a run's configuration: YAML with `defaults:` inheritance, Hydra-style overrides,
validation against a pydantic schema that reports every problem at once.

    cfg, resolved = parse_args_and_load(sys.argv[1:], DEFAULT_YAML, GRPOMasterConfig)

Grammar of overrides (Hydra's own parser): ``a.b=1`` changes an existing key, ``++a.b=1``
adds or changes, ``+a.b=1`` adds (error if present), ``~a.b`` deletes; values may be lists
(``a=[1,2]``), quoted strings, ``null``. ``--config FILE`` picks the YAML.

This module imports no torch/ray/transformers: a bad config fails in well under a second.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(Exception):
    """One or more configuration problems, each `"<dotted.path>: <what is wrong>"`."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(f"config error: {p}" for p in problems))


# ----------------------------------------------------------------- YAML + defaults
def load_yaml(path: str | Path, _stack: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read `path`, merging its `defaults:` files first (relative to it; later wins; the file
    itself wins over all its defaults)."""
    path = Path(path).resolve()
    if path in _stack:
        chain = " -> ".join(str(p) for p in (*_stack, path))
        raise ConfigError([f"defaults: inheritance cycle: {chain}"])
    if not path.is_file():
        where = f" (a default of {_stack[-1]})" if _stack else ""
        raise ConfigError([f"config file {path} does not exist{where}; check the path"])
    with path.open() as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: top level must be a mapping, got {type(data).__name__}"])
    defaults = data.pop("defaults", [])
    if isinstance(defaults, str):
        defaults = [defaults]
    merged = OmegaConf.create({})
    for parent in defaults:
        merged = OmegaConf.merge(merged, load_yaml(path.parent / parent, (*_stack, path)))
    merged = OmegaConf.merge(merged, OmegaConf.create(data))
    return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]


# ----------------------------------------------------------------------- overrides
def apply_overrides(
    cfg: dict[str, Any], overrides: Sequence[str], problems: list[str] | None = None
) -> dict[str, Any]:
    """Apply Hydra-grammar `overrides` to a plain dict (not modified). Every problem is
    collected; with `problems` given they are appended there (the caller raises), else a
    ConfigError is raised here."""
    raise_here = problems is None
    problems = [] if problems is None else problems
    if not overrides:
        return cfg
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    conf = OmegaConf.create(cfg)
    parser = OverridesParser.create()
    for text in overrides:
        try:
            (ov,) = parser.parse_overrides([text])
        except OverrideParseException as e:
            problems.append(f"override {text!r} cannot be parsed: {e}")
            continue
        key = ov.key_or_group
        exists = OmegaConf.select(conf, key, default=_MISSING) is not _MISSING
        if ov.is_delete():
            if not exists:
                problems.append(f"{key}: cannot delete (~{key}), the key does not exist")
                continue
            parent_key, _, leaf = key.rpartition(".")
            parent = OmegaConf.select(conf, parent_key) if parent_key else conf
            del parent[leaf]
            continue
        if ov.is_add() and exists:
            problems.append(
                f"{key}: +{key}=... adds a new key but it exists; use {key}=... or ++{key}=..."
            )
            continue
        if not (ov.is_add() or ov.is_force_add()) and not exists:
            problems.append(_unknown(key, cfg) + f"; to add a new key use ++{key}=...")
            continue
        OmegaConf.update(conf, key, ov.value(), merge=False, force_add=True)
    if problems and raise_here:
        raise ConfigError(problems)
    return OmegaConf.to_container(conf, resolve=True)  # type: ignore[return-value]


_MISSING = object()
_EXPECTED = {
    "int": "int",
    "float": "float",
    "bool": "bool",
    "string": "str",
    "list": "list",
    "tuple": "list",
    "dict": "mapping",
    "model": "mapping",
}


def _dotted_paths(cfg: Any, prefix: str = "") -> list[str]:
    out: list[str] = []
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            p = f"{prefix}.{k}" if prefix else str(k)
            out.append(p)
            out.extend(_dotted_paths(v, p))
    return out


def _suggest(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _unknown(key: str, cfg: dict[str, Any]) -> str:
    return f"{key}: unknown key{_suggest(key, _dotted_paths(cfg))}"


# ---------------------------------------------------------------------- validation
def schema_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every valid dotted path of a schema (for suggestions)."""
    out: list[str] = []
    for name, field in model.model_fields.items():
        p = f"{prefix}.{name}" if prefix else name
        out.append(p)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(schema_paths(ann, p))
    return out


def validate(cfg: dict[str, Any], schema: type[M]) -> M:
    """Validate `cfg` against `schema`; every problem is reported at once by dotted path."""
    try:
        return schema.model_validate(cfg)
    except ValidationError as e:
        valid = schema_paths(schema)
        problems = []
        for err in e.errors():
            path = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                problems.append(f"{path}: unknown key{_suggest(path, valid)}")
            elif err["type"] == "missing":
                problems.append(f"{path}: required key is missing")
            elif err["type"] in ("value_error", "assertion_error"):
                msg = err["msg"].removeprefix("Value error, ")
                problems.append(f"{path}: {msg}" if path else msg)
            else:
                given = err.get("input")
                kind = err["type"].split("_")[0]
                what = f"expected {_EXPECTED[kind]}" if kind in _EXPECTED else err["msg"].lower()
                problems.append(f"{path}: {what}, got {given!r}")
        raise ConfigError(problems) from None


def load_config(
    path: str | Path, overrides: Sequence[str] = (), *, schema: type[M]
) -> tuple[M, dict[str, Any]]:
    """YAML (+defaults) -> overrides -> validated schema. Returns (model, resolved dict).

    Overrides may change any key the schema knows, even one the YAML leaves at its default.
    Override and schema problems are reported together."""
    base = OmegaConf.merge(schema().model_dump(mode="json"), load_yaml(path))
    problems: list[str] = []
    raw = apply_overrides(OmegaConf.to_container(base), list(overrides), problems)  # type: ignore[arg-type]
    try:
        model = validate(raw, schema)
    except ConfigError as e:
        raise ConfigError(problems + e.problems) from None
    if problems:
        raise ConfigError(problems)
    return model, model.model_dump(mode="json")


def parse_args_and_load(
    argv: Sequence[str], default_config: str | Path, schema: type[M]
) -> tuple[M, dict[str, Any]]:
    """For example scripts: ``[--config FILE] [override ...]``. Exits 2 on any config error."""
    args = list(argv)
    config = Path(default_config)
    if "-h" in args or "--help" in args:
        print(f"usage: [--config FILE] [dotted.key=value ...]\ndefault config: {config}")
        print("keys:\n  " + "\n  ".join(schema_paths(schema)))
        raise SystemExit(0)
    for flag in ("--config", "--config-file"):
        if flag in args:
            i = args.index(flag)
            if i + 1 >= len(args):
                _exit([f"{flag} needs a file name"])
            config = Path(args[i + 1])
            del args[i : i + 2]
    for a in args:
        if a.startswith("--config="):
            config = Path(a.split("=", 1)[1])
    args = [a for a in args if not a.startswith("--config=")]
    try:
        return load_config(config, args, schema=schema)
    except ConfigError as e:
        _exit(e.problems)
        raise  # unreachable


def _exit(problems: list[str]) -> None:
    print("\n".join(f"config error: {p}" for p in problems), file=sys.stderr)
    print(f"({len(problems)} problem(s); nothing was started)", file=sys.stderr)
    raise SystemExit(2)
