"""Keeping secrets out of records: the command line and the config are written to
``metrics.jsonl`` and W&B, so secret values in them are replaced by ``***``.

A name is secret when it names a credential as a word of its own, not when a secret word
merely occurs inside it: ``hf_token``, ``--api-key``, ``client_secret``, ``DB_PASSWORD`` are
secret; ``flops_per_token``, ``num_tokens``, ``tokenizer_model``, ``num_key_value_heads``,
``log_timers_to_tensorboard`` are not. URLs keep their host and path but lose the password of
``user:password@`` and the values of secret query parameters, the signatures of pre-signed URLs among them.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["REDACTED", "is_secret_name", "redact_argv", "redact_text", "redact_mapping"]

REDACTED = "***"

_ALWAYS_SECRET = frozenset({"password", "passwd", "passphrase", "secret", "secrets", "credential",
                            "credentials", "apikey", "api_key"})
"""Words that make a name secret wherever they stand in it."""
_SECRET_LAST = frozenset({"token", "key"})
"""Words that make a name secret as its last word (``hf_token``, ``api_key``; not
``token_budget`` or ``num_key_value_heads``), unless a quantity per token is meant."""
_QUERY_SECRET = frozenset({"signature", "sig"})
"""Words that make a URL's query parameter secret besides: the signatures of pre-signed URLs (S3's and GCS's
``X-Amz-Signature``, ``X-Goog-Signature``; an Azure SAS's ``sig``), which grant access until they expire."""
_OPTION_NAME = re.compile(r"-{0,2}[A-Za-z_][\w.-]*")
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]*)@")
_QUERY_PARAM = re.compile(r"(?P<sep>[?&])(?P<name>[^=&#\s]+)=(?P<value>[^&#\s]*)")


def is_secret_name(name: str) -> bool:
    """Does this key, flag or parameter name a secret (see the module docstring)?"""
    words = [w.lower() for w in _WORD.findall(str(name))]
    if not words:
        return False
    if any(w in _ALWAYS_SECRET for w in words):
        return True
    if words[-1] in _SECRET_LAST:
        return not (len(words) >= 2 and words[-2] == "per")  # flops_per_token is a quantity
    return False


def _secret_query_name(name: str) -> bool:
    """Does this URL query parameter name a secret: a secret name, or a signature (:data:`_QUERY_SECRET`)?"""
    return is_secret_name(name) or any(w.lower() in _QUERY_SECRET for w in _WORD.findall(name))


def redact_text(text: str) -> str:
    """``text`` with URL passwords and secret query parameter values (signatures too) replaced by ``***``."""
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    return _QUERY_PARAM.sub(
        lambda m: f"{m['sep']}{m['name']}={REDACTED if _secret_query_name(m['name']) else m['value']}", text)


def redact_argv(argv: list) -> list:
    """A command line with the values of secret options (``--hf-token v``, ``--api-key=v``,
    ``WANDB_API_KEY=v``) and the credentials in URLs replaced by ``***``."""
    out: list = []
    hide_next = False
    for arg in map(str, argv):
        if hide_next and not arg.startswith("-"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        name, eq, value = arg.partition("=")
        if eq and value and _OPTION_NAME.fullmatch(name) and is_secret_name(name.lstrip("-")):
            out.append(f"{name}={REDACTED}")
        elif arg.startswith("-") and not eq and is_secret_name(arg.lstrip("-")):
            out.append(arg)
            hide_next = True  # the value is the next argument
        else:
            out.append(redact_text(arg))
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
