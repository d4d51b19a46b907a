"""What an app adds to its own workers so that the reconciler can read what its job system
alone does not say (``dramatiq``: which fetched messages a worker started)."""
