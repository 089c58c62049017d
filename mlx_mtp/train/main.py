"""``mlx-mtp train``: train a small hybrid model with its MTP head, fit an MTP head, or train
a DFlash block drafter.

Three modes:

* ``scratch``: a small Qwen3.5-architecture hybrid (Gated DeltaNet + gated
  attention, 3:1) trained with the next-token loss plus ``w`` times the MTP loss
  (predict t+2 from the trunk's post-norm hidden at t and token t+1), as the
  engine uses the head.
* ``head``: freeze an existing model and fit a new MTP head by self-distillation:
  the target for the head at position t is the frozen model's own next-token
  distribution at position t+1 (soft cross-entropy, i.e. KL up to a constant).
  Only ``mtp.*`` weights change.
* ``dflash``: freeze ``--model`` and train a DFlash block drafter for it (``train/dflash.py``),
  written in z-lab's layout to ``<out>/dflash`` (and ``--export-to``), for ``--draft-model``.

Data: the corpus is tokenized once (token ids cached as ``.npy`` in the run
directory); batches are random windows of ``seq_len + 1`` tokens drawn with a
per-step seeded RNG, so resuming replays the same stream.

Outputs under ``--out``: ``hf/`` (raw Hugging Face layout: ``mtp.*`` keys,
zero-centred (1+w) norms, HF conv1d axis order, nested ``text_config``) and
``mlx/`` (our parameter names, MLX conv layout, norms as applied), both with
tokenizer files and ``generation_config.json``; ``ckpt-*`` resumable training
checkpoints; ``metrics.jsonl``; ``loss.png``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional, Sequence

from mlx.utils import tree_flatten

from .codetasks import MIXES
from .data import _user_error, corpus_file_list
from .export import evaluate_acceptance, format_acceptance_table
from .model import SIZES, count_params
from .trainer import DTYPES, TrainConfig, Trainer


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def add_arguments(p):
    p.add_argument("--mode", choices=["scratch", "head", "dflash"], default="scratch",
                   help="scratch: train a small hybrid model + MTP head; head: freeze --model "
                        "and fit a new MTP head by self-distillation; dflash: freeze --model "
                        "and train a DFlash block drafter for it")
    p.add_argument("--model", default=None,
                   help="(head, dflash) the model to fit a head or a drafter for")
    p.add_argument("--corpus", default="stdlib",
                   help="'stdlib' (the CPython standard library's source, train split), a "
                        "directory of text files, or one file")
    p.add_argument("--eval-corpus", default=None,
                   help="held-out text for the eval loss (default: stdlib held-out split when "
                        "--corpus stdlib)")
    p.add_argument("--out", default="runs/train", help="run directory (checkpoints, exports)")
    p.add_argument("--size", choices=list(SIZES), default="demo", help="(scratch) model size preset")
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=None, dest="num_hidden_layers")
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--mtp-layers", type=int, default=1)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default 1e-3 scratch, 5e-4 head)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--mtp-loss-weight", type=float, default=0.5,
                   help="(scratch) weight of the MTP (t+2) loss")
    p.add_argument("--distill-temperature", type=float, default=1.0,
                   help="(head) temperature of the frozen model's target distribution")
    p.add_argument("--keep-head", action="store_true",
                   help="(head) start from the model's existing head instead of a fresh one")
    p.add_argument("--chat-fraction", type=float, default=0.2,
                   help="(stdlib corpus) fraction of files wrapped as chat turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", default=None, metavar="MODEL",
                   help="(scratch) start from this saved model's weights, fresh optimizer")
    p.add_argument("--copy-fraction", type=float, default=0.0,
                   help="fraction of batch rows drawn from copy documents (a snippet of the "
                        "corpus repeated or lightly edited, mlx_mtp.train.copydata)")
    p.add_argument("--copy-docs", type=int, default=4000,
                   help="with --copy-fraction: how many copy documents to build")
    p.add_argument("--copy-mix", choices=sorted(MIXES), default="copy",
                   help="with --copy-fraction: the copy rows' document kinds: copy (repeat or "
                        "edit given code, as the shipped copy fine-tune) or instruct (mostly "
                        "requests answered with new code: write a function from its summary, "
                        "complete a pasted signature; mlx_mtp.train.codetasks)")
    p.add_argument("--copy-context-weight", type=float, default=1.0,
                   help="(scratch) with --copy-fraction: loss weight of a copy document's "
                        "tokens before its answer (the code given and the request; 0 trains on "
                        "the answers only)")
    p.add_argument("--hard-weight", type=float, default=1.0,
                   help="(scratch) with --copy-fraction: a copy answer's tokens that repeat "
                        "the given code and that the model misses at top-1 weigh this many "
                        "times in the loss (mlx_mtp.train.hardmine; 1: off)")
    p.add_argument("--block-size", type=int, default=8,
                   help="(dflash) block positions per pass, the anchor's included")
    p.add_argument("--draft-layers", type=int, default=2, help="(dflash) drafter layers")
    p.add_argument("--target-layers", type=_layer_ids, default=None, metavar="I,J,..",
                   help="(dflash) trunk layers tapped, 0-based (default: three spread from "
                        "the second to the fourth-last)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="(dflash) the token filling the block after the anchor (default: the "
                        "vocabulary's last id)")
    p.add_argument("--anchors", type=int, default=8, help="(dflash) blocks per window")
    p.add_argument("--labels", choices=["trunk", "data"], default="trunk",
                   help="(dflash) train each slot on the frozen model's greedy pick there "
                        "(trunk: what greedy verification accepts) or on the text's token")
    p.add_argument("--loss-decay", type=float, default=0.0,
                   help="(dflash) slot j's loss weighs exp(-(j-1)/D); 0: all slots alike")
    p.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    p.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps")
    p.add_argument("--eval-every", type=int, default=200, help="held-out loss every N steps")
    p.add_argument("--export-every", type=int, default=0,
                   help="with --export-to: also export the model every N steps")
    p.add_argument("--export-to", default=None,
                   help="also write the final model (HF layout) to this directory")
    p.add_argument("--export-dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--no-compile", action="store_true", help="do not mx.compile the step")
    p.add_argument("--no-progress", action="store_true")


def _layer_ids(text: str):
    import argparse

    try:
        return tuple(int(i) for i in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, not {text!r}")


def config_from_args(args) -> TrainConfig:
    lr = args.lr if args.lr is not None else (5e-4 if args.mode == "head" else 1e-3)
    return TrainConfig(
        mode=args.mode, model=args.model, corpus=args.corpus, eval_corpus=args.eval_corpus,
        out=args.out, size=args.size, steps=args.steps, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=lr, warmup=args.warmup, weight_decay=args.weight_decay,
        mtp_loss_weight=args.mtp_loss_weight, mtp_layers=args.mtp_layers,
        distill_temperature=args.distill_temperature, chat_fraction=args.chat_fraction,
        seed=args.seed, resume=args.resume, save_every=args.save_every,
        eval_every=args.eval_every, export_every=args.export_every, export_to=args.export_to,
        export_dtype=args.export_dtype, compile=not args.no_compile,
        progress=not args.no_progress, hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers, intermediate_size=args.intermediate_size,
        keep_head=args.keep_head, init_from=args.init_from,
        copy_fraction=args.copy_fraction, copy_docs=args.copy_docs,
        copy_context_weight=args.copy_context_weight, copy_mix=args.copy_mix,
        hard_weight=args.hard_weight,
        block_size=args.block_size, draft_layers=args.draft_layers,
        target_layers=args.target_layers, mask_token_id=args.mask_token_id,
        anchors=args.anchors, labels=args.labels, loss_decay=args.loss_decay,
    )


def run(args) -> int:
    cfg = config_from_args(args)
    if cfg.mode != "scratch" and cfg.hidden_size is not None:
        raise _user_error("--hidden-size/--num-layers only apply to --mode scratch")
    trainer = Trainer(cfg)
    n_total = count_params(trainer.model)
    n_train = sum(v.size for _, v in tree_flatten(trainer.trainable()))
    print(f"mode={cfg.mode} params={n_total / 1e6:.2f}M trainable={n_train / 1e6:.2f}M "
          f"train tokens={len(trainer.train_tokens):,} out={trainer.run_dir}", file=sys.stderr)
    res = trainer.run()
    written = ({"drafter": str(trainer.run_dir / "dflash")} if cfg.mode == "dflash" else
               {"hf": str(trainer.run_dir / "hf"), "mlx": str(trainer.run_dir / "mlx")})
    print(json.dumps({"step": res["step"], "wall_seconds": round(res["wall_seconds"], 1),
                      **res["last"], **written, "loss_png": res["png"]}))
    return 0


def eval_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m mlx_mtp.train.main eval [--model PATH]``: per-position acceptance table."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m mlx_mtp.train.main eval")
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--ks", default="1,2,3")
    p.add_argument("--temps", default="0,0.7")
    p.add_argument("--n-prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout", default=None,
                   help="held-out text: a directory (its text files) or 'stdlib' (default: "
                        "the standard library's held-out split)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="applied to target and drafts alike (default 1: the head alone)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    files = None
    if a.heldout and a.heldout != "stdlib":
        files = corpus_file_list(a.heldout, "heldout")
    t0 = time.perf_counter()
    res = evaluate_acceptance(a.model, [int(k) for k in a.ks.split(",")],
                              [float(t) for t in a.temps.split(",")], a.n_prompts,
                              a.prompt_tokens, a.max_tokens, a.seed, files=files,
                              repetition_penalty=a.repetition_penalty)
    print(format_acceptance_table(res))
    print(f"({a.n_prompts} held-out prompts x {a.prompt_tokens} tokens, {a.max_tokens} new tokens "
          f"each; {time.perf_counter() - t0:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": res}, f, indent=2)
    return 0


if __name__ == "__main__":
    # ``python -m mlx_mtp.train.main eval ...``: acceptance on held-out code
    # (training itself runs as ``mlx-mtp train``).
    sys.exit(eval_main(sys.argv[2:] if sys.argv[1:2] == ["eval"] else sys.argv[1:]))
