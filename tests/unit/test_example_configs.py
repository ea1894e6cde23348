"""Every shipped YAML under examples/configs/ loads and validates (new files are covered
automatically: the schema is picked by the file name's prefix)."""

from pathlib import Path

import pytest

from tempering.config import MASTER_CONFIGS, load_config

CONFIGS = sorted((Path(__file__).parents[2] / "examples" / "configs").glob("*.yaml"))


def test_there_are_configs_for_every_algorithm():
    prefixes = {p.stem.split("_")[0] for p in CONFIGS}
    assert prefixes == set(MASTER_CONFIGS), prefixes


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_validates(path):
    schema = MASTER_CONFIGS[path.stem.split("_")[0]]
    cfg, resolved = load_config(path, schema=schema)
    assert isinstance(cfg, schema)
    assert resolved["policy"]["model_name"]
