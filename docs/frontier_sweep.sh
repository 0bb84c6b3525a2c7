#!/usr/bin/env bash
# Copyright 2026 The verl-sat Authors. Licensed under the Apache License, Version 2.0.
# The staleness frontier (docs/results.md, "The staleness frontier"), as declared there: every row at paper lags 8, 32
# and 128 for 512 optimizer steps, evaluated every 16, seeds 0-2 (the five first rows first), then seeds 3-4 for the
# rows within a point of the best last accuracy at each lag and their family's bases, then the report, then 1024
# optimizer steps for the rows still rising (best at the last evaluation on 2 seeds or more at a lag) with their
# family's bases, on the seeds they ran, in a store of their own, and its report. From a
# workdir W prepared by `verl-sat prepare --workdir W` (portable floating point: the model every record names), two
# cells at a time. Finished cells are taken from the record store docs/images/results/frontier_cells/, so a rerun, on
# this machine or a fresh one, only runs what is missing; a store of another prepared model is refused.
# Usage: bash docs/frontier_sweep.sh W
set -euo pipefail
W=${1:?usage: bash docs/frontier_sweep.sh WORKDIR}
STORE=${STORE:-docs/images/results/frontier_cells}  # the record store (default: the committed one)
OUT=${OUT:-docs/images/results/frontier}  # the report
LONG_STORE=${LONG_STORE:-docs/images/results/frontier_cells_1024}  # the longer runs' record store
RUN=(--optimizer-steps 512 --jobs 2 --store "$STORE" embedded_engine.eval_every_optimizer_steps=16)
verl-sat sweep --workdir "$W" --name frontier --recipes grpo,gspo,sat_grpo,sat_gspo,sat_gspo_carried \
  --lags 8,32,128 --seeds 0,1,2 "${RUN[@]}"
verl-sat sweep --workdir "$W" --name frontier --recipes sapo,cispo,dppo_kl,geo_mean,gspo_icepop,gspo_seq_is_rs \
  --lags 8,32,128 --seeds 0,1,2 "${RUN[@]}"
verl-sat report --store "$STORE" --out "$OUT" --command "bash docs/frontier_sweep.sh W"
# seeds 3-4: per lag, the rows the report lists within a point of the best, with their family's bases
python - "$OUT/frontier.json" <<'EOF' | while read -r lag recipes; do
import json, sys
for entry in json.load(open(sys.argv[1]))["near_best"]:
    print(entry["lag"], ",".join(entry["runs"]))
EOF
  verl-sat sweep --workdir "$W" --name frontier --recipes "$recipes" --lags "$lag" --seeds 3,4 "${RUN[@]}" </dev/null
done
verl-sat report --store "$STORE" --out "$OUT" --command "bash docs/frontier_sweep.sh W"
# 1024 optimizer steps for the rows still rising: the same --name extends each 512-step run from its last checkpoint
python - "$OUT/frontier.json" <<'EOF' | while read -r lag recipes seeds; do
import json, sys
for entry in json.load(open(sys.argv[1]))["longer"]:
    print(entry["lag"], ",".join(entry["runs"]), ",".join(map(str, entry["seeds"])))
EOF
  verl-sat sweep --workdir "$W" --name frontier --recipes "$recipes" --lags "$lag" --seeds "$seeds" \
    --optimizer-steps 1024 --jobs 2 --store "$LONG_STORE" embedded_engine.eval_every_optimizer_steps=16 </dev/null
done
if [ -n "$(ls "$LONG_STORE" 2>/dev/null)" ]; then
  verl-sat report --store "$LONG_STORE" --out "${OUT}_1024" --command "bash docs/frontier_sweep.sh W"
fi
