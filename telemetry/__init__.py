"""Structured logs and progress lines: the one layer every other layer may use."""
