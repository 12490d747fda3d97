"""Recurrent layers (RNN, GRU, LSTM) as whole-sequence kernels."""
from __future__ import annotations
