"""Plots and ipywidgets explorers the notebooks call (notebooks stay thin; the logic is tested here).

curves.py: one run's training and mismatch curves; compare.py: several runs overlaid, their final table
and configuration differences; token_html.py / explorer.py: the per-token mismatch explorer.
"""
