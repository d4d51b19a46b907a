"""stale-claim-reconciler: durable job leases and the reconciler for jobs whose workers died.

The worker API is ``reconciler.worker``; the service and CLI are ``reconciler.cli``.
"""

__version__ = "0.1.0"
