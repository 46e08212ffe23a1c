"""A device of another machine, reached over the network: it can be lost (its peer went away or
stopped answering) and made usable again on a new connection. One mixin, for every kind of
remote device (our rpc servers' now); the server's reconnect thread drives it through the Engine."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

from ..ir.tensor import Buffer
from .device import Device

__all__ = ["RemoteDevice", "lost_devices", "remote_devices"]


class RemoteDevice(ABC):
    """Mixed into the Backend of a device of another machine (ahead of Backend, so `remote` holds)."""

    name: str
    remote = True

    @abstractmethod
    def lost(self) -> Optional[str]:
        """Why this device cannot be used any more (its peer went away or stopped answering), or
        None."""

    @abstractmethod
    def reach(self) -> None:
        """Opens a new connection to a lost device's peer without touching anything in use (raises
        while the peer cannot be reached); `reconnect` then continues on it."""

    @abstractmethod
    def reconnect(self) -> list[Buffer]:
        """Makes a lost device usable again: every live buffer exists there again (under the same
        Buffer objects), contents lost; returns them."""

    @abstractmethod
    def disconnect(self) -> None:
        """Stops waiting on the device's peer: pending and later calls fail at once."""


def remote_devices(devices: Sequence[Device]) -> list[RemoteDevice]:
    """Those of `devices` that are devices of another machine."""
    return [d for d in devices if isinstance(d, RemoteDevice)]


def lost_devices(devices: Sequence[Device]) -> dict[str, str]:
    """Of `devices`, those that cannot be used any more, by name, with why (naming the peer)."""
    lost = {}
    for d in remote_devices(devices):
        why = d.lost()
        if why:
            lost[d.name] = why
    return lost
