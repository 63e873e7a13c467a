"""The demo task: a tiny locally built model, arithmetic prompts and a rule-based reward."""
