"""The training loop behind `mlx-mtp train` (scratch models, MTP heads and DFlash drafters);
see train/main.py."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from .data import (
    TOKENIZER_DIR,
    _load_tokenizer, _user_error, corpus_file_list, load_or_build_copy,
    load_or_tokenize, sample_batch,
)
from .export import (
    _full_config, load_checkpoint, plot_loss_curve, read_metrics, save_checkpoint, save_model,
)


from ..errors import CheckpointError
from .copydata import mixed_batch
from .model import (
    build_scratch_model, head_loss, head_targets, scratch_losses,
    text_config,
)


# --------------------------------------------------------------------------
# Training loop
# --------------------------------------------------------------------------


@dataclass
class TrainConfig:
    mode: str = "scratch"
    model: Optional[str] = None
    corpus: str = "stdlib"
    eval_corpus: Optional[str] = None
    out: str = "runs/train"
    size: str = "demo"
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    mtp_loss_weight: float = 0.5
    mtp_layers: int = 1
    distill_temperature: float = 1.0
    chat_fraction: float = 0.2
    seed: int = 0
    resume: bool = False
    save_every: int = 200
    eval_every: int = 200
    eval_batches: int = 4
    export_every: int = 0
    export_to: Optional[str] = None
    export_dtype: str = "float32"
    compile: bool = True
    progress: bool = True
    hidden_size: Optional[int] = None
    num_hidden_layers: Optional[int] = None
    intermediate_size: Optional[int] = None
    keep_head: bool = False
    init_from: Optional[str] = None
    copy_fraction: float = 0.0
    copy_docs: int = 4000
    copy_mix: str = "copy"  # document kinds of the copy rows (train/codetasks.py MIXES)
    copy_context_weight: float = 1.0
    hard_weight: float = 1.0  # copyable copy tokens missed at top-1 weigh this (hardmine.py)
    # dflash mode (train/dflash.py)
    block_size: int = 8
    draft_layers: int = 2
    target_layers: Optional[Tuple[int, ...]] = None  # None: dflash.default_taps
    mask_token_id: Optional[int] = None  # None: the vocabulary's last id
    anchors: int = 8  # blocks per window
    labels: str = "trunk"  # dflash.LABELS
    loss_decay: float = 0.0  # slot j weighs exp(-(j-1)/decay); 0: all slots alike


DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
# what each mode logs beside its total loss (the step's two auxiliary values)
AUX_NAMES = {"scratch": ("loss", "mtp_loss"), "head": ("kl", "soft_ce"),
             "dflash": ("ce", "slot1_acc")}


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        if cfg.mode not in AUX_NAMES:
            raise _user_error(f"--mode must be one of {', '.join(AUX_NAMES)} (got {cfg.mode!r})")
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(cfg, name) < 1:
                raise _user_error(f"--{name.replace('_', '-')} must be >= 1")
        if cfg.seq_len < 3:
            raise _user_error("--seq-len must be >= 3 (the MTP loss needs t+2)")
        if cfg.export_dtype not in DTYPES:
            raise _user_error(f"--export-dtype must be one of {', '.join(DTYPES)}")
        self.run_dir = Path(cfg.out).expanduser()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        if cfg.mode == "scratch":
            self._setup_scratch()
        elif cfg.mode == "head":
            self._setup_head()
        else:
            self._setup_dflash()
        self._setup_data()
        self._setup_optimizer()

    # -- setup -------------------------------------------------------------
    def _setup_scratch(self):
        cfg = self.cfg
        self.tokenizer_dir = TOKENIZER_DIR
        vocab = _load_tokenizer(TOKENIZER_DIR).get_vocab_size()
        self.text_cfg = text_config(cfg.size, vocab_size=vocab, mtp_layers=cfg.mtp_layers,
                                    hidden_size=cfg.hidden_size,
                                    num_hidden_layers=cfg.num_hidden_layers,
                                    intermediate_size=cfg.intermediate_size)
        if cfg.hidden_size is not None and "head_dim" in self.text_cfg:
            pass  # head dims stay as the preset's
        self.config = _full_config(None, self.text_cfg)
        self.model = build_scratch_model(self.text_cfg, cfg.seed)
        if cfg.init_from:
            self._init_weights(cfg.init_from)
        self.model.train()

    def _init_weights(self, source: str):
        """Start from a saved model of the same shape (e.g. the shipped demo model),
        with a fresh optimizer: continued training when only the export survives."""
        from ..models.io.loader import ModelLoadError, load_model

        try:
            saved, _ = load_model(source, mtp=True, dtype=mx.float32)
        except ModelLoadError as e:
            raise _user_error(f"--init-from: {e}")
        mine = dict(tree_flatten(self.model.parameters()))
        theirs = dict(tree_flatten(saved.parameters()))
        if mine.keys() != theirs.keys() or any(mine[k].shape != theirs[k].shape for k in mine):
            raise _user_error(f"--init-from {source}: its shape differs from --size "
                              f"{self.cfg.size} (same preset and overrides needed)")
        self.model.load_weights(list(theirs.items()))
        mx.eval(self.model.parameters())

    def _setup_head(self):
        from ..models.io.loader import ModelLoadError, load_config, load_model, resolve_model_path
        from ..models.blocks.hybrid import MTPHead

        cfg = self.cfg
        if not cfg.model:
            raise _user_error("--mode head needs --model PATH (the model to fit a head for)")
        try:
            path = resolve_model_path(cfg.model)
            model, config = load_model(path, mtp=False)
        except ModelLoadError as e:
            raise _user_error(str(e))
        self.source = path
        self.tokenizer_dir = path if (path / "tokenizer.json").exists() else TOKENIZER_DIR
        text = model.text
        n = cfg.mtp_layers
        text.args.mtp_num_hidden_layers = n
        mx.random.seed(cfg.seed)
        text.mtp = MTPHead(text.args)
        if cfg.keep_head:
            try:
                with_head, _ = load_model(path, mtp=True)
                text.mtp.update(with_head.text.mtp.parameters())
            except Exception as e:  # noqa: BLE001
                raise _user_error(f"--keep-head: the model's own head could not be loaded: {e}")
        # Train the head in float32 whatever the trunk's dtype.
        text.mtp.set_dtype(mx.float32)
        model.freeze()
        text.mtp.unfreeze()
        model.eval()
        self.model = model
        config = json.loads(json.dumps(load_config(path)))
        tc = config.get("text_config", config)
        if config.get("model_type") == "qwen3_next":
            tc["num_nextn_predict_layers"] = n
        else:
            tc["mtp_num_hidden_layers"] = n
            tc["mtp_use_dedicated_embeddings"] = False
        self.config = config
        self.text_cfg = tc
        self.frozen = {k: v for k, v in tree_flatten(model.parameters()) if not k.startswith(
            ("mtp.", "language_model.mtp."))}

    def _setup_dflash(self):
        """The frozen ``--model`` and a fresh drafter (``self.model``: what trains, is
        checkpointed and resumed)."""
        from ..drafters.block.load import check_fits
        from . import dflash

        if self.cfg.copy_fraction:
            raise _user_error("--copy-fraction applies to --mode scratch and head, not dflash")
        self._load_frozen_target()
        try:
            self.config = dflash.drafter_config_for(self.cfg, self.text_cfg)
            self.model = dflash.build_drafter(self.config, self.cfg.seed)
            self.dflash_loss = dflash.DFlashLoss(self.target, self.model, self.cfg.labels,
                                                 self.cfg.loss_decay)
            check_fits(self.model, self.target, "--mode dflash")
        except (ValueError, CheckpointError) as e:
            raise _user_error(f"--mode dflash: {e}")
        self.model.train()

    def _load_frozen_target(self):
        from ..models.io.loader import ModelLoadError, load_config, load_model, resolve_model_path

        if not self.cfg.model:
            raise _user_error(f"--mode {self.cfg.mode} needs --model PATH (the model to train "
                              "for)")
        try:
            path = resolve_model_path(self.cfg.model)
            self.target, _ = load_model(path, mtp=False, dtype=mx.float32)
        except ModelLoadError as e:
            raise _user_error(str(e))
        self.target.freeze()
        self.target.eval()
        self.tokenizer_dir = path if (path / "tokenizer.json").exists() else TOKENIZER_DIR
        config = load_config(path)
        self.text_cfg = config.get("text_config", config)

    def _setup_data(self):
        cfg = self.cfg
        files = corpus_file_list(cfg.corpus, "train")
        chat = cfg.chat_fraction if cfg.corpus == "stdlib" else 0.0
        self.train_tokens = load_or_tokenize(self.run_dir, "train", files, self.tokenizer_dir,
                                             chat, cfg.seed)
        if cfg.eval_corpus:
            efiles = corpus_file_list(cfg.eval_corpus, "heldout")
        elif cfg.corpus == "stdlib":
            efiles = corpus_file_list("stdlib", "heldout")
        else:
            efiles = []
        self.eval_tokens = (load_or_tokenize(self.run_dir, "eval", efiles, self.tokenizer_dir)
                            if efiles else None)
        if not 0.0 <= cfg.copy_fraction <= 1.0:
            raise _user_error("--copy-fraction must be between 0 and 1")
        if cfg.copy_context_weight < 0:
            raise _user_error("--copy-context-weight must be >= 0")
        if cfg.hard_weight < 1:
            raise _user_error("--hard-weight must be >= 1")
        self.copy_tokens = self.copy_starts = self.copy_answer = None
        self.copyable = None
        if cfg.copy_fraction > 0:
            self.copy_tokens, self.copy_starts, self.copy_answer = load_or_build_copy(
                self.run_dir, files, self.tokenizer_dir, cfg.copy_docs, cfg.seed, cfg.copy_mix)
            if cfg.hard_weight != 1 and cfg.mode == "scratch":
                from .hardmine import copyable_flags

                self.copyable = copyable_flags(self.copy_tokens, self.copy_starts,
                                               self.copy_answer)
        if self.eval_tokens is not None and len(self.eval_tokens) <= cfg.seq_len + 1:
            self.eval_tokens = None
        vocab = self.text_cfg["vocab_size"]
        if len(self.train_tokens) and int(self.train_tokens.max()) >= vocab:
            raise _user_error(f"tokenizer ids exceed the model's vocab_size {vocab}")

    def _setup_optimizer(self):
        cfg = self.cfg
        warm = min(cfg.warmup, max(1, cfg.steps // 10))
        decay_steps = max(1, cfg.steps - warm)
        sched = optim.join_schedules(
            [optim.linear_schedule(cfg.lr * 0.01, cfg.lr, warm),
             optim.cosine_decay(cfg.lr, decay_steps, cfg.lr * cfg.min_lr_ratio)],
            [warm])
        self.optimizer = optim.AdamW(learning_rate=sched, betas=[0.9, 0.95],
                                     weight_decay=cfg.weight_decay)
        self.step = 0
        self.wall = 0.0
        if cfg.resume:
            meta = load_checkpoint(self.run_dir, self.model, self.optimizer)
            if meta is not None:
                self.step = meta["step"]
                self.wall = meta.get("wall_seconds", 0.0)
                # Drop metrics logged after the checkpoint (they will be redone).
                rows = [r for r in read_metrics(self.metrics_path) if r.get("step", 0) <= self.step]
                with open(self.metrics_path, "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)
        else:
            # A fresh run starts a fresh metrics log.
            if self.metrics_path.exists():
                self.metrics_path.unlink()
        self.optimizer.init(self.trainable())

    def trainable(self):
        return self.model.trainable_parameters()

    # -- steps -------------------------------------------------------------
    def _batch(self):
        """(tokens, per-token loss weights), both (batch_size, seq_len + 1); dflash: (tokens,
        anchors (batch_size, anchors))."""
        cfg = self.cfg
        if cfg.mode == "dflash":
            from .dflash import sample_anchors

            rows = sample_batch(self.train_tokens, cfg.batch_size, cfg.seq_len + 1, cfg.seed,
                                self.step)
            return rows, sample_anchors(cfg.batch_size, cfg.seq_len + 1, cfg.block_size,
                                        cfg.anchors, cfg.seed, self.step)
        if self.copy_tokens is None:
            rows = sample_batch(self.train_tokens, cfg.batch_size, cfg.seq_len + 1, cfg.seed,
                                self.step)
            return rows, np.ones(rows.shape, np.float32)
        rows, weights, hard = mixed_batch(
            self.train_tokens, self.copy_tokens, self.copy_starts, cfg.copy_fraction,
            cfg.batch_size, cfg.seq_len + 1, cfg.seed, self.step, self.copy_answer,
            cfg.copy_context_weight, self.copyable)
        # the hard-token flags only when weighed (hardmine.py), so other runs step as before
        return (rows, weights) if self.copyable is None else (rows, weights, hard)

    def _make_step(self):
        cfg = self.cfg
        model, opt = self.model, self.optimizer
        w = cfg.mtp_loss_weight

        if cfg.mode == "scratch":
            def loss_fn(batch, weights, hard=None):
                ce, mtp_ce = scratch_losses(model, batch, weights, hard, cfg.hard_weight)
                return ce + w * mtp_ce, (ce, mtp_ce)
        elif cfg.mode == "dflash":
            def loss_fn(batch, anchors):
                ce, acc = self.dflash_loss(batch, anchors)
                return ce, (ce, acc)
        else:
            T = cfg.distill_temperature

            def loss_fn(batch, weights):
                del weights  # distillation weighs every position alike
                h, target_lp = head_targets(model, batch, T)
                soft_ce, kl = head_loss(model, h, batch[:, 1:], target_lp)
                return soft_ce, (kl, soft_ce)

        vg = nn.value_and_grad(model, loss_fn)

        def step(*arrays):  # (batch, weights or anchors[, hard-token flags])
            (loss, aux), grads = vg(*arrays)
            if cfg.grad_clip > 0:
                grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
            opt.update(model, grads)
            return loss, aux[0], aux[1]

        if cfg.compile and cfg.mode != "dflash":  # anchors are Python positions: traced anew
            state = [model.state, opt.state]
            step = mx.compile(step, inputs=state, outputs=state)
        return step

    def eval_losses(self, n_batches: Optional[int] = None) -> Optional[dict]:
        if self.eval_tokens is None:
            return None
        cfg = self.cfg
        n = n_batches or cfg.eval_batches
        tot = np.zeros(2)
        for i in range(n):
            b = mx.array(sample_batch(self.eval_tokens, cfg.batch_size, cfg.seq_len + 1,
                                      cfg.seed + 7919, i))
            if cfg.mode == "scratch":
                ce, mtp_ce = scratch_losses(self.model, b)
                mx.eval(ce, mtp_ce)
                tot += [ce.item(), mtp_ce.item()]
            elif cfg.mode == "dflash":
                from .dflash import sample_anchors

                anchors = sample_anchors(cfg.batch_size, cfg.seq_len + 1, cfg.block_size,
                                         cfg.anchors, cfg.seed + 7919, i)
                tot += [v.item() for v in self.dflash_loss(b, anchors)]
            else:
                h, t = head_targets(self.model, b, cfg.distill_temperature)
                soft, kl = head_loss(self.model, h, b[:, 1:], t)
                mx.eval(soft, kl)
                tot += [kl.item(), soft.item()]
        tot /= n
        return dict(zip(AUX_NAMES[cfg.mode], map(float, tot)))

    def _log(self, row: dict):
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def checkpoint(self):
        meta = {"wall_seconds": self.wall, "config": self.cfg.__dict__}
        save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, meta)

    def export(self, out_dir: Optional[Path] = None, dtype=None):
        """Save the model in both layouts under ``out_dir`` (default: the run dir)."""
        out_dir = Path(out_dir) if out_dir else self.run_dir
        dtype = dtype or DTYPES[self.cfg.export_dtype]
        if self.cfg.mode == "dflash":
            self.export_demo(out_dir / "dflash", dtype)
            return out_dir
        self.model.eval()
        save_model(self.model, self.config, out_dir / "hf", "hf", dtype, self.tokenizer_dir)
        save_model(self.model, self.config, out_dir / "mlx", "mlx", dtype, self.tokenizer_dir)
        if self.cfg.mode == "scratch":
            self.model.train()
        return out_dir

    def export_demo(self, target: Path, dtype=None):
        """Write the HF-layout model to ``target`` (e.g. the package's demo model)."""
        dtype = dtype or DTYPES[self.cfg.export_dtype]
        info = {"step": self.step, "wall_seconds": round(self.wall, 1),
                "train_config": {k: v for k, v in self.cfg.__dict__.items()}}
        if self.cfg.mode == "dflash":
            from .dflash import export_drafter

            export_drafter(self.model, self.config, Path(target), dtype,
                           {"training_info.json": json.dumps(info, indent=2) + "\n"})
            return
        self.model.eval()
        save_model(self.model, self.config, Path(target), "hf", dtype, self.tokenizer_dir,
                   extra_files={"training_info.json": json.dumps(info, indent=2) + "\n"})
        if self.cfg.mode == "scratch":
            self.model.train()

    def run(self) -> dict:
        cfg = self.cfg
        step_fn = self._make_step()
        tokens_per_step = cfg.batch_size * cfg.seq_len
        bar = None
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.step, desc=f"train[{cfg.mode}]",
                       dynamic_ncols=True, mininterval=1.0, file=sys.stderr)
        last_save = time.perf_counter()
        ema = None
        last = {}
        while self.step < cfg.steps:
            t0 = time.perf_counter()
            loss, a, b = step_fn(*map(mx.array, self._batch()))
            mx.eval(loss, a, b, self.model.state, self.optimizer.state)
            dt = time.perf_counter() - t0
            self.wall += dt
            self.step += 1
            loss_v = loss.item()
            if not math.isfinite(loss_v):
                raise RuntimeError(f"loss became {loss_v} at step {self.step}; lower --lr")
            last = dict(zip(AUX_NAMES[cfg.mode], (a.item(), b.item())))
            ema = loss_v if ema is None else 0.95 * ema + 0.05 * loss_v
            lr = float(self.optimizer.learning_rate.item())
            self._log(dict(kind="train", step=self.step, total=loss_v, lr=lr,
                           tok_s=tokens_per_step / dt, wall=round(self.wall, 2), **last))
            if bar is not None:
                bar.update(1)
                bar.set_postfix({**{k: f"{v:.3f}" for k, v in last.items()},
                                 "tok/s": f"{tokens_per_step / dt:.0f}"}, refresh=False)
            done = self.step >= cfg.steps
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or done):
                ev = self.eval_losses()
                if ev is not None:
                    self._log(dict(kind="eval", step=self.step, wall=round(self.wall, 2), **ev))
                    msg = " ".join(f"{k}={v:.3f}" for k, v in ev.items())
                    (bar.write if bar is not None else print)(
                        f"step {self.step}: held-out {msg} ({self.wall / 60:.1f} min)")
            if cfg.save_every and (self.step % cfg.save_every == 0) and not done:
                self.checkpoint()
                last_save = time.perf_counter()
            if cfg.export_every and cfg.export_to and self.step % cfg.export_every == 0 \
                    and not done:
                self.export_demo(Path(cfg.export_to))
        if bar is not None:
            bar.close()
        self.checkpoint()
        self.export()
        if cfg.export_to:
            self.export_demo(Path(cfg.export_to))
        png = plot_loss_curve(self.metrics_path, self.run_dir / "loss.png",
                              title=f"mlx-mtp train --mode {cfg.mode}")
        del last_save
        return {"step": self.step, "wall_seconds": self.wall, "last": last, "png": str(png)}
