"""Voilà's app and page handler with the three changes the dashboard needs (voila_server.py says why): the page
sets the `_xsrf` cookie that its unload beacon echoes to free its kernel, at most RENDERS pages render at once, and
a render that fails (a kernel that never answered) ends its page with the error instead of leaving it loading.
Imported only to serve (Voilà takes seconds to import), so `openrlhf-tis-dashboard --help` and a refused port
answer at once.
"""

from __future__ import annotations

import asyncio
import html
import os
from collections.abc import AsyncIterator

import tornado.ioloop
import tornado.web
import voila.handler
from voila.app import Voila
from voila.notebook_renderer import NotebookRenderer
from voila.tornado.handler import TornadoVoilaHandler

from openrlhf_tis.dashboard.voila_server import LOCAL_ONLY, RENDERS, voila_args
from openrlhf_tis.dashboard.waits import print_waits_on_sigusr1
from openrlhf_tis.upstream_guards import replace, require_version

PATCH = "dashboard/voila_app.py:serve_local"
RENDER_FAILED = "mm-render-failed"  # the class of the message a failed render ends its page with


async def ending_loudly(snippets: AsyncIterator[tuple[str, object]], log) -> AsyncIterator[tuple[str, object]]:
    """`snippets` (a page's HTML as Voilà's renderer yields it), then, if rendering raised, one last snippet saying
    so. Voilà's page handler renders in a task nobody awaits and waits for that task's end marker, which an exception
    never sends: the page stayed open forever, a heartbeat every 10 s."""
    try:
        async for snippet in snippets:
            yield snippet
    except Exception as error:  # noqa: BLE001 -- any failure must reach the page, whatever raised it
        log.exception("the page's render failed")
        yield (f'<pre class="{RENDER_FAILED}">The dashboard could not be shown: {html.escape(repr(error))}\n'
               f"(the server's console has the traceback; reload to try again)</pre></body></html>", None)


class LoudRenderer(NotebookRenderer):
    """Voilà's renderer, whose page ends with the error where rendering fails (`ending_loudly`)."""

    def generate_content_generator(self, kernel_id=None, kernel_future=None):
        return ending_loudly(super().generate_content_generator(kernel_id, kernel_future), self.log)


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
    """Serve `notebook` with LocalVoila (`voila_args`) and LoudRenderer until SIGINT or SIGTERM, to local Host
    headers only.

    Voilà's own `launch_instance`, with LOCAL_ONLY added to its `tornado_settings` once every configuration source
    has been read, so that no Jupyter config file can turn the Host check off by setting other tornado settings (a
    dict on the command line is deprecated in traitlets and types its values as strings). SIGUSR1 prints where each
    of its asyncio tasks waits (waits.py), for a page that never finishes loading.
    """
    require_version("voila", ">=0.5,<0.6", patch=PATCH)
    replace(voila.handler, "NotebookRenderer", LoudRenderer, patch=PATCH)  # the page handler builds it by that name
    app = LocalVoila.instance()
    app.initialize(voila_args(notebook, port))
    app.tornado_settings = {**app.tornado_settings, **LOCAL_ONLY}
    tornado.ioloop.IOLoop.current().add_callback(lambda: print_waits_on_sigusr1(asyncio.get_running_loop()))
    app.start()
