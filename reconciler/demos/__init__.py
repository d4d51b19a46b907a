"""``reconciler demo [--source X]``: real workers crash and the reconciler recovers their
jobs, one module per system (``native``, ``procrastinate``, ``django_tasks``, ``celery``, ``rq``,
``dramatiq``;
their workers' apps beside them, what they share in ``support``).

Each demo builds its config through the one loader (``support.demo_config``) and is
assembled by the composition root, as ``reconciler run`` is. ``DEMOS`` names each by where
it lives, so the command line offers them without importing one: a demo imports its
system (an optional peer) only when it runs.
"""

DEMOS: dict[str, str] = {
    "native": "reconciler.demos.native:run_demo",
    "procrastinate": "reconciler.demos.procrastinate:run_procrastinate_demo",
    "django-tasks": "reconciler.demos.django_tasks:run_django_tasks_demo",
    "celery": "reconciler.demos.celery:run_celery_demo",
    "rq": "reconciler.demos.rq:run_rq_demo",
    "dramatiq": "reconciler.demos.dramatiq:run_dramatiq_demo",
}
"""Each ``--source`` of ``reconciler demo``: ``"module:function"`` returning its exit code."""
