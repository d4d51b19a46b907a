"""The console's sessions (issue 27): who a cookie or bearer header says, and what a
tampered, foreign or rotated one gets: nothing."""

from __future__ import annotations

from reconciler.console.auth import Access, Viewer, csrf_holds

READER = "reader-token-0123456789"
ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789abc"


def _cookie(set_cookie: str | None) -> dict[str, str]:
    assert set_cookie is not None
    return {"cookie": set_cookie.split(";")[0]}


def test_each_token_signs_in_as_its_name_and_the_reader_as_no_one() -> None:
    """An operator's session names them and carries a CSRF token; the reader's neither."""
    access = Access(READER, {"alice": ALICE, "bob": BOB})
    alice = access.viewer(_cookie(access.sign_in(ALICE)))
    reader = access.viewer(_cookie(access.sign_in(READER)))
    assert alice is not None
    assert (alice.operator, alice.may_act) == ("alice", True)
    assert reader == Viewer(signed_in=True)
    assert not reader.may_act
    assert access.sign_in("nobody-0123456789") is None
    assert access.viewer({}) is None


def test_a_tampered_or_rotated_session_is_nobody() -> None:
    """Another name, another nonce, another MAC, or the operator's token changed since:
    no session. A bearer operator token reads but carries no CSRF token, so never acts."""
    access = Access(READER, {"alice": ALICE, "bob": BOB})
    cookie = _cookie(access.sign_in(ALICE))["cookie"]
    kind_name_nonce, mac = cookie.rsplit(":", 1)
    for forged in (cookie.replace("alice", "bob"), f"{kind_name_nonce}:{'0' * len(mac)}",
                   cookie.replace("=o:", "=r:"), "reconciler_console=r:" + mac):
        assert access.viewer({"cookie": forged}) is None, forged
    rotated = Access(READER, {"alice": "alice-new-token-0123456789"})
    assert rotated.viewer({"cookie": cookie}) is None
    bearer = access.viewer({"authorization": f"Bearer {ALICE}"})
    assert bearer is not None
    assert (bearer.operator, bearer.may_act) == ("alice", False)
    assert not csrf_holds(bearer, "")


def test_the_csrf_token_is_bound_to_the_session() -> None:
    """Two sign-ins of one operator: each session's forms carry their own token."""
    access = Access("", {"alice": ALICE})
    first = access.viewer(_cookie(access.sign_in(ALICE)))
    second = access.viewer(_cookie(access.sign_in(ALICE)))
    assert first is not None
    assert second is not None
    assert csrf_holds(first, first.csrf)
    assert not csrf_holds(first, second.csrf)
    assert not csrf_holds(first, "")


def test_without_tokens_everyone_reads_and_nobody_acts() -> None:
    """No token configured: no sign-in needed, no action offered."""
    access = Access("", {})
    assert not access.required
    assert access.viewer({}) == Viewer()
    assert not Viewer().may_act
