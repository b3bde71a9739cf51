"""The Compare tab: the target alone, then speculative decoding, on one prompt with one seed, side by side."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from . import render
from .handlers import MODELS, Handlers
from .space import gpu
from .views import live_view


def compare_tab() -> SimpleNamespace:
    """The tab's components (the prompt, its button, the two columns and the summary)."""
    with gr.Tab("Compare", id="compare"):
        gr.Markdown(
            "Same prompt, same seed: the target alone, then speculative decoding with the settings "
            f"below. Run {render.COMPARE_ORDER}."
        )
        prompt = gr.Textbox(label="Prompt", lines=2, elem_id="compare-prompt")
        run = gr.Button("Compare", variant="primary", elem_id="compare-run")
        with gr.Row():
            plain = live_view("compare-plain", ("head", "tokens"), head="<b>plain target</b>")
            spec = live_view("compare-speculative", ("head", "tokens"), head="<b>speculative</b>")
        summary = gr.HTML("", elem_id="compare-summary")
    return SimpleNamespace(prompt=prompt, run=run, outputs=[plain, spec, summary])


def wire_compare(compare: SimpleNamespace, h: Handlers, knobs: list) -> None:
    compare.run.click(
        gpu(h.compare_ui),
        [compare.prompt, *knobs],
        compare.outputs,
        api_visibility="private",
        concurrency_id=MODELS,
        show_progress="hidden",
    )
