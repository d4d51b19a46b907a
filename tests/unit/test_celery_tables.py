"""The celery source's result tables: which shape a table name picks, and which stored
arguments read back as the call's own (the rest make a task unresumable)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from celery.utils.saferepr import saferepr

from reconciler.sources.celery.tables import (
    CELERY_TASKMETA,
    DJANGO_CELERY_RESULTS,
    call_arguments,
    queue_for,
    shape_for,
)


def stored_repr(value: Any) -> str:
    """``task_args`` as django-celery-results stores it: the JSON of Celery's argsrepr."""
    return json.dumps(saferepr(value, 1024))


def test_a_table_name_picks_its_shape() -> None:
    """django-celery-results' fixed name; any other is Celery's own, however renamed."""
    assert shape_for("django_celery_results_taskresult") is DJANGO_CELERY_RESULTS
    assert shape_for("celery_taskmeta") is CELERY_TASKMETA
    assert shape_for("myapp_taskmeta") is CELERY_TASKMETA


def test_celery_taskmeta_holds_the_arguments_themselves() -> None:
    assert call_arguments(b'[1, "a"]', b'{"k": null}', CELERY_TASKMETA) == ([1, "a"],
                                                                          {"k": None})
    assert call_arguments(None, None, CELERY_TASKMETA) == ([], {})


@pytest.mark.parametrize(("args", "kwargs"), [
    ((1, "two", {"3": [4.5, None, True]}), {"note": "é 'quoted'", "n": -0.5}),
    ([], {}),
    (("it's",), {"deep": [[1]]}),
])
def test_a_whole_repr_reads_back_as_the_call(args: Any, kwargs: Any) -> None:
    found = call_arguments(stored_repr(args), stored_repr(kwargs), DJANGO_CELERY_RESULTS)
    assert found == (list(args), kwargs)


@pytest.mark.parametrize("args", [
    ("x" * 2000,),                  # cut past argsrepr_maxsize
    (list(range(400)),),            # cut inside a list
    ({"a": {"b": {"c": 1}}},),      # cut past saferepr's depth (as '{...}')
    ("C:\\new\\table",),            # saferepr writes backslashes unescaped
    ("line\nbreak",),               # and control characters raw
    ({1, 2},),                      # a set: JSON cannot carry it
    (b"bytes",),
])
def test_arguments_the_table_does_not_hold_faithfully_are_none(args: Any) -> None:
    assert call_arguments(stored_repr(args), stored_repr({}), DJANGO_CELERY_RESULTS) is None


def test_a_custom_repr_that_is_not_python_is_none() -> None:
    """A caller's own ``argsrepr`` (secrets hidden) is not the call."""
    assert call_arguments(json.dumps("(<hidden>,)"), json.dumps("{}"),
                          DJANGO_CELERY_RESULTS) is None


def test_routes_are_the_first_matching_glob_else_the_default() -> None:
    routes = {"billing.refund": "slow", "billing.*": "billing"}
    assert queue_for("billing.refund", routes, "celery") == "slow"
    assert queue_for("billing.charge", routes, "celery") == "billing"
    assert queue_for("media.cut", routes, "celery") == "celery"
