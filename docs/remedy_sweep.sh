#!/usr/bin/env bash
# Copyright 2026 The verl-sat Authors. Licensed under the Apache License, Version 2.0.
# The remedy comparison (docs/recipes.md, "Remedy comparison rows"): every remedy row at paper lag 8 and lag 1,
# 120 optimizer steps, seeds 0-2, from a prepared workdir W (verl-sat prepare --workdir W), two cells at a time. Its
# bases (gspo, sat_gspo) run here again, so that the fractions each row clips, masks or reweights and its time per
# optimizer step are measured in the same sweep (their accuracies equal the grid's cells, seed by seed). Finished cells
# are taken from the record store docs/images/results/remedies/, so a rerun only runs what is missing.
# Usage: bash docs/remedy_sweep.sh W
set -euo pipefail
W=${1:?usage: bash docs/remedy_sweep.sh WORKDIR}
STORE=${STORE:-docs/images/results/remedies}  # the record store (default: the committed one)
verl-sat sweep --workdir "$W" --name remedies \
  --recipes gspo,sat_gspo,gspo_icepop,gspo_seq_is_rs,gspo_geo_rs,gspo_k3_rs,sapo,cispo,dppo_kl,sat_gspo_icepop \
  --lags 8,1 --seeds 0,1,2 --jobs 2 --optimizer-steps 120 --store "$STORE"
