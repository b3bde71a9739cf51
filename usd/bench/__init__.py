"""Measuring the decoder, beside it rather than inside it: nothing in the decode core imports this package.

- run: `usd bench`, every algorithm side by side on the same prompts (`python -m usd.bench` runs it too)
- report: a result's Markdown table, row labels and per-pair figure names
- plots: `usd bench --plot`'s figures (`python -m usd.bench.plots BENCH.json OUT.png` redraws a saved result)
- projection: `usd project`, the speedup to expect on profiled hardware

Imports run one way: run uses plots and report, plots uses report, and projection stands alone.
"""
