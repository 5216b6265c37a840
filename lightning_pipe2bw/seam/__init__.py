"""The strategy's helpers at the Lightning seam: what the strategy (``strategy.py``) wires into
Lightning's loop and nothing below the seam may know, for the ideas without a folder of their
own (steps, checkpoints, repartitioning, failures and the planner have theirs, each with its
Lightning-side modules): what the gradient hooks log (``hooklogs``), the data (``loaders``),
weight averaging (``averaging``) and the processes (``launcher``, ``process_group``,
``agreement``, ``requeue``)."""
