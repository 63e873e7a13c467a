"""The off-policy dose–response study: the main job's recipe over a grid of rollout precisions, corrections
and seeds (dose_response.py), run as a resumable sweep, reported as tables and one figure (docs/study.md)."""
