"""Voilà's app and page handler with the two changes the dashboard needs (voila_server.py says why): the page
sets the `_xsrf` cookie that its unload beacon echoes to free its kernel, and at most RENDERS pages render at once.
"""

from __future__ import annotations

import asyncio

import tornado.web
from voila.app import Voila
from voila.tornado.handler import TornadoVoilaHandler

from openrlhf_tis.dashboard.voila_server import RENDERS


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
