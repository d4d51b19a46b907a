"""Hiding database passwords: one function for every place a URL or a database error shows.

Errors, log lines, ``/readyz`` bodies and success lines all pass through ``redact``; a
database URL is shown with ``reconciler.storage.engines.display_url``, which parses it and
redacts it too. ``redact`` is textual, so it also covers what no parser understands: a
malformed URL, an ``@`` the user forgot to percent-encode, a libpq ``key=value`` string
quoted back by the driver.
"""

from __future__ import annotations

import re

HIDDEN = "***"

# scheme://user:SECRET@host, also the malformed scheme:/user:SECRET@host. The secret runs
# to the last '@' of the whitespace-delimited token, so an unescaped '@' (or '/', '#') in a
# password is hidden whole instead of leaking its tail as the "host".
_USERINFO = re.compile(
    r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]*:/{1,3}[^\s:/@'\"]*):(?P<secret>[^\s'\"]*)@")
# password=SECRET in a query string (?password=, &password=) or a libpq key=value string,
# quoted ('...') or bare; also sslpassword= and the like.
_KEYWORD = re.compile(
    r"(?P<head>\b[\w]*password\s*=\s*)(?P<secret>'(?:[^'\\]|\\.)*'|[^\s&;'\"]+)",
    re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with every password-looking part replaced by ``***``.

    Covers ``user:password@`` in any URL-like token (malformed ones too, and passwords
    holding an unescaped ``@``), ``?password=`` / ``&password=`` in query strings and
    ``password=...`` in libpq connection strings.
    """
    text = _USERINFO.sub(lambda m: f"{m['head']}:{HIDDEN}@", text)
    return _KEYWORD.sub(_hide_keyword, text)


def _hide_keyword(match: re.Match[str]) -> str:
    # Idempotent: text redacted before ("password=***: ...") keeps what follows the mark.
    secret = match["secret"]
    rest = secret[len(HIDDEN):] if secret.startswith(HIDDEN) else ""
    return f"{match['head']}{HIDDEN}{rest}"
