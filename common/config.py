"""Settings for every process: defaults, then a TOML file, then PDSERVE_* variables, then flags.

Each service describes its settings as a frozen dataclass; :func:`load_settings` builds
one from (in rising priority) the field defaults, the ``[section]`` table of a TOML file
given by ``--config`` or ``PDSERVE_CONFIG``, environment variables ``PDSERVE_<FIELD>``,
and command-line flags ``--field-name``. Values are converted to the field's type; a
bad value is a ``ValueError`` naming the key and where it came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _base_type(tp: Any) -> Any:
    """``int | None`` → int; ``tuple[str, ...]`` → tuple; plain types unchanged."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        return _base_type(args[0])
    return origin or tp


def _convert(value: Any, tp: Any, key: str, source: str) -> Any:
    base = _base_type(tp)
    optional = type(None) in typing.get_args(tp)
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("", "none"))):
        return None
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if base is tuple:
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(str(i).strip() for i in items if str(i).strip())
        if base is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return base(value)
    except (TypeError, ValueError):
        raise ValueError(f"setting {key!r} from {source}: cannot use {value!r} "
                         f"as {getattr(base, '__name__', base)}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    parser.add_argument("--config", help="TOML file (or PDSERVE_CONFIG)")
    for f in dataclasses.fields(cls):
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                            help=f"default: {f.default!r}" if f.default is not
                            dataclasses.MISSING else None)


def load_settings(cls: type[T], section: str, argv: Sequence[str] | None = None,
                  env: dict[str, str] | None = None, prog: str | None = None) -> T:
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog=prog or f"pdserve {section}")
    add_arguments(parser, cls)
    args = parser.parse_args(list(argv) if argv is not None else None)
    values: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    path = args.config or env.get("PDSERVE_CONFIG")
    if path:
        try:
            table = tomllib.loads(Path(path).read_text()).get(section, {})
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"cannot read config file {path}: {exc}") from exc
        unknown = set(table) - names
        if unknown:
            raise ValueError(f"unknown keys in [{section}] of {path}: {sorted(unknown)}")
        for key, value in table.items():
            values[key] = _convert(value, hints[key], key, path)
    for name in names:
        var = "PDSERVE_" + name.upper()
        if var in env:
            values[name] = _convert(env[var], hints[name], name, var)
        flag = getattr(args, name)
        if flag is not None:
            values[name] = _convert(flag, hints[name], name, "--" + name.replace("_", "-"))
    return cls(**values)


def apply_ucx_settings(tls: str, net_devices: str) -> None:
    """Set ``UCX_TLS`` / ``UCX_NET_DEVICES`` from settings (an empty one leaves the
    environment as it is). UCX reads them once, when ucxx first starts in the process,
    so this runs at process start, before any ucx receiver or sender is built."""
    import os

    for name, value in (("UCX_TLS", tls), ("UCX_NET_DEVICES", net_devices)):
        if value:
            os.environ[name] = value
