"""The long-running service: scheduled passes (APScheduler), chores, metrics and HTTP probes."""
