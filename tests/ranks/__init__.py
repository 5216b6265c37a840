"""Multi-rank tests: gloo ranks of the session's pool (the ``pools`` fixture,
``helpers/pool.py``) or ranks a ``Trainer`` spawns with ``torch.multiprocessing``."""
