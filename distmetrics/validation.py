"""Checking configuration values: types, listed choices, numbers that fit, and unknown keys
named with the closest valid one. Every failure is a :class:`ConfigError` naming the key, the
value given and what is accepted."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import reprlib
import types
import typing
from typing import Any, Literal, Optional, Union

from .redaction import REDACTED, is_secret_name, redact_mapping

__all__ = ["ConfigError", "checked_keywords", "check_file_keys", "check_types", "check_value", "floats_of_ints",
           "non_text_key", "text_read_as", "unknown_key"]

_INT64_LIMIT = 2 ** 63
_YAML_BOOLEAN = "YAML reads an unquoted off/on/no/yes as a boolean, not a word"


class ConfigError(ValueError):
    """A configuration key, type or value that is not accepted."""


def checked_keywords(prefix: str):
    """Make unknown keyword arguments a :class:`ConfigError` naming the closest key (the
    dataclass's own ``__init__`` would raise a bare ``TypeError``), and so an attribute set that is not a
    field (``config.log_intervall = 2``)."""
    def wrap(cls: type) -> type:
        generated = cls.__init__

        @functools.wraps(generated)
        def __init__(self, **values: Any) -> None:
            known = {f.name for f in dataclasses.fields(cls)}
            for key in values:
                if key not in known:
                    raise ConfigError(unknown_key(prefix, key, known, values[key]))
            generated(self, **values)

        def __setattr__(self, key: str, value: Any) -> None:  # a misspelt field set after construction
            if key not in fields:  # was an attribute the Monitor never read, without a word
                raise ConfigError(unknown_key(prefix, key, fields, value))
            object.__setattr__(self, key, value)

        fields = frozenset(f.name for f in dataclasses.fields(cls))
        cls.__init__ = __init__
        cls.__setattr__ = __setattr__
        return cls
    return wrap


def check_file_keys(cls: type, values: Any, prefix: str) -> None:
    """Unknown keys of a mapping read from a file, down into the config's sections."""
    if not isinstance(values, dict):
        return
    fields = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if not isinstance(key, str):
            raise ConfigError(non_text_key(prefix, key))
        if key not in fields:
            raise ConfigError(unknown_key(prefix, key, fields, value))
        if dataclasses.is_dataclass(hints[key]):
            check_file_keys(hints[key], value, f"{prefix}{key}.")


def non_text_key(prefix: str, key: Any) -> str:
    """``1: config keys are names (text), got int 1`` (YAML reads ``1: 2`` with an int key)."""
    return f"{prefix}{key!r}: config keys are names (text), got {type(key).__name__} {key!r}"


def unknown_key(prefix: str, key: Any, known: Any, value: Any = ...) -> str:
    """``unknown config key 'k' (value v); did you mean 'key'? Accepted keys: ...``."""
    by_lower = {str(k).lower(): k for k in sorted(known)}  # LOG_INTERVAL: log_interval
    close = [by_lower[k] for k in difflib.get_close_matches(str(key).lower(), list(by_lower), n=1, cutoff=0.6)]
    shown = REDACTED if is_secret_name(str(key)) else _short(redact_mapping(value))  # a secret nested in it too
    given = "" if value is ... else f" (value {shown})"
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ";"
    accepted = ", ".join(prefix + k for k in sorted(known))
    return f"unknown config key '{prefix}{key}'{given}{hint} Accepted keys: {accepted}"


def check_types(obj: Any, prefix: str, accepted: Optional[dict[str, str]] = None) -> None:
    """Check every field of a config dataclass against its type hint (see :func:`check_value`);
    ``accepted``: what a key accepts, said where its number does not fit (by field name)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        check_value(f"{prefix}{f.name}", getattr(obj, f.name), hints[f.name], (accepted or {}).get(f.name))


def paths_as_text(obj: Any, keys: tuple[str, ...]) -> None:
    """A path key given a path object (``pathlib.Path``, any ``os.PathLike`` whose path is text) holds
    that text, as a YAML file or an override gives it; a list of paths (``feature_dirs``) each of its
    items. Done before the type check, which refuses anything else (a bytes path too)."""
    def text(value: Any) -> Any:
        if isinstance(value, os.PathLike) and isinstance(os.fspath(value), str):
            return os.fspath(value)
        return value
    for key in keys:
        value = getattr(obj, key)
        value = [text(v) for v in value] if isinstance(value, list) else text(value)
        object.__setattr__(obj, key, value)


def paths_without_nul(obj: Any, prefix: str, keys: tuple[str, ...]) -> None:
    """Refuse a path key (or an item of a list of them) holding a NUL character, which no file system
    takes: it passed every check and failed where the writer opened the path, with a bare ``ValueError:
    embedded null byte`` naming no key (on the writer rank alone, the others waiting)."""
    for key in keys:
        value = getattr(obj, key)
        for item in value if isinstance(value, list) else (value,):
            if isinstance(item, str) and "\0" in item:
                raise ConfigError(f"{prefix}{key}={value!r}: a path holds no NUL character ('\\x00'); accepted values "
                                  "are paths without one")


def floats_of_ints(obj: Any) -> None:
    """An int given to a float field of a checked config dataclass becomes a float (``num_params=10**21``
    is ``1e21``). Done after every check, whose messages name the value as given."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, members = getattr(obj, f.name), _members(hints[f.name])
        if isinstance(value, int) and not isinstance(value, bool) and float in members and int not in members:
            object.__setattr__(obj, f.name, float(value))


def check_value(key: str, value: Any, expected: Any, accepted: Optional[str] = None) -> None:
    """A value of the right type, a listed choice, a number a float and an int64 can hold (not inf
    or nan); ``accepted``: what the key accepts, said instead of the bare limits where a number
    does not fit (``spike_factor=inf: accepted values are finite numbers > 1``)."""
    choices = _choices(expected)
    if _matches(value, expected):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not _representable(value, expected):
            limits = "finite numbers" if _matches(0.5, expected) else "finite numbers below 2**63"
            raise ConfigError(f"{key}={_short(value)}: accepted values are {accepted or limits}")
        return
    if choices and isinstance(value, bool):
        suggestion = {False: "disabled", True: "online"}.get(value)
        instead = f"; for {value!r} write the word {suggestion}" if suggestion in choices else ""  # YAML or key=value
        raise ConfigError(f"{key}={value!r}: {_YAML_BOOLEAN}; accepted values are {', '.join(map(repr, choices))}"
                          f"{instead}")
    message = text_read_as(key, value, expected)
    if message:
        raise ConfigError(message)
    if isinstance(value, str) and value.strip().lower().lstrip("+-") in _NONFINITE_WORDS and _matches(0.5, expected):
        raise ConfigError(f"{key}={value}: accepted values are {accepted or 'finite numbers'}")  # an override's inf
    if choices and any(type(value) is type(c) for c in choices):
        by_lower = {str(c).lower(): str(c) for c in choices}  # MAX and LAST meant max and last as much as Max did
        close = difflib.get_close_matches(str(value).lower(), list(by_lower), n=1, cutoff=0.6)
        hint = f"; did you mean {by_lower[close[0]]!r}?" if close else ""
        raise ConfigError(f"{key}={value!r}: accepted values are {', '.join(map(repr, choices))}{hint}")
    hint = ""
    if type(value) is float and value.is_integer() and abs(value) < 2**53 and _matches(int(value), expected):
        hint = f"; write {int(value)}"  # 1e5 where an int belongs
    elif isinstance(value, str) and re.fullmatch(r"[-+]?0[0-9][0-9_]*", value) and _matches(0, expected):
        hint = "; write it without the leading 0"  # YAML 1.1 reads 08 and 09 as text, 010 as octal
    given = type(value)  # a foreign type by its module: np.bool_ read "has type bool; accepted: bool"
    kind = given.__qualname__ if given.__module__ in ("builtins", "__main__") else \
        f"{given.__module__}.{given.__qualname__}"
    raise ConfigError(f"{key}={_short(value)} has type {kind}; accepted: {_describe(expected)}{hint}")


def text_read_as(key: str, value: Any, expected: Any, written: Optional[str] = None) -> Optional[str]:
    """The message for a boolean or a number where text belongs (``wandb_exp_name: yes`` reaches the
    config as True, ``wandb_exp_name: 123`` as 123), saying how to quote the text; None where the value
    is not one. ``written``: the value as the user wrote it (an override's); a file's is gone once YAML
    has read it, and the word is said generically rather than guessed back from the value (True was
    ``yes``, ``on`` or ``true``)."""
    if not isinstance(value, (bool, int, float)) or _matches(value, expected) or not _matches("text", expected):
        return None
    reads = _YAML_BOOLEAN if isinstance(value, bool) else "YAML reads an unquoted number as a number, not text"
    word = "word" if isinstance(value, bool) else "text"
    if written is None:
        quote = f"quote it as written: {key}: '<{word}>' in a file, {key}=\"'<{word}>'\" as an override"
    else:
        quoted = "'" + written.replace("'", "''") + "'"
        quote = f"quote it: {key}: {quoted} in a file, {key}=\"{quoted}\" as an override"
    return f"{key}={value!r}: {reads}; accepted: {_describe(expected)}; for the {word}, {quote}"


def _choices(expected: Any) -> tuple:
    """The values of a ``Literal`` type (also inside Optional), else ()."""
    if typing.get_origin(expected) is Literal:
        return typing.get_args(expected)
    if typing.get_origin(expected) in (Union, types.UnionType):
        return tuple(c for arg in typing.get_args(expected) for c in _choices(arg))
    return ()


def _members(expected: Any) -> tuple:
    """The types of a Union (``Optional[float]``: float and NoneType), else ``(expected,)``."""
    return typing.get_args(expected) if typing.get_origin(expected) in (Union, types.UnionType) else (expected,)


_NONFINITE_WORDS = ("inf", "infinity", "nan", ".inf", ".nan")
"""How an override writes a number a float key does not take; YAML reads them as text there (a file's
``.inf`` and ``.nan`` are floats, refused by :func:`_representable`)."""


def _representable(value: Any, expected: Any) -> bool:
    """Finite, and within an int64 where the key takes no float (an int of a float key is a float:
    ``flops_per_token=10**20`` is ``1e20``)."""
    if isinstance(value, int) and abs(value) >= _INT64_LIMIT and not _matches(0.5, expected):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _short(value: Any) -> str:
    """``repr(value)`` cut to 40 characters; a container's made no longer than that first (nested YAML
    aliases made one of gigabytes)."""
    whole = not isinstance(value, (dict, list, tuple, set))
    text = repr(value) if whole else _LIMITED.repr(value)
    if len(text) <= 40:
        return text
    return f"{text[:20]}...({len(text)} characters)" if whole else f"{text[:20]}..."


_LIMITED = reprlib.Repr()
_LIMITED.maxlevel, _LIMITED.maxstring, _LIMITED.maxother = 3, 40, 40


def _matches(value: Any, expected: Any) -> bool:
    origin = typing.get_origin(expected)
    if expected is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(expected))
    if origin is Literal:
        return value in typing.get_args(expected) and not isinstance(value, bool)
    if expected is type(None):
        return value is None
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, expected)


def _describe(expected: Any) -> str:
    origin = typing.get_origin(expected)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(expected))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(expected))
    if expected is type(None):
        return "None"
    return getattr(expected, "__name__", str(expected))
