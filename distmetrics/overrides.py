"""``key=value`` overrides applied to a config mapping, and where an error's value came from:
the command line's and ``from_yaml``'s ``overrides``, checked key by key against the config's
sections before any value is read (:mod:`distmetrics.config`)."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from .redaction import redact_argv
from .validation import ConfigError, text_read_as, unknown_key
from .yamlfile import OverrideLoader, StrictLoader

__all__ = ["apply_overrides", "exponent_numbers", "source_of"]
_EXPONENT_FORM = re.compile(r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+")
"""Exponent form as written, a ``_`` included so that ``7_000e6`` is refused by name, not read as text."""


def exponent_numbers(cls: type, values: dict, prefix: str = "") -> dict:
    """``values`` with text in exponent form (``7e9``, ``.989e3``, ``1.5E-4``) as floats where the
    key takes a number and not text. PyYAML follows YAML 1.1, whose floats need a dot and a signed
    exponent (``7.0e+9``), so ``num_params: 7e9`` reaches the config as text; YAML 1.2 reads a
    float. Keys that take text (``output_dir: 1e3``, a run name) keep it as written. A ``_`` in it
    (``7_000e6``) is refused, as ``1_000`` is: text to YAML 1.2, a number to no YAML."""
    hints = typing.get_type_hints(cls)
    out = dict(values)
    for key, value in values.items():
        hint = hints.get(key)
        if hint is None:
            continue  # an unknown key: refused by name when the dataclass is built
        if isinstance(value, dict) and dataclasses.is_dataclass(hint):
            out[key] = exponent_numbers(hint, value, f"{prefix}{key}.")
        elif isinstance(value, str) and _EXPONENT_FORM.fullmatch(value.strip()) and _takes_number_not_text(hint):
            if "_" in value:
                raise ConfigError(f"{prefix}{key}={value!r}: the number holds a '_', which makes it text to "
                                  f"YAML; write it without the '_' ({value.strip().replace('_', '')})")
            out[key] = float(value)
    return out


def _takes_number_not_text(hint: Any) -> bool:
    args = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    return any(a in (int, float) for a in args) and str not in args


def apply_overrides(root: type, values: dict, items: list[str]) -> dict:
    """``values`` with each ``key=value`` of ``items`` set in it (the value read as YAML by
    :class:`OverrideLoader`: no comment, anchor, alias or tag), every dotted key checked against the
    config class ``root`` first. A boolean or number where text belongs is refused here, where the
    word as written is known (``wandb_exp_name=yes``: quote 'yes', not the 'on' YAML's True reads back)."""
    if isinstance(items, (str, bytes)):  # iterated, a string's characters were the overrides
        raise ConfigError(f"overrides are a list of 'key=value' strings, got the string {items!r}: pass [{items!r}]")
    for item in items:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {_shown(item)} is not of the form key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        hint = _check_override_key(root, item, parts)
        try:
            value = yaml.load(raw, Loader=OverrideLoader) if raw.strip() else None  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            quote = f"quote it inside the value: {key}=\"{_quoted(raw)}\""
            if isinstance(err, OverrideLoader.Quoted):
                raise ConfigError(f"override {_shown(item)}: {problem}; to pass the text, {quote}") from None
            if isinstance(err, StrictLoader.Refused):  # read, but as YAML would read it wrongly: the fix is named
                raise ConfigError(f"override {_shown(item)}: {problem}") from None
            raise ConfigError(f"override {_shown(item)}: the value {raw!r} is not valid YAML ({problem}); "
                              f"to pass it as a string, {quote}") from None
        message = text_read_as(".".join(parts), value, hint, raw.strip()) if hint is not None else None
        if message:
            raise ConfigError(f"override {_shown(item)}: {message}")
        target = values
        for part in parts[:-1]:
            existing = target.get(part)
            if existing is None:
                existing = target[part] = {}
            elif not isinstance(existing, dict):  # a section given as a config object is a copy's mapping by now
                raise ConfigError(f"override {_shown(item)}: {part!r} is not a section")
            target = existing
        target[parts[-1]] = value
    return values


def source_of(message: str, overrides: list[str], path: Optional[Path]) -> str:
    """``message`` (which names the keys at fault as ``key=value``, the first at its start, or leads with
    ``key:``) led by where a value came from: the last override that set one of them or a section holding
    it (``enabled=true`` given by an override makes the file's missing ``features`` an error), else the
    file."""
    keys = re.findall(r"(?:^|(?<=\s))([\w.]+)(?==)", message)
    lead = re.match(r"([\w.]+):", message)  # 'tensor_inspect.features: file ... does not exist'
    inline = ["tensor_inspect.features"] if message.startswith("<inline features>:") else []  # a mapping's errors
    for key in inline + ([lead.group(1)] if lead else []) + keys:
        for item in reversed(overrides):
            set_key = item.split("=", 1)[0].strip()
            if key == set_key or key.startswith(set_key + ".") or (inline and set_key.startswith(key + ".")):
                return f"override {_shown(item)}: {message}"
    return f"{path}: {message}" if path is not None else message


def _shown(item: Any) -> str:
    """An override as an error names it: quoted, a secret's value hidden (``'hf_token=***'``, an unknown key)."""
    return repr(redact_argv([item])[0] if isinstance(item, str) else item)


def _quoted(raw: str) -> str:
    """``raw`` as a single-quoted YAML string (a ``'`` in it doubled)."""
    return "'" + raw.strip().replace("'", "''") + "'"


def _check_override_key(root: type, item: str, parts: list[str]) -> Any:
    """An override's dotted key names real keys as far as the config's sections go; returns the type
    hint of the key it sets (None inside a free-form mapping)."""
    section: Any = root
    hint: Any = None
    for depth, part in enumerate(parts):
        if section is None:  # inside a free-form mapping (an inline features file): anything goes
            return None
        prefix = "".join(p + "." for p in parts[:depth])
        if not part:
            raise ConfigError(f"override {_shown(item)}: empty key")
        fields = {f.name: f for f in dataclasses.fields(section)}
        if part not in fields:
            raise ConfigError(f"override {_shown(item)}: {unknown_key(prefix, part, fields)}")
        hint = typing.get_type_hints(section)[part]
        section = hint if dataclasses.is_dataclass(hint) else None
        if section is None and depth < len(parts) - 1 and typing.get_origin(hint) not in (Union, types.UnionType):
            raise ConfigError(f"override {_shown(item)}: {prefix}{part} is not a section")
    return hint
