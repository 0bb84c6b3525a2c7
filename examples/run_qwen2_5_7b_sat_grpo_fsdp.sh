#!/usr/bin/env bash
# A smaller run for a dense model under verl's FSDP engine: Qwen2.5-7B on one node, vLLM rollout on 4 dedicated GPUs,
# any non-R3 row of the paper's Table 1 (RECIPE, default SAT-GRPO) at paper lag LAG (1 or 8). The recipe brings the
# paper's shared settings; this script sets only the cluster's sizes. Nothing is downloaded: point the paths below at
# local copies.
#
#   LAG=1 bash examples/run_qwen2_5_7b_sat_grpo_fsdp.sh [extra verl overrides, e.g. --cfg job]
set -euo pipefail

# ---- user-adjustable --------------------------------------------------------------------------------------------
MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen2.5-7B}                  # Hugging Face model folder
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}           # e.g. verl's examples/data_preprocess/gsm8k.py
VAL_FILE=${VAL_FILE:-$HOME/data/gsm8k/test.parquet}
RECIPE=${RECIPE:-sat_grpo}                                          # grpo, gspo, grpo_tis, gspo_tis, dppo, sat_grpo, sat_gspo
LAG=${LAG:-1}                                                       # paper lag 1 or 8, or sync
TRAINER_GPUS=${TRAINER_GPUS:-4}                                     # one node: 4 GPUs train, 4 GPUs roll out
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}
PROMPTS_PER_OPTIMIZER_STEP=${PROMPTS_PER_OPTIMIZER_STEP:-64}
SAMPLES_PER_PROMPT=${SAMPLES_PER_PROMPT:-8}                         # the paper's 16 halved for one node
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-16384}                     # dynamic batching: many sequences per micro-batch
EXPERIMENT=${EXPERIMENT:-qwen2_5_7b_${RECIPE}_lag${LAG}}
# ------------------------------------------------------------------------------------------------------------------
if [[ "$LAG" == sync ]]; then LAG_CHOICE=sync; N=1; else LAG_CHOICE=lag${LAG}; N=$LAG; fi

python -m verl_sat.main \
  +recipe="$RECIPE" +lag="$LAG_CHOICE" \
  data.train_files="$TRAIN_FILE" data.val_files="$VAL_FILE" \
  data.train_batch_size=$((PROMPTS_PER_OPTIMIZER_STEP * N)) \
  data.max_prompt_length=512 data.max_response_length=1024 \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.model.enable_gradient_checkpointing=true \
  actor_rollout_ref.actor.use_dynamic_bsz=true \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$MAX_TOKENS_PER_GPU" \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n="$SAMPLES_PER_PROMPT" \
  actor_rollout_ref.rollout.calculate_log_probs=true \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.nnodes=1 \
  actor_rollout_ref.rollout.n_gpus_per_node="$ROLLOUT_GPUS" \
  trainer.nnodes=1 trainer.n_gpus_per_node="$TRAINER_GPUS" \
  trainer.project_name=verl_sat trainer.experiment_name="$EXPERIMENT" \
  trainer.logger='["console","tensorboard"]' \
  trainer.test_freq=10 trainer.save_freq=50 trainer.total_epochs=5 \
  "$@"
