"""`python -m openrlhf_tis.demo.prepare DIR`: write the demo's tiny model and prompts into DIR."""

from __future__ import annotations

import argparse

from openrlhf_tis.demo.tiny_model import build_tiny_model, write_arithmetic_prompts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--prompts", type=int, default=16, help="number of prompts to write")
    args = parser.parse_args(argv)
    model = build_tiny_model(f"{args.out_dir}/tiny_model")
    prompts = write_arithmetic_prompts(f"{args.out_dir}/prompts.jsonl", args.prompts)
    print(f"model: {model}\nprompts: {prompts}")


if __name__ == "__main__":
    main()
