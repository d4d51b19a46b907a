"""Artifact records: staged per attempt, published by completion, swept when stale.

The files themselves are the worker package's business (reconciler.worker.artifacts);
these are the rows that say which generation's set is the real one.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.core.vocabulary import ArtifactState
from reconciler.storage.clock import db_now
from reconciler.storage.engines import read_only
from reconciler.storage.sql import PROCESSING, artifacts, jobs

STAGED = ArtifactState.STAGED.value
PUBLISHED = ArtifactState.PUBLISHED.value


class ArtifactsSql:
    """Artifact records on one engine (staging is a fenced write: see ClaimsSql)."""

    engine: Engine

    def unpublishable_artifacts(self, limit: int) -> list[tuple[int, int, str]]:
        """Staged artifacts that can never be published: their attempt is over."""
        with self.engine.connect() as conn:
            rows = read_only(conn).execute(
                sa.select(artifacts.c.job_id, artifacts.c.claim_generation,
                          artifacts.c.artifact_name)
                .join(jobs, jobs.c.job_id == artifacts.c.job_id)
                .where(artifacts.c.artifact_state == STAGED,
                       sa.or_(jobs.c.claim_generation != artifacts.c.claim_generation,
                              jobs.c.job_status != PROCESSING))
                .order_by(artifacts.c.job_id, artifacts.c.claim_generation)
                .limit(limit)
            )
            return [(int(j), int(g), str(n)) for j, g, n in rows]

    def unsettled_published_artifacts(self, limit: int) -> list[tuple[int, int, str]]:
        """Published artifacts whose files were not confirmed moved into place."""
        with self.engine.connect() as conn:
            rows = read_only(conn).execute(
                sa.select(artifacts.c.job_id, artifacts.c.claim_generation,
                          artifacts.c.artifact_name)
                .where(artifacts.c.artifact_state == PUBLISHED,
                       artifacts.c.settled_at.is_(None))
                .order_by(artifacts.c.job_id).limit(limit)
            )
            return [(int(j), int(g), str(n)) for j, g, n in rows]

    def settle_artifacts(self, job_id: int, generation: int) -> None:
        """Record that a published set's files are in place."""
        with self.engine.begin() as conn:
            conn.execute(
                artifacts.update()
                .where(artifacts.c.job_id == job_id,
                       artifacts.c.claim_generation == generation,
                       artifacts.c.artifact_state == PUBLISHED,
                       artifacts.c.settled_at.is_(None))
                .values(settled_at=db_now())
            )

    def discard_artifact(self, job_id: int, generation: int, artifact_name: str) -> bool:
        """Mark one stale staged artifact discarded (after its file is gone)."""
        with self.engine.begin() as conn:
            done = conn.execute(
                artifacts.update()
                .where(artifacts.c.job_id == job_id,
                       artifacts.c.claim_generation == generation,
                       artifacts.c.artifact_name == artifact_name,
                       artifacts.c.artifact_state == STAGED)
                .values(artifact_state=ArtifactState.DISCARDED.value, settled_at=db_now())
            )
            return done.rowcount == 1

    def published_artifact_names(self, job_id: int, generation: int) -> list[str]:
        """Names in the published set of one generation."""
        with self.engine.connect() as conn:
            return [str(n) for n in read_only(conn).execute(
                sa.select(artifacts.c.artifact_name).where(
                    artifacts.c.job_id == job_id, artifacts.c.claim_generation == generation,
                    artifacts.c.artifact_state == PUBLISHED)
            ).scalars()]

    def artifacts_of(self, job_id: int) -> list[tuple[int, str, str]]:
        """(generation, name, state) of every artifact of a job."""
        with self.engine.connect() as conn:
            rows = read_only(conn).execute(
                sa.select(artifacts.c.claim_generation, artifacts.c.artifact_name,
                          artifacts.c.artifact_state)
                .where(artifacts.c.job_id == job_id)
                .order_by(artifacts.c.claim_generation, artifacts.c.artifact_name)
            )
            return [(int(g), str(n), str(st)) for g, n, st in rows]
