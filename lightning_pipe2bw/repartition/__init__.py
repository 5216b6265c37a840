"""Live repartitioning (vPipe) and moving blocks between stages, in one place: deciding from the
measured block times (``plan.py``), moving blocks with their weights, weight versions and
optimizer state (``migrate.py``), and doing both under Lightning, at a batch's start or to adopt
the layout a checkpoint was written with (``hooks.py``).

Only ``hooks.py`` knows Lightning (the seam's layer); the rest is the pipeline's layer
(``docs/design.md``). Nothing is imported here, so that any layer may import one module."""
