"""Checkpoints of a pipeline, in one place: the format (``format.py``: what pipe2bw adds to
Lightning's checkpoint and how a stage reads its share back), the stage state across ranks
(``storage.py``: gathered on rank 0, or sharded with ``torch.distributed.checkpoint``) and what
the strategy's checkpoint hooks add under Lightning (``hooks.py``: the barrier every rank must
reach, the consolidated file under a temporary name, the first load).

Only ``hooks.py`` knows Lightning (the seam's layer); the rest is the pipeline's layer
(``docs/design.md``). Nothing is imported here, so that any layer may import one module."""
