"""Load a run's configuration: YAML with `defaults:` inheritance, Hydra-style overrides,
validation against a pydantic schema that reports every problem at once.

    cfg, resolved = parse_args_and_load(sys.argv[1:], DEFAULT_YAML, GRPOMasterConfig)

Grammar of overrides (Hydra's own parser): ``a.b=1`` changes an existing key, ``++a.b=1``
adds or changes, ``+a.b=1`` adds (error if present), ``~a.b`` deletes; values may be lists
(``a=[1,2]``), quoted strings, ``null``. ``--config FILE`` picks the YAML.

Interpolations (``${policy.max_total_sequence_length}``) are resolved once, after every
`defaults:` file and every override has been merged, so an override of the referenced key
reaches every place that refers to it.

This module imports no torch/ray/transformers: a bad config fails in well under a second.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from tempering.errors import UserInputError

M = TypeVar("M", bound=BaseModel)


class ConfigError(UserInputError):
    """One or more configuration problems, each `"<dotted.path>: <what is wrong>"`."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(f"config error: {p}" for p in problems))


# ----------------------------------------------------------------- YAML + defaults
def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read `path`, merging its `defaults:` files first (relative to it; later wins; the file
    itself wins over all its defaults), recursively; interpolations resolved at the end."""
    return _resolve(_load_node(Path(path), ()))


def _load_node(path: Path, stack: tuple[Path, ...]) -> DictConfig:
    """`path` merged over its defaults, interpolations left unresolved."""
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(str(p) for p in (*stack, path))
        raise ConfigError([f"defaults: inheritance cycle: {chain}"])
    if not path.is_file():
        where = f" (listed in defaults: of {stack[-1]})" if stack else ""
        if path.is_dir():
            inside = sorted(p.name for p in path.glob("*.yaml"))
            more = f" and {len(inside) - 6} more" if len(inside) > 6 else ""
            hint = f"; it holds {', '.join(inside[:6])}{more}" if inside else ""
            raise ConfigError([f"config file {path}{where} is a folder: name a YAML file{hint}"])
        raise ConfigError([f"config file {path} does not exist{where}; check the path"])
    try:
        with path.open() as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: top level must be a mapping, got {type(data).__name__}"])
    defaults = data.pop("defaults", [])
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError(
            [f"{path}: defaults: must be a file name or a list of file names, got {defaults!r}"]
        )
    merged = OmegaConf.create({})
    for parent in defaults:
        merged = OmegaConf.merge(merged, _load_node(path.parent / parent, (*stack, path)))
    return OmegaConf.merge(merged, OmegaConf.create(data))  # type: ignore[return-value]


def _resolve(conf: DictConfig, problems: list[str] | None = None) -> dict[str, Any]:
    """Plain dict with interpolations resolved; each unresolvable one is a problem (raised
    here unless `problems` collects them)."""
    try:
        return OmegaConf.to_container(conf, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException:
        pass
    found: list[str] = []
    for path in _dotted_paths(OmegaConf.to_container(conf, resolve=False)):
        try:
            OmegaConf.select(conf, path, throw_on_resolution_failure=True)
        except OmegaConfBaseException as e:
            found.append(f"{path}: cannot resolve {_first_line(e)}")
    found = found or ["config: cannot resolve its interpolations"]
    if problems is None:
        raise ConfigError(found)
    problems.extend(found)
    return OmegaConf.to_container(conf, resolve=False)  # type: ignore[return-value]


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# ----------------------------------------------------------------------- overrides
def apply_overrides(
    cfg: dict[str, Any], overrides: Sequence[str], problems: list[str] | None = None
) -> dict[str, Any]:
    """Apply Hydra-grammar `overrides` to a plain dict (not modified). Every problem is
    collected; with `problems` given they are appended there (the caller raises), else a
    ConfigError is raised here."""
    found: list[str] = []
    conf = OmegaConf.create(cfg)
    _apply_overrides(conf, overrides, found)
    out = _resolve(conf, found)
    if problems is not None:
        problems.extend(found)
    elif found:
        raise ConfigError(found)
    return out


def _apply_overrides(conf: DictConfig, overrides: Sequence[str], problems: list[str]) -> None:
    """Apply `overrides` to `conf` in place, in order; each bad one is a problem."""
    if not overrides:
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    known = _dotted_paths(OmegaConf.to_container(conf, resolve=False))
    parser = OverridesParser.create()
    for text in overrides:
        try:
            (ov,) = parser.parse_overrides([text])
        except OverrideParseException as e:
            problems.append(f"override {text!r} cannot be parsed: {_first_line(e)}")
            continue
        key = ov.key_or_group
        if ov.is_sweep_override():
            problems.append(
                f"{key}: {text!r} is a sweep (a,b / range / choice), which is not supported; "
                f"quote a value that contains a comma: {key}='a,b'"
            )
            continue
        exists = OmegaConf.select(conf, key, default=_MISSING) is not _MISSING
        if ov.is_delete():
            if not exists:
                problems.append(f"{key}: cannot delete (~{key}), the key does not exist")
                continue
            parent_key, _, leaf = key.rpartition(".")
            parent = OmegaConf.select(conf, parent_key) if parent_key else conf
            del parent[int(leaf) if isinstance(parent, ListConfig) else leaf]
            continue
        if ov.is_add() and exists:
            problems.append(
                f"{key}: +{key}=... adds a new key but it exists; use {key}=... or ++{key}=..."
            )
            continue
        if not (ov.is_add() or ov.is_force_add()) and not exists:
            problems.append(
                f"{key}: unknown key{_suggest(key, known)}; to add a new key use ++{key}=..."
            )
            continue
        try:
            OmegaConf.update(conf, key, ov.value(), merge=False, force_add=True)
        except OmegaConfBaseException as e:
            problems.append(f"{key}: override {text!r} cannot be applied: {_first_line(e)}")


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


# ---------------------------------------------------------------------- validation
# An algorithm's own section -> the entry points that train it (a config given to another's).
_ALGORITHM_SCRIPTS = {
    "sft": ("SFT", "examples/run_sft.py"),
    "dpo": ("DPO", "examples/run_dpo.py"),
    "kto": ("KTO", "examples/run_kto.py"),
    "rm": ("reward-model training", "examples/run_rm.py"),
    "grpo": ("GRPO", "a GRPO script (examples/run_grpo_math.py, run_grpo_multiturn.py, "
             "run_grpo_nemo_gym.py)"),
    "distillation": ("on-policy distillation", "examples/run_distillation.py"),
}  # fmt: skip


def _submodel(annotation: Any) -> type[BaseModel] | None:
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def schema_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every valid dotted path of a schema (for suggestions)."""
    out: list[str] = []
    for name, field in model.model_fields.items():
        p = f"{prefix}.{name}" if prefix else name
        out.append(p)
        if sub := _submodel(field.annotation):
            out.extend(schema_paths(sub, p))
    return out


def schema_leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every leaf key of a schema as (dotted path, field), in declaration order; a list of
    sections (``data.blend``) is itself a key, and its items' keys follow as ``key[].x``."""
    for name, field in model.model_fields.items():
        p = f"{prefix}.{name}" if prefix else name
        if sub := _submodel(field.annotation):
            yield from schema_leaves(sub, p)
            continue
        yield p, field
        args = get_args(field.annotation)
        if get_origin(field.annotation) is list and args and (item := _submodel(args[0])):
            yield from schema_leaves(item, f"{p}[]")


def schema_help(model: type[BaseModel]) -> list[str]:
    """One line per leaf key: ``dotted.path: type = default  # description`` (for --help)."""
    out: list[str] = []
    for p, field in schema_leaves(model):
        ann = field.annotation
        kind = str(ann) if get_args(ann) or not hasattr(ann, "__name__") else ann.__name__
        line = f"{p}: {kind.replace('typing.', '')} = {field.default!r}"
        out.append(f"{line}  # {field.description}" if field.description else line)
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
            if err["type"] == "extra_forbidden" and path in _ALGORITHM_SCRIPTS:
                name, script = _ALGORITHM_SCRIPTS[path]
                problems.append(
                    f"{path}: unknown key: this file configures {name} (its {path}: section), "
                    f"which this entry point does not train; run it with {script}"
                )
            elif err["type"] == "extra_forbidden":
                problems.append(f"{path}: unknown key{_suggest(path, valid)}")
            elif err["type"] == "missing":
                problems.append(f"{path}: required key is missing")
            elif err["type"] in ("value_error", "assertion_error"):
                msg = err["msg"].removeprefix("Value error, ")
                # cross-field messages already name their dotted paths
                problems.append(msg if not path or msg.startswith(f"{path}.") else f"{path}: {msg}")
            else:
                given = err.get("input")
                kind = err["type"].split("_")[0]
                what = f"expected {_EXPECTED[kind]}" if kind in _EXPECTED else err["msg"].lower()
                problems.append(f"{path}: {what}, got {given!r}")
        problems.sort(key=lambda m: "this file configures" not in m)  # the cause first
        raise ConfigError(problems) from None


def load_config(
    path: str | Path, overrides: Sequence[str] = (), *, schema: type[M]
) -> tuple[M, dict[str, Any]]:
    """YAML (+defaults) -> overrides -> interpolations -> validated schema.

    Returns (model, resolved dict for config.yaml). Overrides may change any key the schema
    knows, even one the YAML leaves at its default. Override, interpolation and schema
    problems are reported together."""
    conf: DictConfig = OmegaConf.merge(  # type: ignore[assignment]
        schema().model_dump(mode="json"), _load_node(Path(path), ())
    )
    problems: list[str] = []
    _apply_overrides(conf, list(overrides), problems)
    raw = _resolve(conf, problems)
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
    """For example scripts: ``[--config FILE] [override ...]``. Exits 2 on any config error,
    0 after printing every key with its type, default and description for ``--help``."""
    args = list(argv)
    config = Path(default_config)
    if "-h" in args or "--help" in args:
        print(f"usage: [--config FILE] [dotted.key=value ...]\ndefault config: {config}")
        print("keys (schema defaults; the YAML may set others):\n  ", end="")
        print("\n  ".join(schema_help(schema)))
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
