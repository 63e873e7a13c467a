"""`python -m openrlhf_tis.demo.prepare DIR [--model default|tiny]`: the main job's model and task files.

Writes the demo task (task.py) as DIR/train.jsonl and DIR/eval.jsonl (held-out) and prints the model
directory as the last line on stdout (progress goes to stderr), so a script can capture it. `default`
is the embedded SmolLM2-135M-Instruct (built once from its PyPI wheel, see default_model.py), `tiny` a
random 2-layer Qwen2 that starts in seconds (what the tests use).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from openrlhf_tis.demo.default_model import default_model_dir, ensure_default_model
from openrlhf_tis.demo.task import write_task
from openrlhf_tis.demo.tiny_model import build_tiny_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", choices=("default", "tiny"), default="default",
                        help="default: SmolLM2-135M-Instruct; tiny: a random 2-layer model")
    parser.add_argument("--eval_prompts", type=int, default=64, help="held-out questions (the rest are for training)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/held-out split")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    if args.model == "tiny":
        model = out / "tiny_model"
        if not (model / "config.json").is_file():
            build_tiny_model(model)
    else:
        model = ensure_default_model(default_model_dir())
    train, held_out = write_task(out, args.eval_prompts, args.seed)
    print(f"task: {train} (train), {held_out} (held-out)", file=sys.stderr)
    print(model)


if __name__ == "__main__":
    main()
