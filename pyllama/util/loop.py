"""The event loop the programs run on."""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


def install_uvloop() -> None:
    """Make uvloop the event loop of asyncio.run and new_event_loop; asyncio's own if it is missing."""
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed: using asyncio's default event loop (slower)")
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
