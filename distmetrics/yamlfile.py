"""YAML files read strictly: what PyYAML would read silently otherwise is a ConfigError.

A key given twice in one mapping (PyYAML keeps the last) and a number the two YAML versions read
differently (YAML 1.1, which PyYAML follows, reads ``010`` as octal 8, YAML 1.2 as 10; ``1_000`` as
1000, YAML 1.2 as text) are refused with the line they are on; a file that is missing, a folder,
not UTF-8 or not YAML is named with what it was read as (a metrics config, a features file). Torch-free.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

import yaml

from .validation import ConfigError

__all__ = ["ConfigLoader", "StrictLoader", "read_yaml"]

_DECIMAL_WITH_0 = re.compile(r"[-+]?0[0-9_]*[89][0-9_]*")  # 08: text to YAML 1.1 (not octal), 8 to YAML 1.2
_OCTAL_0O = re.compile(r"0o[0-7]+")  # 0o10: text to YAML 1.1, 8 to YAML 1.2


def read_yaml(path: Path, what: str = "metrics config file", loader: Optional[type] = None) -> Any:
    """The parsed content of a YAML file (``what`` names it in errors: a metrics config, a
    features file) read by ``loader`` (:class:`StrictLoader` by default); every way it can be
    unreadable is a ConfigError."""
    if path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a folder; give the YAML file")
    if not path.is_file():
        try:
            where = "" if path.is_absolute() else f" (relative to the working directory {os.getcwd()})"
        except OSError:  # the working directory was removed
            where = " (relative to a working directory that no longer exists)"
        raise ConfigError(f"{what} {str(path)!r} does not exist{where}")
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=loader or StrictLoader)  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError as err:
        raise ConfigError(f"{what} {str(path)!r} is not a UTF-8 text file "
                          f"({err.reason} at byte {err.start}); it must be a YAML text file") from None
    except OSError as err:
        raise ConfigError(f"{what} {str(path)!r} cannot be read: {err.strerror or err}") from None
    except StrictLoader.Refused as err:  # valid YAML, read as YAML 1.1 would read it wrongly
        raise ConfigError(f"{what} {str(path)!r}, line {err.problem_mark.line + 1}: {err.problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {err}") from None


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses what it would read silently otherwise: a key given twice
    in one mapping (the last one won), an integer written with a leading 0 (YAML 1.1, which
    PyYAML follows, reads ``010`` as octal 8; YAML 1.2 as 10) and a number in base 60 (YAML 1.1
    reads ``1:30`` as 90; YAML 1.2 as text), a number holding a ``_`` (YAML 1.1 reads ``1_000`` as
    1000; YAML 1.2 as text), and a plain ``08`` or ``09`` (text to YAML 1.1, not being octal; 8 and 9
    to YAML 1.2) or ``0o10`` (text to YAML 1.1; octal 8 to YAML 1.2)."""

    text_keys = False
    """:class:`ConfigLoader`: every key of every mapping is text (a name)."""

    class Refused(yaml.constructor.ConstructorError):
        """What this loader refuses (its message names the fix)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:  # the keys written in this mapping (a merge key's `<<: *x` may be overridden)
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                if self.text_keys and key_node.tag != "tag:yaml.org,2002:merge":
                    raise StrictLoader.Refused(
                        None, None, f"the key {getattr(key_node, 'value', key_node)!r} is not text "
                        f"({key_node.tag.rsplit(':', 1)[-1]}): config keys are names", key_node.start_mark)
                continue
            key = key_node.value
            if key in seen:
                raise StrictLoader.Refused(
                    None, None, f"key {key!r} is given twice in one mapping (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}); give it once", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Any) -> int:
        text = self.construct_scalar(node).replace("_", "").lstrip("+-")
        if len(text) > 1 and text[0] == "0" and text[1].isdigit():
            raise StrictLoader.Refused(
                None, None, f"the number {node.value!r} has a leading 0: YAML 1.1 reads it as octal, YAML 1.2 "
                "as decimal; write it without the leading 0", node.start_mark)
        self._not_base_60(node)
        self._no_underscore(node)
        return super().construct_yaml_int(node)

    def construct_yaml_str(self, node: Any) -> str:
        if node.style is None and _DECIMAL_WITH_0.fullmatch(node.value):
            raise StrictLoader.Refused(
                None, None, f"the number {node.value!r} has a leading 0: YAML 1.1 reads it as text, YAML 1.2 as "
                "decimal; write it without the leading 0, or quote the text", node.start_mark)
        if node.style is None and _OCTAL_0O.fullmatch(node.value):
            raise StrictLoader.Refused(
                None, None, f"the number {node.value!r} is octal to YAML 1.2 ({int(node.value, 8)}), text to YAML 1.1; "
                "write the number in decimal, or quote the text", node.start_mark)
        return super().construct_yaml_str(node)

    def construct_yaml_float(self, node: Any) -> float:
        self._not_base_60(node)
        self._no_underscore(node)
        return super().construct_yaml_float(node)

    def _no_underscore(self, node: Any) -> None:
        if "_" in str(node.value):
            raise StrictLoader.Refused(
                None, None, f"the number {node.value!r} holds a '_': YAML 1.1 reads it as "
                f"{node.value.replace('_', '')}, YAML 1.2 as text; write it without the '_', or quote the text",
                node.start_mark)

    def _not_base_60(self, node: Any) -> None:
        if ":" in str(node.value):
            raise StrictLoader.Refused(
                None, None, f"{node.value!r} is a number in base 60 to YAML 1.1 (1:30 is 90), text to YAML 1.2; "
                "write the number, or quote the text", node.start_mark)


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)
StrictLoader.add_constructor("tag:yaml.org,2002:str", StrictLoader.construct_yaml_str)


class ConfigLoader(StrictLoader):
    """:class:`StrictLoader` for a metrics config file, whose keys are all names: ``1: 5``
    is refused with its line."""

    text_keys = True
