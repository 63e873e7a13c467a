"""Notebook pipelines: one training job from a notebook (train, live), papermill execution and HTML export
(execute), what the notebooks show (report), grids of runs (sweep), and the notebooks themselves generated from
code (notebooks); their parameter checks are the bottom layer's (openrlhf_tis.params)."""
