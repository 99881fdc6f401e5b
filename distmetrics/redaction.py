"""Keeping secrets out of records: the command line and the config are written to
``metrics.jsonl`` and W&B, so secret values in them are replaced by ``***``.

A name is secret when it names a credential as a word of its own, not when a secret word
merely occurs inside it: ``hf_token``, ``--api-key``, ``client_secret``, ``DB_PASSWORD`` are
secret; ``flops_per_token``, ``num_tokens``, ``tokenizer_model``, ``num_key_value_heads``,
``log_timers_to_tensorboard`` are not, nor are a tokenizer's (``eos_token``) and a name of where a secret is
(``--password-file``). URLs keep their host and path but lose the password of ``user:password@`` (an http(s)
URL its bare user: a token) and the values of secret query parameters, the signatures of pre-signed URLs among
them; in other text, the values of secret ``name=value`` and ``name: value`` pairs (headers, JSON, connection
strings) go too.
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
"""Words that make a name secret as its last word (``hf_token``, ``api_key``, ``--auth``; not ``token_budget``,
``num_key_value_heads`` or ``auth_type``), unless a quantity per token or a tokenizer's token is meant."""
_NOT_SECRET_BEFORE = frozenset({"per", "eos", "bos", "pad", "unk", "sep", "cls", "mask", "special"})
"""Words before a last ``token``/``key`` that make the name ordinary: ``flops_per_token``, ``eos_token``."""
_SECRET_PLURAL = frozenset({("api", "keys"), ("api", "tokens"), ("access", "keys"), ("secret", "keys")})
"""Two last words that name several secrets (``--api-keys``)."""
_WHERE = frozenset({"file", "path", "dir", "env", "var", "name"})
"""Last words of a name that says where a secret is, not the secret (``--password-file``, ``hf_token_path``)."""
_QUERY_SECRET = frozenset({"signature", "sig"})
"""Words that make a URL's query parameter secret besides: the signatures of pre-signed URLs (S3's and GCS's
``X-Amz-Signature``, ``X-Goog-Signature``; an Azure SAS's ``sig``), which grant access until they expire."""
_OPTION_NAME = re.compile(r"[-+~]{0,2}[A-Za-z_][\w.-]*")  # --name, Hydra's +name, ++name, ~name
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<password>[^/\s]*)@")
"""A URL's ``user:password@`` (the password up to the authority's last ``@``, as ``urllib`` splits it)."""
_URL_USER_ONLY = re.compile(r"(?P<scheme>https?://)(?P<user>[^:/@\s]+)@")
"""An http(s) URL's bare ``user@``: a token in a clone URL (``https://ghp_...@github.com``)."""
_QUERY_PARAM = re.compile(r"(?P<sep>[?&#])(?P<name>[^=&#\s]+)=(?P<value>[^&#\s]*)")
_KEY_VALUE = re.compile(r"(?P<q>[\"']?)(?P<name>[A-Za-z_][\w.-]*)(?P=q)(?P<sep>\s*[=:]\s*)"
                        r"(?P<value>(?i:(?:bearer|basic|token)\s+)?(?:\"[^\"]*\"|'[^']*'|[^\s;&,#=\"'}\]]+))")
"""``name=value``, ``name: value`` or JSON's ``"name": "value"`` inside text (a header's ``Authorization: Bearer
...``, a connection string's ``;AccountKey=...``, a JSON argument), the value quoted or up to a separator."""


def is_secret_name(name: str) -> bool:
    """Does this key, flag or parameter name a secret (see the module docstring)?"""
    words = [w.lower() for w in _WORD.findall(str(name))]
    if not words or words[-1] in _WHERE:
        return False
    if any(w in _ALWAYS_SECRET for w in words) or tuple(words[-2:]) in _SECRET_PLURAL:
        return True
    if words[-1] in _SECRET_LAST:
        return not (len(words) >= 2 and words[-2] in _NOT_SECRET_BEFORE)  # flops_per_token, eos_token
    return False


def _secret_query_name(name: str) -> bool:
    """Does this URL query parameter name a secret: a secret name, or a signature (its last word in
    :data:`_QUERY_SECRET`; not ``SignatureVersion`` nor ``sig_level``)?"""
    words = _WORD.findall(name)
    return is_secret_name(name) or bool(words) and words[-1].lower() in _QUERY_SECRET


def _hidden_value(match: re.Match) -> str:
    value = match["value"]
    if not is_secret_name(match["name"]):
        return match[0]
    quote = value[0] if value[:1] in "\"'" and value[:1] else ""
    return f"{match['q']}{match['name']}{match['q']}{match['sep']}{quote}{REDACTED}{quote}"


def redact_text(text: str) -> str:
    """``text`` with URL passwords (and an http(s) URL's bare user), secret query parameter values (signatures
    too) and the values of secret ``name=value`` / ``name: value`` pairs in it replaced by ``***``."""
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    text = _URL_USER_ONLY.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)
    text = _QUERY_PARAM.sub(
        lambda m: f"{m['sep']}{m['name']}={REDACTED if _secret_query_name(m['name']) else m['value']}", text)
    return _KEY_VALUE.sub(_hidden_value, text)


def redact_argv(argv: list) -> list:
    """A command line with the values of secret options (``--hf-token v``, ``--api-key=v``, Hydra's
    ``+hf_token=v``, ``WANDB_API_KEY=v``, ``--env=HF_TOKEN=v``) and the credentials in URLs, headers, JSON and
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
        if option and is_secret_name(name.lstrip("-+~")) and not any(c.isspace() for c in value):
            out.append(f"{name}={REDACTED}")
        elif option and "=" in value and not any(c.isspace() for c in value):  # --env=HF_TOKEN=v, --set=k=v
            out.append(f"{name}={redact_argv([value])[0]}")
        elif arg.startswith("-") and not eq and is_secret_name(arg.lstrip("-")):
            out.append(arg)
            hide_next = True  # the value is the next argument
        else:
            out.append(redact_text(arg))  # 'hf_token=v lr=1' (one argument): each pair on its own
    return out


def redact_mapping(values: Any) -> Any:
    """A copy of a (nested) mapping with secret keys' values and URL credentials hidden."""
    if isinstance(values, dict):
        return {k: (REDACTED if is_secret_name(str(k)) and v is not None and not isinstance(v, dict)
                    else redact_mapping(v)) for k, v in values.items()}
    if isinstance(values, list):
        return [redact_mapping(v) for v in values]
    if isinstance(values, str):
        return redact_text(values)
    return values
