"""Job sources beside the job systems teams already run (docs/sources.md).

One package per system, each a declaration (``DECLARATION``): its ``[source]`` config
model, its fence snapshot, its shape and its own SQL, as functions of one SQLAlchemy
connection (the pass's transaction; the foreign tables live in the reconciler's
database): ``procrastinate``, ``graphile_worker``, ``pgboss``, ``django_tasks``,
``celery`` and the mapped home-grown ``table``. What they share (the scans, batches,
swaps' fences, the step ledger around them, the one class binding a declaration to a
transaction) is written once in ``kit``.
The native source (this project's ``job_runs``) lives in ``reconciler.storage``.
``reconciler.config.registry`` lists every source once, by where it lives: adding one is
a package, an entry there and a conformance fixture (docs/architecture.md, "Adding a
source"). This ``__init__`` imports nothing, so importing one source imports only that
source.
"""
