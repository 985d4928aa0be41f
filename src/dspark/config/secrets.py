"""Credentials are never recorded: the one masking of URLs, config trees, command lines and free text.

What counts as a credential (every rule applies to any value, whatever its key):

- a URL's userinfo: `scheme://user:password@host` → `scheme://user:***@host`; a userinfo without a password (a
  token used as the user name, `https://TOKEN@github.com/...`) → `scheme://***@host`. The password may hold
  unencoded `@`, `/`, `?` or `#` (SQLAlchemy accepts them): the userinfo runs to the `@` before the host;
- the same address without a scheme when a value is one whole address (`user:password@host:5432/db`);
- the value of a query or fragment parameter whose name says secret (`?password=`, `token=`, `api_key=`, `sig=`,
  ...) → `name=***`.

Masking is structural: text without a credential comes back unchanged, so a masked value stays readable. Free text
written by other libraries (an exception quoting a password percent-decoded, a DSN echoed in pieces) is masked too
once the credentials of the command line have been remembered (`remember`): `mask_text` then also replaces every
remembered credential wherever it appears.

Probes need the real credentials: `split_credentials` returns a URL without its userinfo plus the decoded user name
and password (for an `Authorization: Basic` header).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote

MASK = "***"
#: a credential shorter than this is not replaced in free text (it would mangle ordinary words); the structural rules
#: still mask it inside every URL
MIN_REMEMBERED = 4
#: a query / fragment parameter carries a credential when a word of its name is one of these (`access_token`,
#: `X-Amz-Signature`, `sig`) or ends like one (SECRET_ENDINGS), or its name is `key` or ends in one of KEY_WORDS +
#: `key` (`api_key`, `apiKey`, `AccessKey`; not `viewStateShareKey`, a UI link's view)
SECRET_WORDS = frozenset(
    {"password", "passwd", "pwd", "pass", "secret", "token", "auth", "authorization", "credential", "credentials"}
    | {"signature", "sig", "apikey", "sessionid", "session", "cookie"}
)
KEY_WORDS = frozenset({"api", "access", "private", "secret", "account", "master", "shared"})
SECRET_ENDINGS = ("password", "passwd", "secret", "token")  # one word run together: `sslpassword`, `accesstoken`

_SCHEME = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://")
_TOKEN_END = re.compile(r"[\s'\"<>`]")
_USER_THEN_COLON = re.compile(r"[^:/?#@\[\]\s]*:")
_PARAM = re.compile(r"([?&;#])([^=&;#?]*)=([^&;#]*)")  # one query / fragment parameter
_remembered: set[str] = set()


def _first(text: str, chars: str, start: int = 0) -> int:
    """Index of the first of `chars` in `text` from `start` (len(text) if none)."""
    hits = [i for i in (text.find(c, start) for c in chars) if i >= 0]
    return min(hits, default=len(text))


def _userinfo_end(rest: str) -> int:
    """Index of the `@` that ends the userinfo of `rest` (an address after `scheme://`), or -1 when it has none."""
    authority = _first(rest, "/?#")
    at = rest.rfind("@", 0, authority)
    if at >= 0:
        return at
    # `user:pa/ss@host`: a password with an unencoded `/`, `?` or `#`; a `host:port/` before a path is not one
    user = _USER_THEN_COLON.match(rest)
    if user is None or rest[user.end() : authority].isdigit():
        return -1
    at = rest.find("@", authority)
    return -1 if at < 0 else rest.rfind("@", 0, _first(rest, "/?#", at + 1))


def _masked_userinfo(userinfo: str) -> str:
    user, colon, _ = userinfo.partition(":")
    return f"{user}:{MASK}" if colon else MASK


def is_secret_name(name: str) -> bool:
    """Whether a query parameter named `name` carries a credential (`SECRET_WORDS`, `KEY_WORDS`)."""
    words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name).lower())
    words = [w for w in words if w]
    if words == ["key"] or any(w in SECRET_WORDS or w.endswith(SECRET_ENDINGS) for w in words):
        return True
    return len(words) >= 2 and words[-1] == "key" and words[-2] in KEY_WORDS


def _mask_params(tail: str) -> str:
    """`?a=1&token=x#sig=y` with the values of secret-named parameters masked."""

    def one(match: re.Match) -> str:
        lead, name, value = match.groups()
        return f"{lead}{name}={MASK}" if value and is_secret_name(name) else match.group(0)

    return _PARAM.sub(one, tail)


def _mask_address(rest: str, *, need_password: bool = False) -> str:
    """`rest` (an address after `scheme://`) with its userinfo, its secret parameters and any URL nested in its
    path or query masked."""
    at = _userinfo_end(rest)
    head = ""
    if at >= 0 and not (need_password and ":" not in rest[:at]):
        head, rest = f"{_masked_userinfo(rest[:at])}@", rest[at + 1 :]
    cut = _first(rest, "?#")
    body, tail = rest[:cut], _mask_params(rest[cut:])
    return head + _mask_urls(body) + _mask_urls(tail)


def _mask_urls(text: str) -> str:
    """`text` with the credentials of every `scheme://` URL in it masked (a URL ends at a space or a quote)."""
    if "://" not in text:
        return text
    out, last = [], 0
    for match in _SCHEME.finditer(text):
        if match.start() < last:
            continue  # nested in the previous URL: masked with it
        end = _TOKEN_END.search(text, match.end())
        end = end.start() if end else len(text)
        out += [text[last : match.end()], _mask_address(text[match.end() : end])]
        last = end
    return "".join(out) + text[last:]


def mask_url(value: str) -> str:
    """One config value or argument value with its credentials masked (module docstring); anything else unchanged."""
    if not isinstance(value, str) or not value:
        return value
    if _SCHEME.match(value):  # the whole value is one address, spaces and quotes in its password included
        scheme, _, rest = value.partition("://")
        return f"{scheme}://{_mask_address(rest)}"
    if "://" in value:
        return _mask_urls(value)
    return _mask_address(value, need_password=True)  # `user:pw@host`: one whole address without a scheme


def mask_text(text: str) -> str:
    """Free text (a message, a log line, a traceback) with every URL's credentials and every remembered credential
    masked."""
    if not isinstance(text, str) or not text:
        return text
    text = _mask_urls(text)
    for secret in sorted(_remembered, key=len, reverse=True):  # longest first: a credential holding another
        text = text.replace(secret, MASK)
    return text


def mask_arg(arg: str) -> str:
    """A command-line argument: `key=value` with the value masked (`mask_url`), any other word as free text."""
    key, sep, value = arg.partition("=")
    return f"{key}={mask_url(value)}" if sep else mask_text(arg)


def mask_tree(tree: Any) -> Any:
    """A config tree (dicts, lists, scalars) with every string value masked; the input is not modified."""
    if isinstance(tree, dict):
        return {k: mask_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(mask_tree(v) for v in tree)
    return mask_url(tree) if isinstance(tree, str) else tree


def credentials(value: str) -> list[str]:
    """The credentials inside one value (`mask_url`'s rules), as written and percent-decoded."""
    if not isinstance(value, str) or mask_url(value) == value:
        return []
    found = []
    schemed = [value[m.end() :] for m in _SCHEME.finditer(value)]
    for rest in schemed or [value]:
        at = _userinfo_end(rest)
        user, colon, password = rest[: max(at, 0)].partition(":")
        if at >= 0 and (colon or schemed):
            found.append(password if colon else user)
        found += [m.group(3) for m in _PARAM.finditer(rest) if is_secret_name(m.group(2))]
    return sorted({form for secret in found if secret for form in (secret, unquote(secret))})


def remember(values: Iterable[str]) -> None:
    """Remember the credentials inside `values` (command-line arguments or config values), so that `mask_text`
    masks them in any text, in whatever shape another library prints them."""
    for value in values:
        value = value.partition("=")[2] if "=" in value and "://" not in value.partition("=")[0] else value
        _remembered.update(c for c in credentials(value) if len(c) >= MIN_REMEMBERED)


def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """(the URL without its userinfo, user name, password), the names percent-decoded; (url, None, None) when it
    carries none. For probes, which must send the real credentials."""
    scheme, sep, rest = url.partition("://")
    at = _userinfo_end(rest) if sep else -1
    if at < 0:
        return url, None, None
    user, colon, password = rest[:at].partition(":")
    return f"{scheme}://{rest[at + 1 :]}", unquote(user), unquote(password) if colon else None
