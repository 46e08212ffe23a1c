"""The built-in pages: the chat at `/` and the pipeline view at `/pipeline` (off with --no-webui).

The files live in `pyllama/server/webui/` (package data), are read once, and are served from
memory with a Content-Security-Policy that lets a page load and fetch only from this server: no
script, style, font or image from anywhere else, no inline script, no framing by other sites.
Nothing is built or fetched at run time.
"""
from __future__ import annotations

import os
from typing import Optional

from .http import Response

__all__ = ["WebUI", "WEBUI_DIR", "PAGES"]

WEBUI_DIR = os.path.join(os.path.dirname(__file__), "webui")
# the page paths and the file each serves; every other file is served under /webui/<name>
PAGES = {"/": "index.html", "/pipeline": "pipeline.html"}
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = [("Content-Security-Policy", _CSP), ("X-Content-Type-Options", "nosniff"),
            ("Referrer-Policy", "no-referrer"), ("Cache-Control", "no-cache")]


class WebUI:
    """The files of the pages, read from `folder` on first use."""

    def __init__(self, folder: str = WEBUI_DIR) -> None:
        self.folder = folder
        self._files: Optional[dict[str, tuple[bytes, str]]] = None

    def files(self) -> dict[str, tuple[bytes, str]]:
        """URL path -> (bytes, content type) of every page and asset."""
        if self._files is None:
            files: dict[str, tuple[bytes, str]] = {}
            for name in sorted(os.listdir(self.folder)):
                ext = os.path.splitext(name)[1]
                if ext not in _TYPES:
                    continue
                with open(os.path.join(self.folder, name), "rb") as f:
                    files["/webui/" + name] = (f.read(), _TYPES[ext])
            for path, name in PAGES.items():
                files[path] = files["/webui/" + name]
            self._files = files
        return self._files

    def paths(self) -> frozenset[str]:
        """Every path served: they are public (a browser loads a page before it can ask for a key)."""
        return frozenset(self.files())

    def response(self, path: str) -> Optional[Response]:
        entry = self.files().get(path)
        if entry is None:
            return None
        body, ctype = entry
        return Response(200, body, content_type=ctype, headers=list(_HEADERS))
