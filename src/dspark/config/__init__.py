"""Configuration: typed schema, YAML overlays, `key=value` overrides, validation."""

from dspark.config.loader import ConfigError, parse_overrides, to_dict, to_yaml, valid_keys
from dspark.config.resolve import ResolvedConfig, repo_root, resolve_config, validate_config
from dspark.config.schema import RunConfig

__all__ = [
    "ConfigError",
    "ResolvedConfig",
    "RunConfig",
    "parse_overrides",
    "repo_root",
    "resolve_config",
    "to_dict",
    "to_yaml",
    "valid_keys",
    "validate_config",
]
