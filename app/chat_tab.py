"""The Chat tab: a chat with the loaded pair beside its live view (each drafted token kept or thrown away, the stats,
the chart)."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from usd.algorithms import Algorithm

from . import render
from .handlers import MODELS, Handlers
from .space import gpu
from .views import live_view


def chat_tab() -> SimpleNamespace:
    """The tab's components (the chat, its message box and buttons, the live view)."""
    with gr.Tab("Chat", id="chat"), gr.Row():
        with gr.Column(scale=3):
            chatbot = gr.Chatbot(label="Chat", height=420, elem_id="chatbot")
            # one line that grows: Gradio sends a one-line box on Enter, and Shift+Enter breaks the line
            box = gr.Textbox(
                label="Message",
                placeholder="Ask something, then press Enter or Send (Shift+Enter: a new line)",
                lines=1,
                max_lines=8,
                elem_id="message",
            )
            message = gr.State("")
            with gr.Row():
                send = gr.Button("Send", variant="primary", elem_id="send")
                stop = gr.Button("Stop", variant="stop", elem_id="stop")
                clear = gr.Button("Clear chat", elem_id="clear")
        with gr.Column(scale=2):
            gr.HTML(render.legend_html())
            live = live_view("live", ("tokens", "stats", "chart"), stats=render.stats_html({}, Algorithm.AUTO))
    return SimpleNamespace(
        chatbot=chatbot,
        box=box,
        message=message,
        live=live,
        send=send,
        stop=stop,
        clear=clear,
        outputs=[chatbot, live],
    )


def wire_chat(chat: SimpleNamespace, h: Handlers, knobs: list) -> None:
    """The tab's events: a message sent (Send or Enter) and answered, Stop, Clear."""
    # Every event that runs the models shares one concurrency group: the queue's limit counts them together.
    for trigger in (chat.send.click, chat.box.submit):
        # No progress shown on the box either: Gradio's loader, once shown there, animated on (detached from the
        # page, a frame at every animation tick) until the answer ended.
        taken = trigger(
            h.chat_take,
            chat.box,
            [chat.box, chat.message],
            api_visibility="private",
            concurrency_limit=None,
            show_progress="hidden",
        )
        answered = taken.success(
            gpu(h.chat_send),
            [chat.message, chat.chatbot, *knobs],
            chat.outputs,
            api_visibility="private",
            concurrency_id=MODELS,
            show_progress="hidden",  # its animation redraws the page all along the answer (the views show progress)
        )
        # a message that could not be answered (a bad setting, a prompt too long) goes back into the box
        answered.failure(
            lambda m: m,
            chat.message,
            chat.box,
            api_visibility="private",
            concurrency_limit=None,
            show_progress="hidden",
        )
    chat.stop.click(h.chat_stop, None, None, concurrency_limit=None, api_visibility="private")
    chat.clear.click(
        lambda: ([], render.LiveFeed.empty(stats=render.stats_html({}, Algorithm.AUTO))),
        None,
        chat.outputs,
        api_visibility="private",
        concurrency_limit=None,
        show_progress="hidden",
    )
