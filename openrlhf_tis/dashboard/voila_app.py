"""Voilà's app and page handler with the two changes the dashboard needs (voila_server.py says why): the page
sets the `_xsrf` cookie that its unload beacon echoes to free its kernel, and at most RENDERS pages render at once.
Imported only to serve (Voilà takes seconds to import), so `openrlhf-tis-dashboard --help` and a refused port
answer at once.
"""

from __future__ import annotations

import asyncio
import os

import tornado.web
from voila.app import Voila
from voila.tornado.handler import TornadoVoilaHandler

from openrlhf_tis.dashboard.voila_server import LOCAL_ONLY, RENDERS, voila_args


class PageHandler(TornadoVoilaHandler):
    """Voilà's page, sent with the `_xsrf` cookie its unload beacon needs, rendered at most RENDERS at a time."""

    _renders = asyncio.Semaphore(RENDERS)  # binds to the server's event loop on first use (Python >= 3.10)

    @tornado.web.authenticated
    async def get(self, path=None):
        self.xsrf_token  # noqa: B018 -- reading it sets the cookie on this response (tornado)
        async with self._renders:
            await super().get(path)


class LocalVoila(Voila):
    """Voilà with PageHandler serving the notebook."""

    def init_handlers(self) -> list:
        return [(spec[0], PageHandler, *spec[2:]) if spec[1] is TornadoVoilaHandler else spec
                for spec in super().init_handlers()]


def serve_local(notebook: str | os.PathLike, port: int) -> None:
    """Serve `notebook` with LocalVoila (`voila_args`) until SIGINT or SIGTERM, to local Host headers only.

    Voilà's own `launch_instance`, with LOCAL_ONLY added to its `tornado_settings` once every configuration source
    has been read, so that no Jupyter config file can turn the Host check off by setting other tornado settings (a
    dict on the command line is deprecated in traitlets and types its values as strings).
    """
    app = LocalVoila.instance()
    app.initialize(voila_args(notebook, port))
    app.tornado_settings = {**app.tornado_settings, **LOCAL_ONLY}
    app.start()
