"""The built-in default model: a deterministic test model generated on first use and cached, so the
programs serve something with zero downloads."""
from __future__ import annotations

import logging
import os

from ..util.settings import current
import tempfile

log = logging.getLogger(__name__)

DEFAULT_PRESET = "small"
DEFAULT_SEED = 0
DEFAULT_FILE = f"pyllama-default-{DEFAULT_PRESET}-s{DEFAULT_SEED}-v2.gguf"


def cache_dir() -> str:
    base = current().cache_dir
    os.makedirs(base, exist_ok=True)
    return base


def default_model_path() -> str:
    """Path of the default model, written (atomically) if it is not cached yet."""
    path = os.path.join(cache_dir(), DEFAULT_FILE)
    if not os.path.exists(path):
        from .make import make_model  # noqa: PLC0415 - only needed the first time
        log.warning("writing the built-in default model (%s preset) to %s", DEFAULT_PRESET, path)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".part")
        os.close(fd)
        try:
            make_model(DEFAULT_PRESET, tmp, seed=DEFAULT_SEED)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path
