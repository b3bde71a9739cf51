"""How a generation's views reach the page: the pace of their updates, the live views (a token view with, as each has
them, a heading, the stats panel and the chart) and the chat's two outputs, the engine's stream run on its own thread
and handed over in batches, over the app's own channel (app/live.py) or through Gradio."""

from __future__ import annotations

import html
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import gradio as gr

from usd.errors import Failed

from . import render
from .live import Channels

STOPPED = " [stopped]"
"""Marks an answer cut short by Stop in the chat; taken off again before the chat goes back to the models."""


@dataclass(frozen=True)
class Pace:
    """The least time between two updates of a generation's views: its live views (token view, stats, chart) and the
    chat's answer bubble. Rounds in between are merged into one update; the first goes out at once, the last as soon
    as the answer ends. Each update costs the browser work, on a CPU machine on the cores the engine decodes on; where
    the engine has a thread on every core, each piece of that work displaces one and the step waits at its barrier.
    Measured in docs/benchmarks.md ("The Chat tab against the engine")."""

    live: float
    chat: float


PACE = Pace(live=0.25, chat=1.0)
"""Live views over the app's own channel (app/live.py), each update costing the page what it shows: a few a second.
The chat's bubble goes through Gradio, whose every message costs the page a fixed amount of work besides the redrawn
answer."""
BUSY_CORES_PACE = Pace(live=0.5, chat=3.0)
"""PACE where the target decodes on this machine's CPU with a thread on every core (`pace`): the token view beside the
chat shows every new piece twice a second, the bubble catches up every few seconds."""
GRADIO_PACE = Pace(live=0.5, chat=1.0)
"""Without a channel (a generation that runs in another process, ZeroGPU): Gradio carries every update."""
BUSY_CORES_GRADIO_PACE = Pace(live=1.0, chat=1.0)
"""GRADIO_PACE where the target decodes on this machine's CPU with a thread on every core."""
LIVE_PARTS = ("head", "tokens", "stats", "chart")
"""A live view's parts, in the order they stand in it; a view has the ones it is built with (`live_view`)."""
LIVE_JS = """
const part = (name) => element.querySelector('.live-' + name);
const box = element.querySelector('.tokens'), head = part('head'), stats = part('stats'), chart = part('chart');
let run = null, shown = 0, rows = [], drawn = -Infinity;
const CHART_MS = 2000;  // the chart, redrawn whole, is drawn at most this often, and on every whole value (the last)
const W = 360, H = 150, L = 34, R = 10, T = 8, B = 20;
const draw = () => {
  if (!chart) return;
  const last = rows.length ? rows[rows.length - 1][0] : 1, first = rows.length ? rows[0][0] : 0;
  const top = rows.reduce((m, r) => Math.max(m, r[1], r[2]), 1);
  const x = (r) => (L + (W - L - R) * (r - first) / Math.max(1, last - first)).toFixed(1);
  const y = (t) => (T + (H - T - B) * (1 - t / top)).toFixed(1);
  const line = (i) => rows.map((r) => x(r[0]) + ',' + y(r[i])).join(' ');
  chart.querySelector('svg').innerHTML =
    `<line class="axis" x1="${L}" y1="${T}" x2="${L}" y2="${H - B}"/>` +
    `<line class="axis" x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}"/>` +
    `<text x="${L - 4}" y="${T + 8}" text-anchor="end">${top}</text>` +
    `<text x="${L - 4}" y="${H - B}" text-anchor="end">0</text>` +
    `<text x="${L}" y="${H - 4}">round ${rows.length ? first : ''}</text>` +
    `<text x="${W - R}" y="${H - 4}" text-anchor="end">${rows.length ? last : ''}</text>` +
    `<polyline class="emitted" points="${line(2)}"/><polyline class="accepted" points="${line(1)}"/>`;
};
const apply = (v) => {
  if (!v || typeof v !== 'object' || !v.tokens) return;
  const feed = v.tokens;
  if (feed.run !== run || feed.from === 0) {
    box.replaceChildren(); run = feed.run; shown = 0; rows = []; drawn = -Infinity;
  }
  if (feed.from === shown) { box.insertAdjacentHTML('beforeend', feed.html); shown = feed.to; }
  if (head && v.head !== undefined) head.innerHTML = v.head;
  if (stats && v.stats !== undefined) stats.innerHTML = v.stats;
  if (chart && v.chart && v.chart.from === rows.length) {
    rows.push(...v.chart.rows);
    if (performance.now() - drawn >= CHART_MS) { draw(); drawn = performance.now(); }
  }
};
let source = null, channel = null;
const listen = (url) => {
  if (url === channel) return;
  if (source) source.close();
  source = null;
  channel = url;
  if (!url) return;
  const events = new EventSource(new URL(url, document.baseURI));
  events.onmessage = (e) => { if (channel === url) apply(JSON.parse(e.data)); };
  events.addEventListener('end', () => events.close());
  source = events;
};
const show = () => {
  const v = props.value;
  apply(v);
  listen(v && typeof v === 'object' && v.channel ? v.channel : null);
};
show();
watch('value', show);
"""
"""A live view appends what each update brings (render.LiveFeed): the new pieces to its token box and the new rows to
its chart, which it draws itself (an SVG of two lines) at most every CHART_MS and at the end (a redraw at every
update cost the engine several percent on a 2-core machine); its heading and stats are replaced whole. A value that
names a channel (app/live.py) has it read the updates from there until a value without one, the last, arrives."""


def in_background(make_events, cancel: threading.Event, interval: float) -> Iterator[list]:
    """Run the engine's event stream on its own thread and hand over everything it produced since the last batch, at
    most one batch per `interval` (the first event at once, the last as soon as the stream ends): the decode loop never
    waits on Gradio, and the UI's work is bounded by its update rate, not the engine's round rate."""
    q: queue.Queue = queue.Queue()
    end = object()

    def work():
        try:
            for event in make_events():
                q.put(event)
        except Exception as e:  # handed to the consumer, which raises it in the request's own thread
            q.put(Failed(e))
        finally:
            q.put(end)

    worker = threading.Thread(target=work, name="usd-decode", daemon=True)
    worker.start()
    sent = None  # when the last batch went out
    try:
        while True:
            batch = [q.get()]
            while sent is not None and batch[-1] is not end and not isinstance(batch[-1], Failed):
                wait = sent + interval - time.monotonic()
                if wait <= 0:
                    break
                try:
                    batch.append(q.get(timeout=wait))
                except queue.Empty:
                    break
            while not q.empty():
                batch.append(q.get_nowait())
            for item in batch:
                if isinstance(item, Failed):
                    raise item.error
            events = [e for e in batch if e is not end]
            if events:
                sent = time.monotonic()
                yield events
            if len(events) < len(batch):
                return
    finally:
        cancel.set()  # the consumer stopped (done, Stop, a closed tab): make sure the decode loop does too
        worker.join()


def pace(pair, channel: bool) -> Pace:
    """How often the views of a generation on `pair` are updated, over the app's channel or not: the BUSY_CORES pace
    where its target computes on this machine's CPU with a thread on every core, the other elsewhere (a GPU, cores to
    spare, a remote backend)."""
    calm, busy = (PACE, BUSY_CORES_PACE) if channel else (GRADIO_PACE, BUSY_CORES_GRADIO_PACE)
    return busy if pair.fills_cpu() else calm


class Every:
    """Due at the first call, then once `seconds` have passed since it was last due, and at the last call."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at: float | None = None

    def due(self, last: bool) -> bool:
        now = time.monotonic()
        if last or self.at is None or now - self.at >= self.seconds:
            self.at = now
            return True
        return False


class Streamed:
    """One live view's values during a generation. With a channel (app/live.py), each update goes over it and Gradio
    keeps the view's first value, which names the channel, until the last, which it carries whole; without one,
    Gradio carries every update."""

    def __init__(self, channels: Channels | None):
        self.channels = channels
        self.channel = channels.open() if channels is not None else None
        self.held: dict | None = None
        self.final: dict | None = None

    def value(self, feed: dict, done: bool) -> tuple[dict, bool]:
        """(the view's value for Gradio, whether Gradio has not had it yet)."""
        if self.final is not None:
            return self.final, False
        if done or self.channel is None:
            if done:
                self.final = feed
                self.end()
            return feed, True
        self.channel.publish(feed)
        if self.held is None:
            self.held = {**feed, "channel": self.channel.url}
            return self.held, True
        return self.held, False

    def end(self) -> None:
        if self.channel is not None:
            self.channels.close(self.channel)


class ChatViews:
    """The chat tab's two outputs for one generation: the chat, and the live view (tokens, stats and chart as one
    component), as updates that cost what changed: the live view gets the new pieces and chart rows, and the chat's
    answer is updated every `chat_s` and at the end.

    With a channel (app/live.py), the live view's updates go over it, and Gradio is sent an update only when the chat
    is due (or the view's first and last value). Without one, the chat, when not due, gets the very value it was last
    sent, which Gradio's stream diff turns into nothing on the wire. Not gr.skip(): Gradio reads a skip as a property
    update, builds the component afresh with its API schema (a few ms of the app's CPU), and then sends the chat's
    next value whole, which the page renders whole."""

    def __init__(self, shown: list, channels: Channels | None = None, chat_s: float = PACE.chat):
        self.shown = shown
        """The chat as the user sees it: the history and the new message."""
        self.live = render.LiveFeed()
        self.view = Streamed(channels)
        self.chat = Every(chat_s)
        self.chat_sent: list = shown

    def update(self, live: render.Live) -> tuple | None:
        """(chat, live view) for the answer so far, or None when Gradio has nothing new to send (the live view's
        update went over its channel, and the chat is not due)."""
        done = live.finished is not None
        chat_due = self.chat.due(done)
        if chat_due:
            answer = render.answer_text(live)
            if live.finished is not None and live.finished.stats.stop_reason == "cancelled":
                answer += STOPPED
            self.chat_sent = [*self.shown, {"role": "assistant", "content": answer}]
        stats = render.stats_html(live.numbers(), live.algorithm)
        view, fresh = self.view.value(self.live.update(live, whole=done, stats=stats), done)
        return (self.chat_sent, view) if chat_due or fresh else None

    def end(self) -> None:
        self.view.end()


def column(live: render.Live | None, label: str, feed: render.LiveFeed) -> dict:
    """One compare column's live view: its tokens (the new ones) and its heading with the numbers so far."""
    label = html.escape(label)
    if live is None:
        return feed.update(None, head=f"<b>{label}</b>: waiting (runs second)")
    n = live.numbers()
    state = "done" if live.finished else "running"
    head = f"<b>{label}</b>: {n['wall_s']:.2f} s · {n['tokens']} tokens · {n['tokens_per_s']:.1f} tok/s ({state})"
    return feed.update(live, whole=live.finished is not None, head=head)


def live_view(elem_id: str, parts: tuple[str, ...], **initial: str) -> gr.HTML:
    """A live view: one component holding `parts` (of LIVE_PARTS' names, which also give their order), which the
    page updates from each update's LiveFeed (LIVE_JS): the token box and the chart appended to, the heading and stats
    replaced. In the chat tab (elem_id "live") the parts' ids are their names (#tokens, #stats, #chart); elsewhere the
    view's id and the part's."""
    prefix = "" if elem_id == "live" else f"{elem_id}-"
    chart = (
        f'<div class="chart-title">{render.CHART_TITLE}</div>'
        f'<div class="chart-legend"><span class="accepted">{render.CHART_ACCEPTED}</span>'
        f'<span class="emitted">{render.CHART_EMITTED}</span></div><svg viewBox="0 0 360 150"></svg>'
    )
    inside = {"head": "", "tokens": '<div class="tokens"></div>', "stats": "", "chart": chart}
    template = "".join(f'<div id="{prefix}{p}" class="live-{p}">{inside[p]}</div>' for p in LIVE_PARTS if p in parts)
    return gr.HTML(render.LiveFeed.empty(**initial), html_template=template, js_on_load=LIVE_JS, elem_id=elem_id)
