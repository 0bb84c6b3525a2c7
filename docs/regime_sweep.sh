#!/usr/bin/env bash
# Copyright 2026 The verl-sat Authors. Licensed under the Apache License, Version 2.0.
# The regime map and the SAT knob ablation of docs/results.md ("Where SAT matters"): at paper lag 8, 120 optimizer
# steps, seeds 0-2, from a prepared workdir W (verl-sat prepare --workdir W). Each setting is one sweep with its own
# record store under docs/images/results/regime/; finished cells are taken from there, so a rerun only runs what is
# missing. About 70 min on 2 cores. Usage: bash docs/regime_sweep.sh W
set -euo pipefail
W=${1:?usage: bash docs/regime_sweep.sh WORKDIR}
STORE=docs/images/results/regime
run() { name=$1; recipes=$2; shift 2
  verl-sat sweep --workdir "$W" --name "$name" --recipes "$recipes" --lags 8 --seeds 0,1,2 --jobs 2 \
    --optimizer-steps 120 --store "$STORE/$name" "$@"
}
PAIRS=grpo,sat_grpo,gspo_r3,sat_gspo_r3
for R in 0.05 0.1 0.4; do  # the radius (eps_lo = eps_hi); 0.2 is the grid's (docs/images/results/cells)
  run "radius$R" $PAIRS actor_rollout_ref.actor.clip_ratio_low=$R actor_rollout_ref.actor.clip_ratio_high=$R
done
for LR in 1.5e-5 6e-5; do  # the learning rate around the default 3e-5
  run "lr$LR" $PAIRS actor_rollout_ref.actor.optim.lr=$LR
done
K=actor_rollout_ref.actor.policy_loss.sat  # the knob ablation, SAT-GSPO w/ R3 against the grid's GSPO w/ R3
run quantile0.8 sat_gspo_r3 $K.quantile=0.8
run quantile0.95 sat_gspo_r3 $K.quantile=0.95
run exponent1 sat_gspo_r3 $K.kernel_exponent=1.0
run exponent4 sat_gspo_r3 $K.kernel_exponent=4.0
run token sat_gspo_r3 $K.granularity=token
run sequence_uniform sat_gspo_r3 $K.granularity=sequence_uniform
run linear sat_gspo_r3 $K.quantile_method=linear
