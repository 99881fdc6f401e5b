"""Keeping secrets out of records: the command line and the config are written to
``metrics.jsonl`` and W&B, so secret values in them are replaced by ``***``.

A name is secret when it names a credential as a word of its own, not when a secret word
merely occurs inside it: ``hf_token``, ``--api-key``, ``client_secret``, ``DB_PASSWORD`` are
secret; ``flops_per_token``, ``num_tokens``, ``tokenizer_model``, ``num_key_value_heads``,
``log_timers_to_tensorboard`` are not, nor are a tokenizer's (``eos_token``) and a name of where a secret is
(``--password-file``). URLs keep their host and path but lose the password of ``user:password@`` (an http(s)
URL its bare user: a token) and the values of secret query parameters, the signatures of pre-signed URLs among
them; in other text, credential headers, secret JSON (or Python dict) members, a connection string's secret
pairs, and the secret options among the words of a command held in one argument go too.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["REDACTED", "is_secret_name", "redact_argv", "redact_text", "redact_mapping"]

REDACTED = "***"

_ALWAYS_SECRET = frozenset({"password", "passwd", "passphrase", "secret", "secrets", "credential",
                            "credentials", "apikey", "authorization"})
"""Words that make a name secret wherever they stand in it (but before :data:`_WHERE`)."""
_SECRET_LAST = frozenset({"token", "key", "auth", "pwd", "authtoken", "accesstoken", "apitoken", "hftoken",
                          "sessiontoken", "secretkey", "accesskey", "privatekey"})
"""Words that make a name secret as its last word (``hf_token``, ``api_key``, ``--auth``, ``MYSQL_PWD``; not
``token_budget``, ``num_key_value_heads`` or ``auth_type``), unless a quantity or a tokenizer's token is meant
(:data:`_ORDINARY_BEFORE`)."""
_QUANTITIES = frozenset({"per", "max", "min", "num", "total"})
_ORDINARY_BEFORE = {
    "token": _QUANTITIES | {  # a tokenizer's tokens: eos_token, image_token, mm_use_im_patch_token
        "eos", "bos", "pad", "unk", "sep", "cls", "mask", "special", "eot", "eod", "boi", "eoi", "image", "video",
        "audio", "stop", "start", "end", "begin", "think", "tool", "chat", "placeholder", "additional", "patch",
        "assistant"},
    "key": _QUANTITIES | {  # a dataset's or a dict's fields (verl's and OpenRLHF's prompt_key), a generator's key
        "text", "sort", "dataset", "prompt", "chosen", "rejected", "input", "output", "label", "context", "response",
        "caption", "instruction", "metric", "checkpoint", "answer", "question", "reward", "target", "source",
        "group", "length", "rng", "seed", "kv", "cache", "lang", "value", "image", "video", "audio"}}
"""Words before a last ``token`` or ``key`` that make the name ordinary (not ``user_token``, ``primary_key``,
``query_key``: Slack's, Azure's secrets)."""
_SECRET_PLURAL = frozenset({("api", "keys"), ("api", "tokens"), ("access", "keys"), ("secret", "keys")})
"""Two last words that name several secrets (``--api-keys``)."""
_WHERE = frozenset({"file", "path", "dir", "env", "var", "name", "version", "type", "size", "length", "len",
                    "count", "mode", "format", "id", "ids", "enabled"})
"""Last words of a name that says where a secret is or what kind, not the secret (``--password-file``,
``hf_token_path``, ``auth_type``, ``secret_sauce_version``)."""
_QUERY_SECRET = frozenset({"signature", "sig"})
"""Words that make a URL's query parameter secret besides: the signatures of pre-signed URLs (S3's and GCS's
``X-Amz-Signature``, ``X-Goog-Signature``; an Azure SAS's ``sig``), which grant access until they expire."""
_OPTION_NAME = re.compile(r"[-+~]{0,2}[A-Za-z_][\w.-]*")  # --name, Hydra's +name, ++name, ~name
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_URL_USERINFO = re.compile(r"(?P<scheme>(?<![a-zA-Z0-9+.-])[a-zA-Z][a-zA-Z0-9+.-]*://)"
                           r"(?P<user>[^:/@\s]*):(?P<password>[^/\s]*)@")
"""A URL's ``user:password@`` (the password up to the authority's last ``@``, as ``urllib`` splits it)."""
_URL_USER_ONLY = re.compile(r"(?P<scheme>(?<![a-zA-Z0-9+.-])(?:[a-zA-Z][a-zA-Z0-9.-]*\+)?(?i:https?)://)"
                            r"(?P<user>[^:/@\s]+)@")
"""An http(s) URL's bare ``user@``: a token in a clone URL (``https://ghp_...@github.com``)."""
_QUERY_PARAM = re.compile(r"(?P<sep>[?&#])(?P<name>[^=&#?\s]+)=(?P<value>[^&#\s]*)")
_HEADER = re.compile(r"(?i)(?<![\w?&#-])(?P<name>(?:proxy-)?authorization|(?:x-)?(?:goog-)?api-key|"
                     r"x-(?:auth|access|api)-token|private-token|cookie)(?P<sep>\s*:\s*)(?P<value>[^\"'\n]+)")
"""An HTTP header that carries a credential, its value to the end of the text or a quote (``Authorization: Bearer
...``, an AWS signature's ``Credential=..., Signature=...``)."""
_DICT_PAIR = re.compile(r'(?P<q>["\'])(?P<name>[^"\'\\\n]{1,200})(?P=q)(?P<sep>\s*:\s*)'
                        r'(?P<value>"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|[\[{]|[^\s,}\]\[{]+)')
"""A JSON (or Python dict) member ``"name": value`` in text: a string (escapes read), the start of a list or
object (its end found apart, by depth; a non-secret one's members are read on their own), or a bare value."""
_SEMICOLON_PAIR = re.compile(r"(?:^|(?<=;))(?P<name>\s*[A-Za-z_][\w.-]{0,100})=(?P<value>[^;]*)")
"""A connection string's ``name=value`` between ``;`` (Azure's ``...;AccountKey=...;``, SQL Server's
``...;Password=...;``)."""
_CONNECTION_STRING = re.compile(r"\s*(?:[A-Z][\w.-]{0,50} [A-Z][\w.-]{0,50}|[A-Za-z_][\w.-]{0,100})=[^;]*;")
"""How a connection string starts: a ``name=value;`` (``Server=...;``, ``Data Source=...;``, ``Host=db; Port=5432``),
not a command (``export NCCL_DEBUG=INFO; ...``)."""
_WORDS = re.compile(r"""(?:"(?:[^"\\]++|\\.)*+"|'[^']*+'|\\.|[^\s"'\\]++|["'\\])+""")
"""The words of a command held in one argument, a closed quote within a word (``--password "a b c"``); a quote
never closed (an apostrophe) is a character of its word."""
_QUOTE = re.compile(r"[\"']")
_QUOTED_REST = {'"': re.compile(r'(?:[^"\\]++|\\.)*+"'), "'": re.compile(r"[^']*+'")}
"""The rest of a quoted part, to its closing quote (possessive: one pass however it ends)."""
_NESTING = 8
"""How deep ``--env=KEY=value`` and words inside words are read (a chain of ``=`` a thousand long is text)."""


def is_secret_name(name: str) -> bool:
    """Does this key, flag or parameter name a secret (see the module docstring)?"""
    words = [w.lower() for w in _WORD.findall(str(name))]
    if not words or words[-1] in _WHERE:
        return False
    if any(w in _ALWAYS_SECRET for w in words) or tuple(words[-2:]) in _SECRET_PLURAL:
        return True
    if words[-1] in _SECRET_LAST:  # flops_per_token, eos_token, prompt_key; the working directory's PWD
        ordinary = len(words) >= 2 and words[-2] in _ORDINARY_BEFORE.get(words[-1], ())
        return not ordinary and str(name).strip("-+~") != "PWD"
    return False


def _secret_query_name(name: str) -> bool:
    """Does this URL query parameter name a secret: a secret name, or a signature (its last word in
    :data:`_QUERY_SECRET`; not ``SignatureVersion`` nor ``sig_level``)?"""
    words = _WORD.findall(name)
    return is_secret_name(name) or bool(words) and words[-1].lower() in _QUERY_SECRET


def redact_text(text: str) -> str:
    """``text`` with URL passwords (and an http(s) URL's bare user), secret query parameter values (signatures
    too), the values of credential headers, of secret JSON members and of a connection string's secret pairs
    replaced by ``***``."""
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    text = _URL_USER_ONLY.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)
    text = _QUERY_PARAM.sub(
        lambda m: f"{m['sep']}{m['name']}={REDACTED if _secret_query_name(m['name']) else m['value']}", text)
    text = _HEADER.sub(lambda m: f"{m['name']}{m['sep']}{REDACTED}", text)
    if '"' in text or "'" in text:
        text = _dict_members(text)
    if ";" in text and "=" in text and _CONNECTION_STRING.match(text) and " -" not in text:
        text = _SEMICOLON_PAIR.sub(lambda m: f"{m['name']}={REDACTED if is_secret_name(m['name']) else m['value']}",
                                   text)
    return text


def _dict_members(text: str) -> str:
    """``text`` with the values of its secret JSON or Python dict members hidden: a string or bare value, or a
    list to its closing bracket (one pass: a search for it that fails hides the rest)."""
    out, at = [], 0
    for m in _DICT_PAIR.finditer(text):
        if m.start() < at or not is_secret_name(m["name"]):
            continue
        value = m["value"]
        end = m.end()
        if value in "[{":
            end = _closing(text, m.start("value"))
            hidden = REDACTED
        else:
            hidden = f"{value[0]}{REDACTED}{value[0]}" if value[0] in "\"'" else REDACTED
        out += [text[at:m.start("value")], hidden]
        at = end
    return "".join(out) + text[at:] if out else text


def _closing(text: str, start: int) -> int:
    """Where the list or object opening at ``start`` ends (past its closing bracket, counted by depth, strings
    skipped), or the end of ``text`` where it never closes."""
    depth, at, n = 0, start, len(text)
    while at < n:
        c = text[at]
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return at + 1
        elif c in "\"'":
            close = at + 1
            while close < n and text[close] != c:
                close += 2 if text[close] == "\\" else 1
            at = close
        at += 1
    return n


def redact_argv(argv: list, _depth: int = 0) -> list:
    """A command line with the values of secret options (``--hf-token v``, ``--api-key=v``, Hydra's
    ``+hf_token=v``, ``WANDB_API_KEY=v``, ``--env=HF_TOKEN=v``; the words of an argument holding a command,
    ``bash -c "env HF_TOKEN=v torchrun ... --hf-token v"``, alike) and the credentials in URLs, headers, JSON and
    connection strings replaced by ``***``."""
    out: list = []
    hide_next = False
    for arg in map(str, argv):
        if hide_next and not arg.startswith("-"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        name, eq, value = arg.partition("=")
        option = bool(eq and value and _OPTION_NAME.fullmatch(name))
        if option and is_secret_name(name.lstrip("-+~")):
            out.append(f"{name}={REDACTED}")  # the whole value, spaces and all
        elif option and "=" in value and _depth < _NESTING:  # --env=HF_TOKEN=v, --set=k=v; a connection string
            name, _, value = redact_text(arg).partition("=")  # whole (ENV=HF_TOKEN=v;KEY=v)
            out.append(f"{name}={redact_argv([value], _depth + 1)[0]}")
        elif arg.startswith("-") and not eq and is_secret_name(arg.lstrip("-")):
            out.append(arg)
            hide_next = True  # the value is the next argument
        else:
            out.append(_command(arg, _depth))
    return out


def _command(text: str, depth: int) -> str:
    """An argument that is no option of its own: its text read (:func:`redact_text`); holding spaces, a command
    (``bash -c``'s), its quoted parts holding spaces commands of their own and its words an argv; else a list of
    ``k=v`` after commas (sbatch's ``--export=ALL,HF_TOKEN=v``, ``k=v,token=v``)."""
    text = redact_text(text)
    if depth < _NESTING and any(c.isspace() for c in text):
        text = _requoted(text, depth + 1)
        words = list(_WORDS.finditer(text))
        if len(words) > 1:
            text = _rejoin(text, words, redact_argv([w[0] for w in words], depth + 1))
    elif depth < _NESTING and "," in text and "=" in text:
        text = ",".join(redact_argv(text.split(","), depth + 1))
    return text


def _requoted(text: str, depth: int) -> str:
    """``text`` with each quoted part holding a space read as a command (:func:`_command`), in one pass: a quote
    that never closes is a character, and so is every later one like it."""
    out, at, search, unclosed = [], 0, 0, set()
    while (found := _QUOTE.search(text, search)) is not None:
        quote, start = found[0], found.start()
        rest = None if quote in unclosed else _QUOTED_REST[quote].match(text, start + 1)
        if rest is None:
            unclosed.add(quote)
            search = start + 1
            continue
        inner = text[start + 1:rest.end() - 1]
        if any(c.isspace() for c in inner):
            out += [text[at:start + 1], _command(inner, depth)]
            at = rest.end() - 1  # the closing quote on
        search = rest.end()
    return "".join(out) + text[at:] if out else text


def _rejoin(text: str, words: list, said: list) -> str:
    """``text`` with its ``words`` (matches) replaced by ``said``, the spaces between kept."""
    out, at = [], 0
    for word, new in zip(words, said):
        out += [text[at:word.start()], new]
        at = word.end()
    return "".join(out) + text[at:]


def redact_mapping(values: Any) -> Any:
    """A copy of a (nested) mapping with secret keys' values and URL credentials hidden."""
    if isinstance(values, dict):
        return {k: (REDACTED if is_secret_name(str(k)) and v is not None else redact_mapping(v))
                for k, v in values.items()}
    if isinstance(values, (list, tuple, set, frozenset)):
        return [redact_mapping(v) for v in values]
    if isinstance(values, str):
        return redact_text(values)
    return values
