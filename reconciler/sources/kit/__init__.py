"""The kit every foreign source is composed on: it scans, batches, swaps and fences.

A source declares its system's shape (``source.ForeignSource``'s hooks: its key, kind,
running and expired predicates, scan order, liveness, facts, fences and writes); the kit
runs one pass's reads and writes over it and reads this project's own tables (the step
ledger, the audit) only through their stores. Modules: ``source`` (the pass's port over
a declaration), ``scan`` (the statement that finds candidates and the brake's counts),
``transaction`` (the state of one pass's transaction), ``batches``, ``fences`` (the step
ledger around a swap), ``shapes`` (kinds and candidate facts), ``history`` (lost attempts
from the audit), ``checks`` (schema checks), ``listing`` (what operators see).
"""
