#!/usr/bin/env bash
# Two phases on the default model (SmolLM2-135M-Instruct), 4 pipeline stages with the outlier
# boundary: continual pretraining on plain text, then SFT on chat from the first phase's weights
# (--init-from: weights only, fresh optimizer and schedule), and the same SFT from the base model
# as the control. `thinpipe compare` puts the two SFT runs side by side. ~15 min on 2 CPU cores.
#   bash examples/two_phase/run.sh [OUT]
set -euo pipefail
OUT=${1:-runs/two_phase}
PY=${PY:-.venv/bin/python}
COMMON=(--set mesh.pp=4 --set model.tied=untie --set train.seq_len=256 --set train.batch_size=4
        --set train.lr=1e-4 --set eval.every=10 --set data.val_fraction=0.05 --set data.val_rows=16
        --set boundary.kind=outlier --set boundary.fwd_bits=2 --set boundary.bwd_bits=2 --set log.tensorboard=true)
$PY examples/two_phase/make_data.py --out "$OUT/data"
# phase 1: continual pretraining (loss on every token)
$PY -m thinpipe train --out "$OUT/cpt" --overwrite "${COMMON[@]}" --set data.name="$OUT/data/text.jsonl" --set train.steps=30
# phase 2: SFT from phase 1's weights (loss on the assistant turns, the model's chat format)
$PY -m thinpipe train --out "$OUT/sft" --overwrite --init-from "$OUT/cpt" "${COMMON[@]}" \
    --set data.name="$OUT/data/chat.jsonl" --set train.steps=30
# control: the same SFT from the base model
$PY -m thinpipe train --out "$OUT/sft_only" --overwrite "${COMMON[@]}" --set data.name="$OUT/data/chat.jsonl" \
    --set train.steps=30
$PY -m thinpipe compare "$OUT/sft_only" "$OUT/sft" --out "$OUT/compare"
