"""Who a console request comes from: the read-only ``console_token`` or a named operator's
token, as a bearer header or the session cookie the login form sets; tokens compared in
constant time and never logged.

The cookie holds an HMAC keyed by the token, never the token itself, so it is the same
check on every replica and a stolen cookie does not reveal the token. An operator's
session cookie also holds a random nonce, and the session's CSRF token is an HMAC of that
nonce: a form is bound to the sign-in that rendered it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie

COOKIE_NAME = "reconciler_console"
COOKIE_ATTRIBUTES = "Path=/; HttpOnly; SameSite=Strict"
_COOKIE_PURPOSE = b"reconciler console session cookie"
_OPERATOR_PURPOSE = b"reconciler console operator session"
_CSRF_PURPOSE = b"reconciler console form"
# Operator names are letters, digits and ``._@-`` (the settings check them): never ``:``.
_SEPARATOR = ":"


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who is reading: a named operator, who may act, or a reader, who may not."""

    operator: str | None = None
    """The operator's name (None: the read-only token, or no token set)."""
    csrf: str = ""
    """The CSRF token of the operator's session ("" for a reader, or a bearer request)."""
    signed_in: bool = False
    """True for a session signed in through the form (the page offers a sign-out)."""
    bearer: bool = False
    """True for a request carrying its token as ``Authorization: Bearer`` (a script's
    read: no session to sign out of, no form it may send)."""

    @property
    def may_act(self) -> bool:
        """True for an operator signed in through the form (whose forms carry ``csrf``)."""
        return self.operator is not None and bool(self.csrf)


class Access:
    """The console's tokens: the read-only one and the operators' (name to token)."""

    __slots__ = ("_operators", "_reader", "_reader_cookie")

    def __init__(self, token: str, operators: Mapping[str, str]) -> None:
        self._reader = token.encode()
        self._reader_cookie = _mac(self._reader, _COOKIE_PURPOSE) if token else ""
        self._operators = {name: value.encode() for name, value in operators.items()}

    @property
    def required(self) -> bool:
        """True when any token is set: every page then needs one."""
        return bool(self._reader or self._operators)

    @property
    def operators(self) -> bool:
        """True when operator tokens are configured (the console can act)."""
        return bool(self._operators)

    def viewer(self, headers: Mapping[str, str]) -> Viewer | None:
        """Who sent a request with these (lower-case) headers; None when a token is
        required and the request carries none that holds."""
        if not self.required:
            return Viewer()
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and given.strip():
            # Scripts read with a bearer token; acting needs a signed-in form (CSRF).
            found = self.identify(given.strip())
            return None if found is None else Viewer(found or None, bearer=True)
        return self._session(_cookie_value(headers.get("cookie", "")))

    def identify(self, given: str) -> str | None:
        """The operator's name ``given`` is the token of, "" for the read-only token, None
        for neither. Every configured token is compared, each in constant time."""
        encoded = given.encode()
        found: str | None = None
        if self._reader and hmac.compare_digest(encoded, self._reader):
            found = ""
        for name, token in self._operators.items():
            if hmac.compare_digest(encoded, token):
                found = name
        return found

    def sign_in(self, given: str) -> str | None:
        """The Set-Cookie value of a new session for the token ``given``, or None."""
        found = self.identify(given)
        if found is None:
            return None
        if not found:
            return f"{COOKIE_NAME}=r{_SEPARATOR}{self._reader_cookie}; {COOKIE_ATTRIBUTES}"
        nonce = secrets.token_hex(16)
        mac = _mac(self._operators[found], _session_message(found, nonce))
        value = _SEPARATOR.join(("o", found, nonce, mac))
        return f"{COOKIE_NAME}={value}; {COOKIE_ATTRIBUTES}"

    @staticmethod
    def sign_out() -> str:
        """The Set-Cookie value that ends a session."""
        return f"{COOKIE_NAME}=; Max-Age=0; {COOKIE_ATTRIBUTES}"

    def _session(self, cookie: str | None) -> Viewer | None:
        if cookie is None:
            return None
        kind, _, rest = cookie.partition(_SEPARATOR)
        if kind == "r":
            ok = bool(self._reader_cookie) and hmac.compare_digest(
                rest.encode(), self._reader_cookie.encode())
            return Viewer(signed_in=True) if ok else None
        name, _, rest = rest.partition(_SEPARATOR)
        nonce, _, mac = rest.partition(_SEPARATOR)
        token = self._operators.get(name)
        if kind != "o" or token is None or not nonce:
            return None
        if not hmac.compare_digest(mac.encode(),
                                   _mac(token, _session_message(name, nonce)).encode()):
            return None
        return Viewer(name, _mac(token, _CSRF_PURPOSE + nonce.encode()), signed_in=True)


def csrf_holds(viewer: Viewer, given: str) -> bool:
    """``given`` is the CSRF token of ``viewer``'s session (constant time)."""
    return viewer.may_act and hmac.compare_digest(given.encode(), viewer.csrf.encode())


def _session_message(name: str, nonce: str) -> bytes:
    return _OPERATOR_PURPOSE + f"|{name}|{nonce}".encode()


def _mac(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _cookie_value(header: str) -> str | None:
    try:
        cookies = SimpleCookie(header)
    except CookieError:
        return None
    morsel = cookies.get(COOKIE_NAME)
    return None if morsel is None else morsel.value
