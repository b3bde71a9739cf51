"""The Pair tab: a target and a drafter from any family, what they would cost before loading, the load, and the
drafters ranked for a target (app/suggest_ui.py)."""

from __future__ import annotations

import gradio as gr

from .handlers import MODELS, ON_PAGE_LOAD, Handlers
from .pairs import NO_DRAFTER
from .suggest_ui import rank_section


def pair_tab(demo: gr.Blocks, h: Handlers, header: gr.Markdown) -> None:
    """The tab, its events wired: choosing a pair (its numbers before loading), loading it, ranking drafters."""
    pairs = h.pairs
    names = pairs.allowed  # in Space mode only what the Space serves: offering the rest would only fail on load
    suggested = {
        f"{p.target} ← {p.drafter}: {p.why}": (p.target, p.drafter)
        for p in pairs.catalog.pairs
        if p.target in names and p.drafter in names
    }
    loaded = pairs.loaded or pairs.catalog.default
    with gr.Tab("Pair", id="pair"):
        gr.Markdown(
            "Choose a target and a drafter from any family; the numbers below are known before loading. A drafter "
            "model is optional: `ngram` drafts by looking up the conversation, with any target."
        )
        with gr.Row():
            t_pick = gr.Dropdown(names, value=loaded.target, label="Target")
            d_pick = gr.Dropdown([NO_DRAFTER, *names], value=loaded.drafter, label="Drafter")
        with gr.Row(visible=not pairs.space_mode):
            t_free = gr.Textbox(label="…or a target hub id / local path", placeholder="owner/name or /path")
            d_free = gr.Textbox(label="…or a drafter hub id / local path", placeholder="owner/name or /path")
        if suggested:
            pick = gr.Dropdown(list(suggested), value=None, label="Suggested pairs")
            pick.change(
                lambda k: suggested.get(k, (gr.skip(), gr.skip())), pick, [t_pick, d_pick], api_visibility="private"
            )
        info = gr.Markdown(elem_id="pair-preview")
        load_btn = gr.Button("Load pair", variant="primary", elem_id="load")
        status = gr.Markdown(elem_id="load-status")
        pair_inputs = [t_pick, d_pick, t_free, d_free]
        for c in pair_inputs:
            c.change(h.preview, pair_inputs, info, api_visibility="private", concurrency_limit=None)
        load_btn.click(h.load, pair_inputs, [status, header], api_visibility="private", concurrency_id=MODELS)
        rank_section(h, pair_inputs, status, header, MODELS)
        demo.load(h.preview, pair_inputs, info, **ON_PAGE_LOAD)
