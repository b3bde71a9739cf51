"""app/page.py: the script that slows Gradio's idle redraw loop reaches the page before Gradio's modules, and nothing
else is touched."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from app.page import SCRIPT, PageScript, with_script

PAGE = '<html><head><script>window.x = 1;</script><script type="module" src="./assets/index.js"></script></head></html>'


def client() -> TestClient:
    routes = [
        Route("/", lambda request: HTMLResponse(PAGE)),
        Route("/config", lambda request: JSONResponse({"page": PAGE})),
    ]
    return TestClient(PageScript(Starlette(routes=routes)))


def test_the_page_runs_the_script_before_gradios_modules():
    page = client().get("/")
    assert page.status_code == 200
    body = page.content
    assert body.index(SCRIPT) < body.index(b'<script type="module"')
    assert body.index(b"window.x = 1;") < body.index(SCRIPT)
    assert int(page.headers["content-length"]) == len(body) == len(PAGE.encode()) + len(SCRIPT)


def test_other_responses_pass_unchanged():
    c = client()
    assert c.get("/config").json() == {"page": PAGE}
    assert c.post("/").status_code == 405  # only GET / is rewritten; the app answers the rest
    assert with_script(b"<html>no module</html>") == b"<html>no module</html>"


def test_gradios_queue_looks_for_work_every_queue_poll_s_not_every_millisecond():
    """Gradio's queue polls every 1 ms on Linux (every 10 ms for progress), waking the app's event loop a thousand
    times a second on the cores the engine decodes on: the app's launch slows both polls to QUEUE_POLL_S."""
    import gradio as gr
    from tiny_serving import free_port

    from app.__main__ import QUEUE_POLL_S, launch
    from app.ui import Page

    with gr.Blocks() as demo:
        gr.Markdown("hi")
    launch(Page(demo), "127.0.0.1", free_port(), prevent_thread_lock=True, quiet=True)
    try:
        assert demo._queue.sleep_when_free == demo._queue.progress_update_sleep_when_free == QUEUE_POLL_S >= 0.05
    finally:
        demo.close()
