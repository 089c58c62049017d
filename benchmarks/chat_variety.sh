#!/bin/sh
# Chat-turn variety of a model: the share of distinct word 3-grams in its greedy answers to
# eight chat prompts (96 tokens each, the model's defaults). 1.0: no phrase repeats; a loop
# of one line scores about 0.2.   Usage: sh benchmarks/chat_variety.sh [MODEL_DIR]
set -e
command -v mlx-mtp > /dev/null || { echo "mlx-mtp is not on PATH (activate the environment it is installed in)" >&2; exit 2; }
M=${1:-mlx_mtp/assets/demo-model}
for p in "def fibonacci(n):" "def add(a, b):" "class Stack:" "def read_lines(path):" \
         "Write the Python module \`stack\`." "import json" "Write a function that parses a date." \
         "What does this do? x = [i*i for i in range(10)]"; do
  mlx-mtp generate --model "$M" --prompt "$p" -m 96 2>/dev/null | awk '/^==========$/{n++; next} n==1'
  echo "@@@"
done | python3 -c "
import sys
answers = sys.stdin.read().split('@@@')[:-1]
shares = []
for a in answers:
    w = a.split()
    grams = [tuple(w[i:i + 3]) for i in range(len(w) - 2)]
    shares.append(len(set(grams)) / max(1, len(grams)))
print('$M: distinct word 3-grams, mean %.2f;' % (sum(shares) / len(shares)), [round(x, 2) for x in shares])
"
