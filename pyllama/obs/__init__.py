"""Observability: the tracer and busy-time accounting."""

from . import rpc_stats  # noqa: E402


def check_env() -> None:
    """The diagnostics' numeric variables, checked as a program starts (PyllamaError naming a bad
    one) rather than when their printer first runs."""
    if rpc_stats.enabled:
        rpc_stats.period_s()
