#!/usr/bin/env bash
# A smaller run for a dense model under verl's FSDP engine: Qwen2.5-7B, SAT-GRPO, vLLM rollout on dedicated GPUs,
# lag LAG (1 or 8). Nothing is downloaded: point the paths below at local copies.
#
#   LAG=1 bash examples/run_qwen2_5_7b_sat_grpo_fsdp.sh [extra verl overrides, e.g. --cfg job]
set -euo pipefail

# ---- user-adjustable --------------------------------------------------------------------------------------------
MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen2.5-7B}                  # Hugging Face model folder
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}           # e.g. verl's examples/data_preprocess/gsm8k.py
VAL_FILE=${VAL_FILE:-$HOME/data/gsm8k/test.parquet}
RECIPE=${RECIPE:-sat_grpo}                                          # sat_grpo, sat_gspo, grpo, gspo, dppo, tis
LAG=${LAG:-1}                                                       # 1 or 8 (or sync)
TRAINER_GPUS=${TRAINER_GPUS:-4}                                     # one node: 4 GPUs train, 4 GPUs roll out
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}
PROMPTS_PER_STEP=${PROMPTS_PER_STEP:-128}
SAMPLES_PER_PROMPT=${SAMPLES_PER_PROMPT:-8}
LR=${LR:-1e-6}
EXPERIMENT=${EXPERIMENT:-qwen2_5_7b_${RECIPE}_lag${LAG}}
# ------------------------------------------------------------------------------------------------------------------
[[ "$LAG" == sync ]] && LAG_CHOICE=sync || LAG_CHOICE=lag${LAG}

python -m verl_sat.main \
  +recipe="$RECIPE" +lag="$LAG_CHOICE" \
  data.train_files="$TRAIN_FILE" data.val_files="$VAL_FILE" \
  data.train_batch_size="$PROMPTS_PER_STEP" \
  data.max_prompt_length=512 data.max_response_length=1024 \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.model.enable_gradient_checkpointing=true \
  actor_rollout_ref.actor.optim.lr="$LR" \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n="$SAMPLES_PER_PROMPT" \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.calculate_log_probs=true \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.nnodes=1 \
  actor_rollout_ref.rollout.n_gpus_per_node="$ROLLOUT_GPUS" \
  trainer.nnodes=1 trainer.n_gpus_per_node="$TRAINER_GPUS" \
  trainer.project_name=verl_sat trainer.experiment_name="$EXPERIMENT" \
  trainer.logger='["console","tensorboard"]' \
  trainer.test_freq=10 trainer.save_freq=50 trainer.total_epochs=5 \
  "$@"
