"""The kit every foreign source is composed on: it scans, batches, swaps and fences.

A source declares its system (``system.System``: its shape, its running and expired
predicates, facts, fences and writes, its listing and liveness) through a
``declaration.Declaration``; the one kit class (``source.DeclaredSource``) runs one
pass's reads and writes over it, calling the declared functions with what they need and
never called back by them, and reads this project's own tables (the step ledger, the
audit) only through their stores. Modules: ``system`` (what a source declares),
``declaration`` (how the registry finds and binds one), ``source`` (the pass's port over
a declaration), ``scan`` (the statement that finds candidates and the brake's counts),
``transaction`` (the state of one pass's transaction), ``batches``, ``fences`` (the step
ledger around a swap), ``shapes`` (``Shape``, kinds and candidate facts), ``history``
(lost attempts from the audit), ``checks`` (schema checks).
"""
