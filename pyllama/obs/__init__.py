"""Observability: the tracer and busy-time accounting."""
