"""The strategy's helpers at the Lightning seam: what the strategy (``strategy.py``) wires into
Lightning's loop and nothing below the seam may know: the steps and their logged values
(``steps``, ``steplog``, ``delivery``, ``hooklogs``), the data (``loaders``), checkpoints
(``checkpointing``), weight averaging (``averaging``), live repartitioning
(``repartitioning``), ``balance="auto"`` (``planning``, ``loopcost``), the processes and their
failures (``launcher``, ``process_group``, ``agreement``, ``failures``, ``requeue``)."""
