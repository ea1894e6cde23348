"""Configuration: YAML with `defaults:` inheritance, Hydra-style overrides, typed schemas.

Importing this package pulls in no torch/ray/transformers (bad configs fail fast)."""

from tempering.config.loader import (
    ConfigError,
    apply_overrides,
    load_config,
    load_yaml,
    parse_args_and_load,
    validate,
)
from tempering.config.schemas import (
    MASTER_CONFIGS,
    DistillationMasterConfig,
    DPOMasterConfig,
    GRPOMasterConfig,
    KTOMasterConfig,
    RMMasterConfig,
    SFTMasterConfig,
)

__all__ = [
    "MASTER_CONFIGS",
    "ConfigError",
    "DistillationMasterConfig",
    "DPOMasterConfig",
    "KTOMasterConfig",
    "GRPOMasterConfig",
    "RMMasterConfig",
    "SFTMasterConfig",
    "apply_overrides",
    "load_config",
    "load_yaml",
    "parse_args_and_load",
    "validate",
]
