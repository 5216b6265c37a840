"""A rank's failure, in one place: the error that explains itself (``record.py``: which rank,
stage and action, and why; raised by the runtime), who the other ranks are and what became of
one that is gone (``peers.py``), SIGTERM and SIGINT ending every rank (``signals.py``), and the
strategy's side under Lightning (``hooks.py``: collectives that name a lost rank, the launched
workers stopped after a failure).

``record.py`` is the runtime's layer, ``peers.py`` and ``signals.py`` the pipeline's, ``hooks.py``
the seam's (``docs/design.md``). Nothing is imported here, so that any layer may import one
module."""
