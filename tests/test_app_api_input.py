"""Bad input through the real API endpoints, on an app with no pair loaded: input is checked before any model is
needed, so these run in seconds without the registry models."""

from __future__ import annotations

import os
import socket

import pytest

from app.pairs import Pairs

pytestmark = pytest.mark.slow  # serves the app on a port: an app-process test, outside the fast tier


@pytest.fixture(scope="module")
def client(catalog):
    from gradio_client import Client

    from app.__main__ import launch
    from app.ui import build

    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    page = build(Pairs(catalog))
    demo = page.demo
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch(page, "127.0.0.1", port, prevent_thread_lock=True, quiet=True)
    yield Client(f"http://127.0.0.1:{port}/", verbose=False)
    demo.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": "inf"}, "max new tokens must be a whole number from 1 to 4,096, got 'inf'"),
        ({"top_k": "inf"}, "top-k must be a whole number from 0 to 1,048,576, got 'inf'"),
        ({"seed": "inf"}, "seed must be a whole number from 0 to"),
        ({"max_new_tokens": "nan"}, "max new tokens must be a whole number from 1 to 4,096, got 'nan'"),
        ({"temperature": "abc"}, "temperature must be a number from 0 (greedy) to 5, got 'abc'"),
        ({"draft_tokens": "²"}, "draft tokens must be auto or a whole number from 1 to 16, got '²'"),
        ({"prompt": 123}, "the prompt must be text, got a number"),
    ],
)
@pytest.mark.parametrize("api_name", ["/generate", "/compare"])
def test_bad_settings_through_the_api_get_a_message_not_a_traceback(client, kwargs, message, api_name):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError) as err:
        client.predict(**{"prompt": "hi", **kwargs}, api_name=api_name)
    assert message in str(err.value)
    assert "upstream" not in str(err.value)
