"""Sequences, sampling and constraints: what turns logits into tokens."""
