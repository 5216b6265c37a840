"""A step and its values, in one place: what the last stage knows at a step's end
(``values.py``: ``StepValues``, built by the runtime's drivers), one Trainer call's steps under
Lightning's loop (``pipelined.py``: ``PipelinedSteps``), what a step logs and appends, replayed
alike on every rank (``log.py``), and the values' way from the last stage to what every rank
checks, logs and returns (``delivery.py``: ``StepDelivery``).

``values.py`` is the runtime's layer, the rest the seam's (``docs/design.md``). Nothing is
imported here, so that any layer may import one module."""
