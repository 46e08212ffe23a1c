"""The built-in default model: a deterministic test model generated on first use and cached, so the
programs serve something with zero downloads."""
from __future__ import annotations

import logging
import os
import tempfile

log = logging.getLogger(__name__)

DEFAULT_PRESET = "small"
DEFAULT_SEED = 0
DEFAULT_FILE = f"pyllama-default-{DEFAULT_PRESET}-s{DEFAULT_SEED}-v2.gguf"


def cache_dir() -> str:
    base = os.environ.get("PYLLAMA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pyllama")
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
