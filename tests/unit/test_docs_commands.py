"""Every `uv run examples/...` and `uv run tempering ...` command the README and the docs show
names a script, a config and keys that exist: each example command's overrides are loaded
against its script's schema, each `tempering` command is parsed by the real CLI parser (and a
config it names is loaded). A command shown with its refusal (the next line begins
`config error:`) must be refused with that message."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tempering.cli import build_parser
from tempering.config import MASTER_CONFIGS, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SCHEMAS = {schema.__name__: schema for schema in MASTER_CONFIGS.values()}
# A usage synopsis or a placeholder the reader fills in, not a command to run as shown.
SYNOPSIS = re.compile(r"\[--|\b[A-Z][A-Z_]{2,}\b(?!\.)")


def shown_commands() -> list[tuple[str, str, str | None]]:
    """(page:line, command, the refusal printed under it or None) for every command shown."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            for m in re.finditer(
                r"uv run ((?:--[a-z]+(?: [a-z]+)? )*)(examples/|tempering )", line
            ):
                if re.search(r"--group|--with", m.group(1)):
                    continue
                text, j = line[m.start() :], i
                while text.rstrip().endswith("\\") and j + 1 < len(lines):  # continued lines
                    j += 1
                    text = text.rstrip()[:-1] + " " + lines[j].strip()
                text = re.split(r"`|\s#|\s\||&&|;|\"", text)[0].strip()
                after = lines[j + 1] if j + 1 < len(lines) else ""
                refusal = (
                    after.removeprefix("config error: ")
                    if after.startswith("config error:")
                    else None
                )
                found.append((f"{page.relative_to(ROOT)}:{i + 1}", text, refusal))
    return found


COMMANDS = shown_commands()


def test_the_scan_finds_the_commands_the_docs_show():
    assert len(COMMANDS) > 80
    assert sum(1 for _, cmd, _ in COMMANDS if " tempering " in f" {cmd} ") > 15


def _script_schema(script: Path) -> tuple[Path, type]:
    """The default config and the schema an example script loads (its DEFAULT and
    `parse_args_and_load(..., <Schema>)`, or `run_grpo_example` / `run_distillation_example`)."""
    source = script.read_text()
    default = re.search(r'DEFAULT = Path\(__file__\)\.parent / "configs" / "([^"]+)"', source)
    assert default, f"{script.name}: no DEFAULT config"
    launcher = re.search(r"run_(grpo|distillation)_example\(", source)
    if launcher:
        return script.parent / "configs" / default.group(1), MASTER_CONFIGS[launcher.group(1)]
    name = re.search(r"parse_args_and_load\([^)]*?(\w+MasterConfig)\)", source)
    assert name, f"{script.name}: cannot tell which schema it loads"
    return script.parent / "configs" / default.group(1), SCHEMAS[name.group(1)]


def _config_and_overrides(args: list[str], default: Path | None) -> tuple[Path | None, list[str]]:
    config, overrides = default, []
    it = iter(args)
    for arg in it:
        if arg in ("--config", "--config-file"):
            config = ROOT / next(it)
        elif arg.startswith("--config="):
            config = ROOT / arg.split("=", 1)[1]
        elif "=" in arg:
            overrides.append(arg)
    return config, overrides


def _check_example(tokens: list[str], refusal: str | None) -> None:
    script = ROOT / tokens[0]
    assert script.is_file(), f"no such script: {tokens[0]}"
    default, schema = _script_schema(script)
    if "--help" in tokens:
        return
    config, overrides = _config_and_overrides(tokens[1:], default)
    assert config.is_file(), f"no such config: {config}"
    if refusal is None:
        load_config(config, overrides, schema=schema)  # raises ConfigError naming the key
        return
    with pytest.raises(ConfigError) as refused:
        load_config(config, overrides, schema=schema)
    assert refusal in str(refused.value), "the page shows a refusal the loader does not give"


def _check_tempering(tokens: list[str]) -> None:
    parser = build_parser()
    try:
        args = parser.parse_args(tokens[1:])
    except SystemExit as e:  # --version and --help exit 0; a parse error exits 2
        assert e.code == 0, f"the CLI refuses {tokens}"
        return
    if getattr(args, "config", None) and str(args.config).endswith(".yaml"):
        from tempering.distributed.placement import schema_for

        config = ROOT / args.config
        assert config.is_file(), f"no such config: {args.config}"
        load_config(config, list(getattr(args, "overrides", []) or []),
                    schema=MASTER_CONFIGS[schema_for(config)])  # fmt: skip


@pytest.mark.parametrize(("where", "command", "refusal"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_command_the_docs_show_names_what_exists(where, command, refusal):
    if SYNOPSIS.search(command.removeprefix("uv run")):
        pytest.skip(f"a synopsis with placeholders: {command}")
    tokens = shlex.split(command)[2:]
    tokens = [t for t in tokens if t not in ("--locked", "--no-sync")]
    if tokens[0].startswith("examples/"):
        _check_example(tokens, refusal)
    else:
        assert tokens[0] == "tempering", command
        _check_tempering(tokens)
