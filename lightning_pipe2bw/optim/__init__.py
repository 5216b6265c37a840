"""Optimizers and update rules, in plain torch (no Lightning, nothing else of the package):
:class:`MuonAdamW` (Muon on the hidden matrices, AdamW on the rest, as one optimizer) and the
delay corrections of PipeDream-2BW (``delay.py``)."""

from lightning_pipe2bw.optim.muon import MuonAdamW, hidden_matrix

__all__ = ["MuonAdamW", "hidden_matrix"]
