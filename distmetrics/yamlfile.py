"""YAML files read strictly: what PyYAML would read silently otherwise is a ConfigError.

A key given twice in one mapping (PyYAML keeps the last), a number the two YAML versions read
differently (YAML 1.1, which PyYAML follows, reads ``010`` as octal 8, YAML 1.2 as 10; ``1_000`` as
1000, YAML 1.2 as text) and, in a metrics config, a value YAML reads as something else than it looks
(``None``, text; an anchor on nothing, null) are refused with the line they are on; a file that is
missing, a folder, not UTF-8 or not YAML is named with what it was read as (a metrics config, a
features file). A ``key=value`` override's value is read by :class:`OverrideLoader`, stricter still.
Torch-free.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

import yaml

from .validation import ConfigError

__all__ = ["ConfigLoader", "OverrideLoader", "StrictLoader", "read_yaml"]

_DECIMAL_WITH_0 = re.compile(r"[-+]?0[0-9_]*[89][0-9_]*")  # 08: text to YAML 1.1 (not octal), 8 to YAML 1.2
_OCTAL_0O = re.compile(r"0o[0-7]+")  # 0o10: text to YAML 1.1, 8 to YAML 1.2
_NULL_TAG = "tag:yaml.org,2002:null"
_NULL_WORDS = ("", "~", "null", "Null", "NULL")


def read_yaml(path: Path, what: str = "metrics config file", loader: Optional[type] = None) -> Any:
    """The parsed content of a YAML file (``what`` names it in errors: a metrics config, a
    features file) read by ``loader`` (:class:`StrictLoader` by default); every way it can be
    unreadable is a ConfigError."""
    if path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a folder; give the YAML file")
    if path.exists() and not path.is_file():  # /dev/null, a pipe: a file is meant
        raise ConfigError(f"{what} {str(path)!r} is not a regular file; give the YAML file")
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
    1000; YAML 1.2 as text), a binary ``0b11`` (3 to YAML 1.1, text to YAML 1.2), and a plain ``08`` or
    ``09`` (text to YAML 1.1, not being octal; 8 and 9 to YAML 1.2) or ``0o10`` (text to YAML 1.1; octal 8
    to YAML 1.2). A date is text, as YAML 1.2 reads it (``output_dir: 2024-01-01`` is the folder
    2024-01-01, not a ``datetime.date``)."""

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
        if text[:2].lower() == "0b":
            raise StrictLoader.Refused(
                None, None, f"the number {node.value!r} is binary to YAML 1.1 ({super().construct_yaml_int(node)}), "
                "text to YAML 1.2; write the number in decimal, or quote the text", node.start_mark)
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
StrictLoader.add_constructor("tag:yaml.org,2002:timestamp", StrictLoader.construct_yaml_str)


class ConfigLoader(StrictLoader):
    """:class:`StrictLoader` for a metrics config file, whose keys are all names: ``1: 5`` is refused
    with its line; so are a plain ``None`` (text to YAML: ``wandb_project: None`` would switch W&B on for
    a project named None), an anchor on no value (``wandb_project: &team`` is null: W&B off) and
    ``!!null`` on text (``!!null x`` is null). A features file is read as nvdlfw-inspect reads it, which
    takes these (:class:`StrictLoader`)."""

    text_keys = True

    def compose_scalar_node(self, anchor: Any) -> Any:
        event = self.peek_event()  # the tag as written, which the node no longer tells from a resolved one
        node = super().compose_scalar_node(anchor)
        plain = event.tag is None and event.style is None
        if plain and event.value.lower() == "none":
            raise StrictLoader.Refused(
                None, None, f"{event.value!r} is text to YAML, not null: write null for unset, or quote it "
                f"('{event.value}') for the text", event.start_mark)
        if plain and anchor is not None and not event.value:
            raise StrictLoader.Refused(
                None, None, f"'&{anchor}' is a YAML anchor on no value, which YAML reads as null: quote it "
                f"('&{anchor}') for the text, or write null for unset", event.start_mark)
        if node.tag == _NULL_TAG and event.tag is not None and event.value not in _NULL_WORDS:
            raise StrictLoader.Refused(
                None, None, f"the tag !!null makes {event.value!r} null: leave the tag out for the text, or "
                "write null for unset", event.start_mark)
        return node


class OverrideLoader(ConfigLoader):
    """:class:`ConfigLoader` for the value of one ``key=value`` override, which also refuses a YAML
    comment, anchor, alias and tag: on a command line each reads as something else than it looks.
    ``output_dir=runs/exp #1`` would be 'runs/exp' (``#2``'s job writing into the same folder),
    ``wandb_project=&team`` and ``!!null x`` null (W&B silently off). A comment is refused rather than
    kept as text because the same value in a file is a comment: quoted, the text means one thing in
    both (``output_dir: 'runs/exp #1'``), unquoted it would not."""

    class Quoted(StrictLoader.Refused):
        """Refused where quoting the whole value gives the text that was meant."""

    def scan_to_next_token(self) -> None:
        start = self.pointer
        super().scan_to_next_token()
        skipped = self.buffer[start:self.pointer]  # spaces, line breaks and comments: any '#' starts one
        if "#" in skipped:
            comment = skipped[skipped.index("#"):].splitlines()[0]
            raise OverrideLoader.Quoted(None, None, f"YAML reads {comment!r} as a comment and drops it from the "
                                        "value; a command line means no comment", self.get_mark())

    def fetch_anchor(self) -> None:
        self._refuse("anchor (a name for the value after it; with none after it, null)")

    def fetch_alias(self) -> None:
        self._refuse("alias (the value of an anchor)")

    def fetch_tag(self) -> None:
        self._refuse("tag (it sets what the value after it is read as)")

    def _refuse(self, what: str) -> None:
        word = re.match(r"[^\s\0]*", self.buffer[self.pointer:]).group()
        raise OverrideLoader.Quoted(None, None, f"{word!r} is a YAML {what}; an override takes no anchor, alias "
                                    "or tag", self.get_mark())
