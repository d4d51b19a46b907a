"""The console token: a bearer header or the cookie the login form sets, compared in
constant time. The cookie holds an HMAC of the token, never the token itself, so it is the
same on every replica and a stolen cookie does not reveal the token."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from http.cookies import CookieError, SimpleCookie

COOKIE_NAME = "reconciler_console"
_COOKIE_PURPOSE = b"reconciler console session cookie"


class TokenCheck:
    """Whether a request carries the console token; everyone passes when none is set."""

    __slots__ = ("_cookie", "_token")

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self._cookie = hmac.new(self._token, _COOKIE_PURPOSE, hashlib.sha256).hexdigest() \
            if token else ""

    @property
    def required(self) -> bool:
        """True when a token is set."""
        return bool(self._token)

    def allows(self, headers: Mapping[str, str]) -> bool:
        """True when no token is set, or the request carries it (header or cookie)."""
        if not self.required:
            return True
        authorization = headers.get("authorization", "")
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() == "bearer" and self.matches(given.strip()):
            return True
        cookie = _cookie_value(headers.get("cookie", ""))
        return cookie is not None and hmac.compare_digest(cookie.encode(),
                                                          self._cookie.encode())

    def matches(self, given: str) -> bool:
        """``given`` is the token (constant time)."""
        return bool(self._token) and hmac.compare_digest(given.encode(), self._token)

    def set_cookie(self) -> str:
        """The Set-Cookie value the login form answers with."""
        return f"{COOKIE_NAME}={self._cookie}; Path=/; HttpOnly; SameSite=Strict"


def _cookie_value(header: str) -> str | None:
    try:
        cookies = SimpleCookie(header)
    except CookieError:
        return None
    morsel = cookies.get(COOKIE_NAME)
    return None if morsel is None else morsel.value
