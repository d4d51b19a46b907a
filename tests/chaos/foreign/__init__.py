"""Chaos with the real job systems: Procrastinate, graphile-worker and pg-boss workers
SIGKILLed and SIGSTOPped inside their tasks, ``reconciler run`` replicas killed, one
PostgreSQL restart; see tests/chaos/README.md."""
