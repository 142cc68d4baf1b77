"""The one redaction for everything raytrain writes or prints: MLflow params and tags, the
``spec.yaml`` artifact, the run-state file, error messages and printed URIs.

Two kinds of rule, one table each:

* a *name* that holds a credential (a spec field, a query parameter, a connection-string
  part, an environment variable): ``password``, ``secret_key``, ``hf_token``, ``api_key``,
  ``AZURE_STORAGE_CONNECTION_STRING``, ... Its value is masked whatever it is;
* a *value* shaped like one, whatever its name: a URI's user info (``https://user:pass@``),
  a credential-carrying query parameter (``?sig=``, ``X-Amz-Signature=``, ``token=``), a
  PEM private key, a cloud or hub token (``AKIA...``, ``hf_...``, ``ghp_...``, a JWT).
  Only the credential is masked; the rest (the host, the path) stays readable.

A masked field keeps its name, so a record still says which field held a credential.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***"

# Words (a name split at _ - . and camelCase, lower-cased) that make a name a credential's.
_SECRET_WORDS = frozenset(
    {
        "password",
        "passwords",
        "passwd",
        "passphrase",
        "secret",
        "secrets",
        "credential",
        "credentials",
        "sas",
        "apikey",
        "apikeys",
        "dsn",
        "pwd",
    }
)
# "...key" names that hold one (``secret_key``, ``AZURE_STORAGE_ACCOUNT_KEY``), not every key.
_KEY_QUALIFIERS = frozenset(
    {
        "secret",
        "private",
        "api",
        "access",
        "account",
        "storage",
        "signing",
        "encryption",
        "master",
        "auth",
        "client",
        "sas",
        "shared",
        "ssh",
        "gpg",
        "pgp",
        "service",
        "license",
        "subscription",
    }
)
# "...token" names that do not hold one: a tokenizer's special tokens and token counts.
_TOKEN_NOT_SECRET = frozenset(
    {
        "pad",
        "eos",
        "bos",
        "unk",
        "mask",
        "sep",
        "cls",
        "special",
        "max",
        "min",
        "num",
        "n",
        "start",
        "end",
        "first",
        "last",
        "stop",
    }
)
# Query parameters that carry a credential in a URL even though their name alone would not
# say so: Azure SAS ``sig``, S3/GCS presigned URLs, an API ``key``, an OAuth ``code``.
_QUERY_SECRETS = frozenset(
    {
        "sig",
        "signature",
        "key",
        "code",
        "x-amz-credential",
        "x-amz-signature",
        "x-amz-security-token",
        "x-goog-credential",
        "x-goog-signature",
        "awsaccesskeyid",
        "access_token",
        "token",
        "auth",
        "authorization",
        "pass",
        "pw",
    }
)

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
# Parts that make a name a credential's even run together in one word (``accesstoken``,
# ``privatekey``, ``clientsecret``, ``hftoken``); a lone ``token`` or ``key`` does not.
_RUN_TOGETHER = re.compile(
    r"passw|secret|credential|(?:api|access|private|account|auth|signing|encryption|ssh)key"
    r"|(?:access|auth|api|bearer|refresh|session|hf|github|gh|id|oauth|personal)token"
)


def _words(name: str) -> list[str]:
    """``name``'s words, lower case: ``hfToken`` and ``HF_TOKEN`` are both [hf, token]."""
    return [w.lower() for w in _WORD.findall(name)]


def is_secret_name(name: str) -> bool:
    """Whether a field, parameter or variable called ``name`` holds a credential. For a
    dotted spec path only the last part counts (``model.init_args.hf_token``)."""
    last = name.rsplit(".", 1)[-1]
    words = _words(last)
    if not words:
        return False
    if _SECRET_WORDS.intersection(words):
        return True
    if any(_RUN_TOGETHER.search(w) for w in words):  # accesstoken, privatekey, clientsecret
        return True
    if "connection" in words and "string" in words:  # AZURE_STORAGE_CONNECTION_STRING
        return True
    if "service" in words and "account" in words:  # GOOGLE_SERVICE_ACCOUNT_JSON
        return True
    if words[-2:] in (["database", "url"], ["db", "url"]):  # DATABASE_URL holds user:pass
        return True
    if any(
        w in ("key", "keys") and i and words[i - 1] in _KEY_QUALIFIERS for i, w in enumerate(words)
    ):
        return True  # secret_key, AZURE_STORAGE_ACCOUNT_KEY, AWS_ACCESS_KEY_ID
    if words[-1] in ("token", "auth"):
        return len(words) == 1 or words[-2] not in _TOKEN_NOT_SECRET
    return False


# Environment names run words together (``DBPASSWORD``): these parts count anywhere in one.
_SECRET_ENV_PARTS = re.compile(
    r"PASSWORD|PASSWD|SECRET|CREDENTIAL|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|ACCOUNT_?KEY|"
    r"SERVICE_?ACCOUNT|CONNECTION_?STRING|AUTH_?TOKEN"
    r"|(?:^|_)PASS(?:$|_)|(?:^|_)PW$|_KEY$",  # DB_PASS, SMTP_PASS, KAGGLE_KEY
    re.IGNORECASE,
)


def is_secret_env(name: str, value: str = "") -> bool:
    """Whether the environment variable ``name=value`` carries a credential: by its name
    (``AZURE_STORAGE_KEY``, ``DBPASSWORD``) or by its value (``MLFLOW_TRACKING_URI`` with
    user info, a URL with ``?sig=``, a token's shape)."""
    return bool(is_secret_name(name) or _SECRET_ENV_PARTS.search(name) or redact(value) != value)


# A URI's user info: from ``://`` to the LAST ``@`` before the host (``user:p@ss@host``), or a
# ``user:password@`` whose password holds a ``/`` (not a ``host:port/`` path).
# Every repeat is bounded: a long hostile message must not take quadratic time.
_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][\w+.-]{0,31})://"
    r"(?P<info>[^\s/?#]{0,2048}@|[^\s/?#@:]{1,256}:(?!\d{0,5}(?:[/?#\s]|$))[^\s@]{0,256}@)"
)
# Azure's ``abfs://container@account...``: that user info is a container, not a credential.
_CONTAINER_SCHEMES = frozenset({"abfs", "abfss", "wasb", "wasbs"})
# ``name=value`` in a query string, a connection string or a command line; of a dotted name
# (``model.init_args.password=``) the last part.
_ASSIGNMENT = re.compile(
    r"(?P<lead>^|[?&;\s,'\"(.-])(?P<name>[A-Za-z][\w-]{0,63})=(?P<value>[^&;#\s,'\")]*)"
)
# Values that are credentials by their shape.
_SHAPES = re.compile(
    r"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]{0,40}PRIVATE KEY-----|\Z)"
    r"|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"  # AWS access key id
    r"|\bgh[pousr]_[A-Za-z0-9]{30,}|\bgithub_pat_\w{20,}"  # GitHub
    r"|\bhf_[A-Za-z0-9]{30,}"  # Hugging Face
    r"|\bxox[abposr]-[A-Za-z0-9-]{10,}"  # Slack
    r"|\bsk-[\w-]{0,40}?[A-Za-z0-9]{20,}"  # OpenAI-style secret keys
    r"|\bAIza[0-9A-Za-z_-]{35}"  # Google API key
    r"|\beyJ[\w-]{8,512}\.eyJ[\w-]{8,8192}\.[\w-]{8,}",  # a JWT
    re.DOTALL,
)


# A credential-carrying header in a message: ``Authorization: Basic dXNlcjpw``, a lower-case
# ``bearer``, ``X-Api-Key: ...``; the header's name and scheme stay.
_HEADER = re.compile(
    r"(?i)(?P<keep>\b(?:authorization|proxy-authorization|x-api-key|api-key|cookie)\b['\"]?"
    r"\s{0,4}[:=]\s{0,4}['\"]?(?:(?:basic|bearer|token|digest)\s{1,4})?|\bbearer\s{1,4})"
    r"(?P<value>(?!\*\*\*|(?:basic|bearer|token|digest)\s)[^\s'\",;]{1,4096})"
)
# ``'password': 'x'`` and ``"password": "x"`` (a dict's repr in a message, JSON): masked
# when the name holds a credential. (A bare ``name: value`` is left alone: error messages
# are ``field: problem``.)
_KEYED = re.compile(
    r"(?P<lead>(?P<q>['\"])(?P<name>[A-Za-z][\w.-]{0,63})(?P=q)\s{0,4}:\s{0,4})"
    r"(?P<value>(?P<vq>['\"])[^'\"\n]{0,4096}(?P=vq)|[^\s,}\]'\"]{1,4096})"
)
# ``user:password@host`` without a scheme (a bucket name an SDK quotes back): the part
# before ``@`` has a colon and no separator. It starts only after a quote, a space or a
# bracket, which its first part cannot hold: linear time on any text.
_BARE_USERINFO = re.compile(
    r"(?:(?<=[\s'\"(\[=,])|^)[^\s/?#@:'\"(\[=,]{1,256}:[^\s/?#@'\"]{1,256}@(?=[\w.\[-])"
)


def _header(match: re.Match[str]) -> str:
    return f"{match['keep']}{REDACTED}"


def _keyed(match: re.Match[str]) -> str:
    name, value = match["name"], match["value"]
    if not is_secret_name(name) or value.strip("'\"") in ("", REDACTED):
        return match[0]
    quote = match["vq"] or ""
    return f"{match['lead']}{quote}{REDACTED}{quote}"


def _userinfo(match: re.Match[str]) -> str:
    scheme, info = match["scheme"], match["info"]
    if scheme.lower() in _CONTAINER_SCHEMES and ":" not in info:
        return match[0]
    return f"{scheme}://{REDACTED}@"


def _assignment(match: re.Match[str]) -> str:
    name, lead = match["name"], match["lead"]
    query = lead in ("?", "&") and name.lower() in _QUERY_SECRETS
    if (query or is_secret_name(name)) and match["value"]:
        return f"{lead}{name}={REDACTED}"
    return match[0]


def redact(text: str) -> str:
    """``text`` with every credential in it masked (see the module docstring): what may be
    shown, logged or written."""
    if not text:
        return text
    text = _SHAPES.sub(REDACTED, text)
    text = _HEADER.sub(_header, text)
    text = _USERINFO.sub(_userinfo, text)
    text = _BARE_USERINFO.sub(f"{REDACTED}@", text)
    text = _KEYED.sub(_keyed, text)
    return _ASSIGNMENT.sub(_assignment, text)


def redact_value(name: str, value: Any) -> Any:
    """``value`` of the field ``name`` as it may be written: masked whole when the name holds
    a credential, else with any credential inside it masked; numbers and booleans of other
    fields stay as they are, lists and mappings are redacted item by item."""
    if value is None or value == "" or value == [] or value == {}:
        return value
    if is_secret_name(name):
        return REDACTED
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return redact_tree(value)
    if isinstance(value, list | tuple):
        return [redact_value(name, item) for item in value]
    return value


def redact_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A nested mapping (a spec as YAML would hold it) with its credentials masked."""
    return {key: redact_value(str(key), value) for key, value in tree.items()}


def redact_flat(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A flattened spec (``{"a.b.c": value}``) with its credentials masked."""
    return {key: redact_value(key, value) for key, value in flat.items()}


def masked_fields(flat: Mapping[str, Any]) -> list[str]:
    """The fields of a flattened spec whose value redaction changes: what a record names
    as masked."""
    return sorted(key for key, value in flat.items() if redact_value(key, value) != value)
