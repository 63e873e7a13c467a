"""Rollout engines: precision (INT8 W8A8, FP8, FP32 head), calibration, engine-side re-quantization."""
