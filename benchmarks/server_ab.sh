#!/bin/bash
# Build the model first: python -c "from mlx_mtp.testing.tiny import make_tiny; make_tiny('/tmp/srv_oracle', 'qwen3_5', 'oracle', trunk_scale=0.1, vocab_size=4096, hidden=512, num_layers=8)"
# Example: PASSES=3 benchmarks/server_ab.sh auto out_openblas 1,4,8,16
# usage: server_ab.sh BLAS(auto|reference) OUT CONC [extra serve args]; env PASSES, MODEL
set -u  # needs mlx-mtp on PATH (an activated venv)
BLAS=$1; OUT=$2; CONC=$3; shift 3
pkill -f "serve --model ${MODEL:-/tmp/srv_oracle}"; while pgrep -f "serve --model ${MODEL:-/tmp/srv_oracle}" >/dev/null; do sleep 0.5; done
# one at a time, so the MTP server's start-up calibration runs on an otherwise idle machine
MLX_MTP_BLAS=$BLAS mlx-mtp serve --model ${MODEL:-/tmp/srv_oracle} --port 18202 --no-mtp --log-level INFO "$@" > $OUT.nomtp.log 2>&1 &
sleep 8
MLX_MTP_BLAS=$BLAS mlx-mtp serve --model ${MODEL:-/tmp/srv_oracle} --port 18201 --log-level INFO "$@" > $OUT.mtp.log 2>&1 &
until grep -q "calibrated" $OUT.mtp.log; do sleep 1; done
grep -q "error" $OUT.mtp.log $OUT.nomtp.log && { echo "server failed"; exit 1; }
mlx-mtp bench --server http://127.0.0.1:18201 --compare http://127.0.0.1:18202 --extra-body '{"cache_prompt": false}' --compare-extra-body '{"cache_prompt": false}' --label mtp --compare-label no-mtp --concurrency $CONC --rounds 2 --passes ${PASSES:-1} --max-tokens 96 --ignore-eos --prompts builtin:code,qa -o $OUT -q --no-plots > $OUT.txt 2>&1
pkill -f "serve --model ${MODEL:-/tmp/srv_oracle}"; while pgrep -f "serve --model ${MODEL:-/tmp/srv_oracle}" >/dev/null; do sleep 0.5; done
