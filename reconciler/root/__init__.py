"""The composition root: each kind of process assembled once, from one config.

One module per process role, each opening the engines its role needs with that role's
timeouts, running the schema and source checks once, and returning its parts typed by the
ports their callers use:

- ``cli``: a ``reconciler`` command (``assemble_cli``);
- ``sidecar``: ``reconciler run`` (``assemble_sidecar``);
- ``console``: the operator console ``reconciler run`` serves (``assemble_console``);
- ``worker``: a ``JobClient`` or a ``StepLedger`` (``assemble_worker``,
  ``open_step_ledger``);
- ``migrations``: ``reconciler db upgrade`` and ``alembic`` (``migrate``,
  ``migration_engine``);
- ``checks``: the steps they share (the schema and source checks, the source factory).

Only entry points import it (``tests/unit/test_architecture.py`` lists them): the command
line's commands, the demos, ``alembic/env.py`` and the public constructors' narrow factory
``reconciler.connect``. Nothing below imports it, and each module imports only what its
role needs: this ``__init__`` imports nothing, so a command does not pay for the sidecar's
parts.
"""
