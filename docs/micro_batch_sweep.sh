#!/usr/bin/env bash
# Copyright 2026 The verl-sat Authors. Licensed under the Apache License, Version 2.0.
# SAT-GSPO's gain against sequences per micro-batch (docs/results.md, "Sequences per micro-batch"): at paper lag 8,
# 120 optimizer steps, seeds 0-2, from a prepared workdir W (verl-sat prepare --workdir W). The optimizer step is
# unchanged (16 prompts x 8 responses); only actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, the sequences per
# forward/backward and so per SAT quantile, changes. 128 (one micro-batch per optimizer step) is the grid's default:
# its gspo and sat_gspo cells are the grid's (docs/images/results/cells). Each setting is one sweep with its own
# record store under docs/images/results/micro/; finished cells are taken from there, so a rerun only runs what is
# missing. Extremes first. Usage: bash docs/micro_batch_sweep.sh W
set -euo pipefail
W=${1:?usage: bash docs/micro_batch_sweep.sh WORKDIR}
STORE=${STORE:-docs/images/results/micro}  # the record stores (default: the committed ones)
MICRO=actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
TOKEN=actor_rollout_ref.actor.policy_loss.sat.granularity=token
run() { name=$1; recipes=$2; shift 2
  verl-sat sweep --workdir "$W" --name "micro_$name" --recipes "$recipes" --lags 8 --seeds 0,1,2 --jobs 2 \
    --optimizer-steps 120 --store "$STORE/$name" "$@"
}
run mb128_token sat_gspo $TOKEN
for M in 8 2 32 16 4; do
  run "mb$M" gspo,sat_gspo $MICRO=$M
  run "mb${M}_token" sat_gspo $MICRO=$M $TOKEN
done
