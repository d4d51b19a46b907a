"""A job's kind, its function's name, read from its ``data`` without running it.

RQ stores ``(func_name, instance, args, kwargs)`` in the job hash's ``data`` field, in
the app's serializer and zlib-compressed (``Job.to_dict``; an uncompressed one is read
too, as ``Job.restore`` does). Loading a pickle runs whatever it names, so a pickle is
walked opcode by opcode (``pickletools.genops``, which builds nothing) up to the first
string it pushes, the function's name; a JSON one is parsed (JSON builds no objects).
Anything else (not a string first, a truncated or foreign payload) is unreadable: the
job is then a ``reconcile_error`` (``unreadable_kind``), never judged by a guessed name.
"""

from __future__ import annotations

import json
import pickletools
import zlib

UNREADABLE_KIND = "unreadable_kind"
"""The ``error_code`` of a job whose function name cannot be read so."""
UNREADABLE_LABEL = "<unreadable>"
"""The kind such a job is listed under (no Python function is named so)."""

_STRINGS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE",
                      "SHORT_BINSTRING", "BINSTRING", "STRING"})
_FRAMING = frozenset({"PROTO", "FRAME"})
# The tuple's start where the pickler writes one before its items (protocol 0 and 1), and
# the memo's bookkeeping between values.
_SKIPPED = frozenset({"MARK", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"})


def func_name(data: bytes | None, serializer: str) -> str | None:
    """The job's function name (None: it cannot be read without running the payload)."""
    if not data:
        return None
    try:
        raw = zlib.decompress(data)
    except zlib.error:
        raw = data
    name = _from_pickle(raw) if serializer == "pickle" else _from_json(raw)
    if name is None or not name or len(name) > 255 or not name.isprintable():
        return None
    return name


def _from_pickle(raw: bytes) -> str | None:
    """The first string pushed, unless it is a global's module (``STACK_GLOBAL`` takes
    it and the next string: an object in the name's place, not RQ's tuple)."""
    found: list[tuple[str, object]] = []
    try:
        for opcode, arg, _ in pickletools.genops(raw):
            if opcode.name in _FRAMING or opcode.name in _SKIPPED:
                continue
            found.append((opcode.name, arg))
            if len(found) == 3:
                break
    except (ValueError, UnicodeDecodeError, EOFError):
        return None
    if not found or found[0][0] not in _STRINGS:
        return None  # the first value is not a string: not RQ's tuple
    names = [name for name, _ in found]
    if len(names) == 3 and names[1] in _STRINGS and names[2] == "STACK_GLOBAL":
        return None
    arg = found[0][1]
    if isinstance(arg, bytes):
        try:
            return arg.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return arg if isinstance(arg, str) else None


def _from_json(raw: bytes) -> str | None:
    try:
        value = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if isinstance(value, list) and value and isinstance(value[0], str):
        return value[0]
    return None
