"""Serve configuration: configs/default.toml, an optional preset or file over it, then CLI flags.

default.toml names every key. A preset (`--config cpu`) or a file (`--config path.toml`) may set only
keys that default.toml has, with the same type; anything else is an error, so a typo never passes
silently as a default.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any


class ConfigError(Exception):
    pass


def _read_preset(name: str) -> tuple[str, dict]:
    res = resources.files("configs").joinpath(f"{name}.toml")
    path = Path(name)
    if res.is_file():
        source, text = f"configs/{name}.toml", res.read_text()
    elif path.is_file():
        source, text = str(path), path.read_text()
    else:
        presets = sorted(p.name[:-5] for p in resources.files("configs").iterdir() if p.name.endswith(".toml"))
        raise ConfigError(f"no config preset or file {name!r} (presets: {', '.join(presets)})")
    try:
        return source, tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: {e}") from e


def _overlay(base: dict, over: dict, source: str, where: str = "") -> None:
    for key, value in over.items():
        dotted = f"{where}{key}"
        if key not in base:
            raise ConfigError(f"{source}: unknown key {dotted!r}")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {dotted!r} must be a table")
            _overlay(base[key], value, source, dotted + ".")
        elif type(value) is not type(base[key]) and not (isinstance(base[key], float) and type(value) is int):
            raise ConfigError(f"{source}: {dotted!r} must be {type(base[key]).__name__}, not {type(value).__name__}")
        else:
            base[key] = value


def load_config(preset: str | None = None) -> dict[str, Any]:
    """The merged configuration as nested dicts: default.toml, then `preset` (a name or a path) over it."""
    _, config = _read_preset("default")
    if preset and preset != "default":
        source, over = _read_preset(preset)
        _overlay(config, over, source)
    return config


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    """'127.0.0.1:18093' or '[::1]:18093' -> (host, port); an http:// prefix and a trailing / are dropped."""
    t = text.removeprefix("http://").rstrip("/")
    host, sep, port = t.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)
