"""Job sources beside the job systems teams already run (docs/sources.md).

One module per system, each holding its ``[source]`` config model and a class implementing
the job-source port on one SQLAlchemy connection (the pass's transaction; the foreign
tables live in the reconciler's database): ``procrastinate``, ``graphile_worker``,
``pgboss``, ``django_tasks``, ``celery`` and the mapped home-grown ``table``. The native
source (this project's ``job_runs``) lives in ``reconciler.storage``.
``reconciler.config.registry`` lists every source once, by where it lives: adding one is
a module, an entry there and a conformance fixture. This ``__init__`` imports nothing, so
importing one source imports only that source.
"""
