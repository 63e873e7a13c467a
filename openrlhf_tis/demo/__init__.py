"""The demo: the embedded SmolLM2-135M-Instruct or a tiny random model, the arithmetic task, rule-based rewards."""
