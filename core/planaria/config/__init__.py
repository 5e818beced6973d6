"""The declarative job configuration: one YAML or TOML file, validated with every plugin's options.

``load(path, overrides)`` reads the file, applies ``--set`` overrides, loads the plugins it
allows, validates everything in one pass and returns the resolved configuration.
"""

from planaria.config.loader import RawConfig, read, validate
from planaria.config.models import Config
from planaria.config.resolve import ResolvedBackend, ResolvedConfig, load, load_raw, resolve

__all__ = [
    "Config",
    "RawConfig",
    "ResolvedBackend",
    "ResolvedConfig",
    "load",
    "load_raw",
    "read",
    "resolve",
    "validate",
]
