"""Do the model's chat answers loop? (MODEL_CARD.md, *Copying*)

    python benchmarks/chat_variety.py [--model DIR] [--max-tokens 96]

Eight chat turns, each answered greedily with the model's own defaults (its
``generation_config.json``, e.g. the demo model's repetition penalty 1.3) and the CLI's
``--dtype auto``, as ``mlx-mtp generate`` answers them. Per answer: the share of its word 3-grams that are distinct (1.0:
no phrase repeats; one line in a loop scores about 0.2). Reported: each, and the mean.
"""

from __future__ import annotations

import argparse
import sys

from mlx_mtp.decode.generation import stream_generate
from mlx_mtp.decode.prompt import build_prompt, encode_prompt
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.models.io.loader import generation_defaults, load

PROMPTS = ("def fibonacci(n):", "def add(a, b):", "class Stack:", "def read_lines(path):",
           "Write the Python module `stack`.", "import json",
           "Write a function that parses a date.",
           "What does this do? x = [i*i for i in range(10)]")


def distinct_3grams(text: str) -> float:
    words = text.split()
    grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    return len(set(grams)) / max(1, len(grams))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--max-tokens", type=int, default=96)
    a = p.parse_args(argv)
    model, tok = load(a.model, dtype="auto")[:2]  # the CLI's weights (float32 on a CPU)
    penalty = generation_defaults(a.model).get("repetition_penalty", 1.0)
    shares = []
    for text in PROMPTS:
        prompt = encode_prompt(tok, build_prompt(tok, text))
        answer = "".join(r.text for r in stream_generate(
            model, tok, prompt, max_tokens=a.max_tokens,
            sampling=SamplingParams(repetition_penalty=penalty)))
        shares.append(distinct_3grams(answer))
        print(f"{shares[-1]:.2f}  {text!r}: {answer[:60]!r}")
    print(f"distinct word 3-grams: mean {sum(shares) / len(shares):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
