"""Who an operator action from the command line records: a person, never a service account.

``--as NAME``, else ``RECONCILER_OPERATOR``, else the operating-system user, unless that
user is a service account (the image's own ``reconciler``, or one of ``SERVICE_USERS``, or
a uid with no name): everyone typing through ``kubectl exec`` into the same container
would be recorded as that one account, so the action is refused (exit 2) until a name is
given.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Mapping

from reconciler.errors import ConfigError

OPERATOR_ENV = "RECONCILER_OPERATOR"
"""The environment's name for who acts (``--as`` wins over it)."""

SERVICE_USERS = frozenset({"reconciler", "nobody", "daemon", "www-data"})
"""OS users that name a service, never a person (``reconciler`` is the image's user)."""


def operating_system_user() -> str | None:
    """The operating-system user's name (None: this uid has no name, as a container's
    arbitrary user often has not)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None


def who_acts(flag: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The name the record keeps for an action from the command line (see the module)."""
    for given in (flag, environ.get(OPERATOR_ENV)):
        if given is not None and given.strip():
            return given.strip()
    user = operating_system_user()
    if user is None or user in SERVICE_USERS:
        who = "has no name" if user is None else f"{user!r} is a service account"
        raise ConfigError(f"who acts? the OS user {who}, not a person, and the record "
                          f"keeps who acted: pass --as NAME or set {OPERATOR_ENV}")
    return user
