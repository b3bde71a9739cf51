"""The Pair tab's "Rank drafters for this target": `usd suggest` in the UI. A table and a bar chart of the expected
speedups, progress while it measures, and a pick + load button that loads the chosen pair. The numbers are cached per
(target, drafter, prompt set, machine) by usd.suggest, so a second ranking is instant."""

from __future__ import annotations

import gradio as gr
import pandas as pd

from usd import suggest

from .render import fmt
from .space import gpu

COLUMNS = [
    "#",
    "drafter",
    "family",
    "tokenizer",
    "shared % of target",
    "tli ceiling",
    "alpha tli",
    "alpha slem",
    "alpha standard",
    "c",
    "best",
    "expected speedup",
    "tokens",
    "note",
]
PROMPTS = "code"


def table(report: dict) -> pd.DataFrame:
    rows = []
    for i, r in enumerate(report["rows"], 1):
        algos = r.get("algorithms", {})
        alpha = {a: ("n/a" if c["alpha"] is None else f"{c['alpha']:.2f}") for a, c in algos.items()}
        rows.append(
            [
                i,
                r["drafter"],
                r.get("family", ""),
                r.get("tokenizer", ""),
                fmt(r.get("shared_pct_target"), ".1f", missing="-"),
                fmt(r.get("alpha_ceiling"), ".0%", missing="-"),
                alpha.get("tli", "-"),
                alpha.get("slem", "-"),
                alpha.get("standard", "-"),
                fmt(r.get("c"), ".2f", missing="-"),
                f"{r['best_algorithm']} k={r['best_k']}" if r.get("best_algorithm") else "-",
                fmt(r["expected_speedup"], ".2f", missing="-"),
                sum(c.get("tokens", 0) for c in algos.values()) or "-",
                r["note"],
            ]
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def chart(report: dict) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"drafter": r["drafter"], "expected speedup": r["expected_speedup"]}
            for r in report["rows"]
            if r["expected_speedup"] is not None
        ]
    )


def rank_drafters(h, t_choice, t_free="", progress=gr.Progress()):  # noqa: B008
    """(table, chart, pick, message): every drafter on this machine, measured against the chosen target."""
    pairs = h.pairs
    target_spec = h.spec_of(t_choice, t_free)
    try:
        target = pairs.entry(target_spec, "target").name
    except Exception as e:  # an unknown target or one the Space does not serve: say so
        return None, None, gr.update(choices=[], value=None), f"⚠ {e}"
    drafters = [n for n in suggest.candidates(pairs.catalog, target) if n in pairs.allowed]
    if not drafters:
        return None, None, gr.update(choices=[], value=None), "⚠ no drafter is on this machine to rank"
    loaded = {}
    if pairs.pair is not None and pairs.loaded is not None:  # reuse what is in memory
        p = pairs.pair
        for name, model, tok in (
            (pairs.loaded.target, p.target, p.target_tokenizer),
            (pairs.loaded.drafter, p.drafter, p.drafter_tokenizer),
        ):
            if model is not None and name in pairs.catalog:
                loaded[name] = suggest.Model(name, model, tok, pairs.catalog.get(name).family)
    load = suggest.loader(pairs.catalog, pairs.device, pairs.precision, loaded=loaded)
    on = suggest.prompt_set(PROMPTS)
    prompts = on.prompts

    def stage(fraction, msg):  # the stages only: a drafter's measurement lines stay out of the bar
        if fraction is not None:
            progress(fraction, desc=msg)

    report = suggest.suggest(target, drafters, load, on, precision=pairs.precision, progress=stage)
    best = next((r for r in report["rows"] if not r.get("plain")), None)
    runnable = [r["drafter"] for r in report["rows"] if not r.get("plain") and r["expected_speedup"] is not None]
    message = (
        f"Ranked {len(drafters)} drafter(s) for `{target}` on {len(prompts)} {PROMPTS} prompts "
        f"({report['machine']}). Expected speedup = tau(alpha, k) / (k c + v(k)) at the best k; plain decoding "
        "is 1.00x."
    )
    if best is not None and best["expected_speedup"] is not None and best["expected_speedup"] < 1:
        message += " No drafter beats plain decoding on this machine."
    return (table(report), chart(report), gr.update(choices=runnable, value=runnable[0] if runnable else None), message)


def rank_section(h, pair_inputs: list, status, header, models_group: str) -> None:
    """The ranking's widgets and events, under the Pair tab's load button. `pair_inputs` is the tab's
    [target pick, drafter pick, target free text, drafter free text]."""
    t_pick, d_pick, t_free, d_free = pair_inputs
    with gr.Accordion("Rank drafters for this target", open=False, elem_id="rank"):
        gr.Markdown(
            "Measures every drafter on this machine against the chosen target (the target answers a few "
            "short code prompts once; each drafter replays them), then ranks them by the speedup the cost "
            "model expects. Cached per target, drafter, prompts and machine."
        )
        run = gr.Button("Rank drafters for this target", elem_id="rank-run")
        message = gr.Markdown(elem_id="rank-status")
        result = gr.Dataframe(headers=COLUMNS, interactive=False, wrap=True, elem_id="rank-table")
        bars = gr.BarPlot(
            None,
            x="drafter",
            y="expected speedup",
            height=220,
            y_lim=[0, None],  # from zero, so a bar's length is its speedup
            sort="-y",  # in the ranking's order
            label="Expected speedup (1 = plain)",
            elem_id="rank-chart",
        )
        with gr.Row():
            pick = gr.Dropdown([], label="Drafter to load with this target", elem_id="rank-pick")
            load = gr.Button("Load this pair", variant="primary", elem_id="rank-load")

    def ranked(t_choice, t_text, progress=gr.Progress()):  # noqa: B008
        return rank_drafters(h, t_choice, t_text, progress)

    run.click(
        gpu(ranked),
        [t_pick, t_free],
        [result, bars, pick, message],
        api_visibility="private",
        concurrency_id=models_group,
    )
    load.click(
        lambda d: (d, "") if d else (gr.skip(), gr.skip()), pick, [d_pick, d_free], api_visibility="private"
    ).then(h.load, pair_inputs, [status, header], api_visibility="private", concurrency_id=models_group)
