"""A script the app's page runs before Gradio's own: Gradio's status trackers time their elapsed-seconds label in a
requestAnimationFrame loop that keeps running on an idle page, a frame drawn 60 times a second on the cores the engine
decodes on (docs/benchmarks.md, "The Chat tab against the engine"). The label shows tenths of a second, so the script
gives that loop four ticks a second. Gradio's loader (its animated logo, on the page's own loading screen and on a
tracker that shows progress) moves by springs on Svelte's animation loop, and runs its cycle out, seconds of frames,
after it has left the page, into a first answer sent soon after the page opened ("The page as it opens"); the script
gives that loop four ticks a second too while no loader is on the page. Every other animation frame stays as it is.
Gradio's modules keep the requestAnimationFrame they find when they load, so the script must come before them in the
page: `PageScript` puts it there as the page is served (Gradio's own `head` option inserts its HTML later, from the
page's JavaScript)."""

from __future__ import annotations

SCRIPT = b"""<script>
(() => {
  const frame = window.requestAnimationFrame.bind(window);
  const elapsedLabel = /performance\\.now\\(\\)-.*\\/1e3/;
  const svelteLoop = /\\.tasks\\.forEach\\(/;
  const loaderShown = () => document.querySelector('svg[viewBox="-1200 -1200 3000 3000"]') !== null;
  const slowed = (source) => elapsedLabel.test(source) || (svelteLoop.test(source) && !loaderShown());
  window.requestAnimationFrame = (callback) =>
    slowed(String(callback)) ? setTimeout(() => callback(performance.now()), 250) : frame(callback);
})();
</script>
"""
BEFORE = b'<script type="module"'
"""Where the script goes: before the first module script, Gradio's bundle."""


def with_script(html: bytes) -> bytes:
    """The page with SCRIPT before its first module script (unchanged if it has none)."""
    at = html.find(BEFORE)
    return html if at < 0 else html[:at] + SCRIPT + html[at:]


class PageScript:
    """ASGI middleware: the page served at the root (an uncompressed HTML response to GET /) gets SCRIPT
    (`with_script`); every other response passes as it is."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "GET" or scope.get("path") not in ("/", ""):
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        body: list[bytes] = []

        async def buffered_send(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body"):
                return
            await _send_page(send, start, b"".join(body))

        await self.app(scope, receive, buffered_send)


async def _send_page(send, start: dict, page: bytes) -> None:
    headers = dict(start.get("headers", []))
    html = headers.get(b"content-type", b"").startswith(b"text/html") and b"content-encoding" not in headers
    if html:
        page = with_script(page)
        headers[b"content-length"] = str(len(page)).encode()
    await send({**start, "headers": list(headers.items())})
    await send({"type": "http.response.body", "body": page})
