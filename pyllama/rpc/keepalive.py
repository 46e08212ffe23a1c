"""TCP keepalive on RPC sockets, timed from the RPC timeout.

A peer whose machine vanished (power loss, a cable, a network partition) sends no FIN or RST: its
half of the connection stays "open" and an idle client would never learn of it until its next
command waited a full timeout. With keepalive the kernel probes an idle connection and fails it,
which `Connection.check_peer` (and the /health path built on it) then sees as POLLERR. The probes
start after half the timeout and give up after three unanswered ones spread over the other half,
so a half-open idle peer is noticed within about the RPC timeout. TCP_USER_TIMEOUT bounds the
other case, data sent to such a peer and never acknowledged, by the same timeout.
"""
from __future__ import annotations

import socket

PROBES = 3


def keepalive_params(timeout: float) -> tuple[int, int, int]:
    """(idle seconds before the first probe, seconds between probes, probes) for an RPC timeout."""
    idle = max(1, int(timeout / 2))
    interval = max(1, int((timeout - idle) / PROBES))
    return idle, interval, PROBES


def enable_keepalive(sock: socket.socket, timeout: float, user_timeout: bool = True) -> dict[str, int]:
    """Turns keepalive on with keepalive_params(timeout) (and, with user_timeout, bounds
    unacknowledged sends by the timeout); returns the options set (by name). Options this
    platform lacks are skipped: keepalive still runs, on the system's timings."""
    idle, interval, count = keepalive_params(timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    done = {"SO_KEEPALIVE": 1}
    wanted = (("TCP_KEEPIDLE", idle), ("TCP_KEEPALIVE", idle),  # the second is macOS's name for the first
              ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count), ("TCP_USER_TIMEOUT", int(timeout * 1000)))
    for name, value in wanted:
        opt = getattr(socket, name, None)
        if opt is None or ("TCP_KEEPIDLE" in done and name == "TCP_KEEPALIVE") \
                or (name == "TCP_USER_TIMEOUT" and not user_timeout):
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            done[name] = value
        except OSError:  # pragma: no cover - a platform that names the option but refuses it
            pass
    return done


__all__ = ["enable_keepalive", "keepalive_params"]
