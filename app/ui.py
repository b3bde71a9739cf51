"""The Gradio app: its page (Chat, Compare and Pair tabs, the settings below them) and the /generate and /compare API
endpoints. Each tab is a module (chat_tab, compare_tab, pair_tab); what their events run is `handlers.Handlers`, how a
generation's views reach the page is `views`.

It only consumes what `usd` yields: `usd.stream`'s Rounds and Finished, turned into HTML by `render`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import gradio as gr

from usd.serve import Slots
from usd.settings import ALGORITHMS, DRAFT_TOKENS_MAX, MAX_NEW_TOKENS_MAX

from .chat_tab import chat_tab, wire_chat
from .compare_tab import compare_tab, wire_compare
from .endpoints import endpoint
from .handlers import DEFAULT, MODELS, ON_PAGE_LOAD, Handlers
from .live import Channels
from .pair_tab import pair_tab
from .pairs import Pairs
from .space import gpu, runs_elsewhere

if TYPE_CHECKING:
    from .v1 import AppService

DRAFT_CHOICES = ["auto"] + [str(k) for k in range(1, DRAFT_TOKENS_MAX + 1)]


@dataclass
class Page:
    """The app's Gradio page and what `launch` serves beside it on the same server."""

    demo: gr.Blocks
    live: Channels | None = None
    """The live views' update channel (app/live.py); None where the handlers run in another process."""
    service: AppService | None = None
    """The OpenAI-protocol routes (/v1) on the app's own pairs (app/v1.py); None for a front end to a server."""


def build(pairs: Pairs, slots: Slots | None = None, stream=None) -> Page:
    """The app's page, with its live views' channel."""
    channels = None if runs_elsewhere() else Channels()
    h = Handlers(pairs, slots, stream, channels)
    with gr.Blocks(title="usd-chat") as demo:
        gr.Markdown(
            "# usd-chat · universal speculative decoding\nThe drafter proposes, the target verifies: the "
            "answer is exactly the target's own, with every drafted token shown kept or thrown away."
        )
        header = gr.Markdown(pairs.describe(), elem_id="pair-header")
        chat = chat_tab()
        compare = compare_tab()
        pair_tab(demo, h, header)
        knobs = settings_panel()
        wire_chat(chat, h, knobs)
        wire_compare(compare, h, knobs)
        demo.load(pairs.describe, None, header, **ON_PAGE_LOAD)

        gr.api(gpu(endpoint(h.generate)), api_name="generate", concurrency_id=MODELS)
        gr.api(gpu(endpoint(h.compare)), api_name="compare", concurrency_id=MODELS)
    return Page(demo, channels)


def settings_panel() -> list:
    """The settings below the tabs (Chat and Compare both use them), in `settings()`'s order."""
    with gr.Accordion("Settings", open=False, elem_id="settings"):
        with gr.Row():
            algorithm = gr.Dropdown(
                list(ALGORITHMS),
                value=DEFAULT.algorithm,
                label="Algorithm",
                elem_id="algorithm",
                info="auto picks per round what is fastest here; none = the target alone",
            )
            draft = gr.Dropdown(DRAFT_CHOICES, value=DEFAULT.draft_tokens, label="Draft tokens (k)")
            max_new = gr.Number(
                DEFAULT.max_new_tokens,
                label="Max new tokens",
                precision=0,
                minimum=1,
                maximum=MAX_NEW_TOKENS_MAX,
                elem_id="max-new-tokens",
            )
        with gr.Row():
            temperature = gr.Slider(0, 2, value=DEFAULT.temperature, step=0.05, label="Temperature (0 = greedy)")
            top_p = gr.Slider(0.05, 1, value=DEFAULT.top_p, step=0.05, label="Top-p")
            top_k = gr.Number(DEFAULT.top_k, label="Top-k (0 = off)", precision=0, minimum=0)
            seed = gr.Textbox("", label="Seed (empty = random)", elem_id="seed")
    return [algorithm, draft, temperature, top_p, top_k, seed, max_new]
