"""The live views' own update channel (app/live.py) and how a generation's views use it (app/views.py Streamed,
ChatViews): no models, no browser (tests/test_app.py has the page reading it)."""

from __future__ import annotations

import json
import threading
import time

from starlette.applications import Starlette
from starlette.testclient import TestClient

from app.live import Channels
from app.views import ChatViews, Streamed
from usd.algorithms import Algorithm


def served(channels: Channels) -> TestClient:
    return TestClient(Starlette(routes=[channels.route()]))


def read(response) -> list:
    """The messages of an event stream, then "end" if it ended with one."""
    out, event = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            out.append("end" if event == "end" else json.loads(line[len("data: ") :]))
            event = None
    return out


def test_a_reader_gets_every_message_in_order_then_the_end():
    channels = Channels()
    channel = channels.open()
    channel.publish({"n": 1})  # before the page connects: kept for it

    def later():
        time.sleep(0.3)
        channel.publish({"n": 2})
        channel.publish({"n": 3})
        channels.close(channel)

    threading.Thread(target=later).start()
    with served(channels).stream("GET", "/" + channel.url) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert read(response) == [{"n": 1}, {"n": 2}, {"n": 3}, "end"]
    assert len(channels) == 0


def test_an_ended_or_unknown_channel_is_204_so_the_page_does_not_reconnect():
    channels = Channels()
    channel = channels.open()
    channels.close(channel)
    client = served(channels)
    assert client.get("/" + channel.url).status_code == 204
    assert client.get("/usd/live/not-a-token").status_code == 204
    other = channels.open()
    assert other.token != channel.token and len(other.token) >= 24  # unguessable: a page reads only its own


def test_a_view_with_a_channel_sends_gradio_its_first_and_last_value_only():
    channels = Channels()
    view = Streamed(channels)
    first, fresh = view.value({"tokens": {"from": 0}}, done=False)
    assert fresh and first["channel"] == view.channel.url
    again, fresh = view.value({"tokens": {"from": 1}}, done=False)
    assert again is first and not fresh  # Gradio has nothing new: the update went over the channel
    last, fresh = view.value({"tokens": {"from": 0, "whole": True}}, done=True)
    assert fresh and "channel" not in last  # the last, whole, closes the page's stream
    assert view.value({"tokens": {}}, done=True) == (last, False)
    assert len(channels) == 0
    assert read(served(channels).get("/" + view.channel.url)) == []  # ended


def test_a_view_without_a_channel_sends_gradio_every_update():
    view = Streamed(None)
    assert view.value({"a": 1}, done=False) == ({"a": 1}, True)
    assert view.value({"a": 2}, done=False) == ({"a": 2}, True)
    view.end()


def test_the_chat_yields_only_when_its_answer_is_due_or_the_view_is_new():
    from app import render

    views = ChatViews([{"role": "user", "content": "hi"}], Channels(), chat_s=3600.0)
    live = render.Live(Algorithm.NONE)
    assert views.update(live) is not None  # the first: the chat and the view naming its channel
    assert views.update(live) is None  # the chat not due, the view's update on the channel
    views.end()
