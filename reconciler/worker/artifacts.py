"""Artifacts staged per attempt on disk, published only by the completing generation.

Layout under the artifact root::

    staging/<job_id>/<generation>/<name>    written by an attempt, fenced by its lease
    published/<job_id>/<name>               moved into place after the fenced completion

A stale attempt can write only into its own generation's staging folder, and only the
generation that completed the job (in the same transaction) is ever moved into place.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

from reconciler.core.worker_ports import ArtifactRecords

log = logging.getLogger("reconciler.worker.artifacts")

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")


def check_name(name: str) -> str:
    """An artifact name is one plain file name: no folders, no dot-files."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError("artifact names are plain file names (letters, digits, '_', '.', '-')")
    return name


def staging_path(root: Path, job_id: int, generation: int, name: str) -> Path:
    """Where one attempt stages an artifact."""
    return root / "staging" / str(job_id) / str(generation) / check_name(name)


def published_path(root: Path, job_id: int, name: str) -> Path:
    """Where a published artifact lives."""
    return root / "published" / str(job_id) / check_name(name)


def write_atomically(path: Path, data: bytes) -> None:
    """Write a file so readers see all of it or none of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".staging-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ArtifactMissingError(OSError):
    """A published artifact's file is neither staged nor in place on this filesystem."""


def move_published(store: ArtifactRecords, root: Path, job_id: int, generation: int) -> None:
    """Move a completed generation's staged files into place, then mark them settled.

    Settles only when every file is in place: a process that cannot see the staged files
    (another machine's folder) raises instead of marking them settled and losing them.
    """
    for name in store.published_artifact_names(job_id, generation):
        source = staging_path(root, job_id, generation, name)
        target = published_path(root, job_id, name)
        if source.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)
        elif not target.exists():
            raise ArtifactMissingError(f"artifact {name!r} of job {job_id} is not on this "
                                       "filesystem")
    store.settle_artifacts(job_id, generation)
