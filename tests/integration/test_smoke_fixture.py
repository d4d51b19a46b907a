"""The fixtures give a working, migrated database on each engine."""

from reconciler.worker import JobClient, Step


def test_a_job_can_be_enqueued_and_claimed(client: JobClient) -> None:
    """Enqueue then claim returns the same job with its plan."""
    job_id = client.enqueue("report", steps=[Step("fetch", "idempotent")])
    claim = client.claim(worker="w1", lease_seconds=5)
    assert claim is not None
    assert claim.job_id == job_id
    assert [s.step_name for s in claim.steps] == ["fetch"]
