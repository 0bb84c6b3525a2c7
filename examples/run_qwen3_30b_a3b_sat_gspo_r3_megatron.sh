#!/usr/bin/env bash
# The paper's setup: Qwen3-30B-A3B-Base, SGLang rollout, Megatron training, SAT-GSPO with rollout routing replay,
# weights broadcast with a lag of LAG trainer steps (1 or 8), 256 prompts x 16 samples, temperature 0.95,
# AIME24 avg@8 evaluation. Nothing is downloaded: point the paths below at local copies.
#
#   LAG=8 bash examples/run_qwen3_30b_a3b_sat_gspo_r3_megatron.sh [extra verl overrides, e.g. --cfg job]
set -euo pipefail

# ---- user-adjustable --------------------------------------------------------------------------------------------
MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3-30B-A3B-Base}        # Hugging Face model folder
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/dapo-math-17k/train.parquet}  # verl parquet (prompt, reward_model.ground_truth)
VAL_FILE=${VAL_FILE:-$HOME/data/aime-2024/test.parquet}           # AIME24 in verl parquet
RECIPE=${RECIPE:-sat_gspo_r3}                                      # any of `verl-sat recipes`
LAG=${LAG:-8}                                                      # 1 or 8 (or sync)
TRAINER_NODES=${TRAINER_NODES:-2}                                  # training nodes x 8 GPUs
ROLLOUT_NODES=${ROLLOUT_NODES:-2}                                  # dedicated SGLang nodes x 8 GPUs
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PROMPTS_PER_STEP=${PROMPTS_PER_STEP:-256}
SAMPLES_PER_PROMPT=${SAMPLES_PER_PROMPT:-16}
MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-2048}
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-8192}
# tokens per micro-batch and GPU (verl's dynamic batching, as the paper's 32k): SAT-GSPO's quantile is taken per
# micro-batch, so a micro-batch must hold many sequences (a static micro-batch of 1 would make it plain GSPO)
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-32768}
LR=${LR:-1e-6}
EXPERIMENT=${EXPERIMENT:-qwen3_30b_a3b_${RECIPE}_lag${LAG}}
# ------------------------------------------------------------------------------------------------------------------
[[ "$LAG" == sync ]] && LAG_CHOICE=sync || LAG_CHOICE=lag${LAG}

python -m verl_sat.main --config-name ppo_megatron_trainer \
  +recipe="$RECIPE" +lag="$LAG_CHOICE" \
  data.train_files="$TRAIN_FILE" data.val_files="$VAL_FILE" \
  data.train_batch_size="$PROMPTS_PER_STEP" \
  data.max_prompt_length="$MAX_PROMPT_LEN" data.max_response_length="$MAX_RESPONSE_LEN" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.actor.optim.lr="$LR" \
  actor_rollout_ref.actor.use_dynamic_bsz=true \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$MAX_TOKENS_PER_GPU" \
  actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 \
  actor_rollout_ref.actor.megatron.expert_model_parallel_size=8 \
  actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1 \
  actor_rollout_ref.rollout.name=sglang \
  actor_rollout_ref.rollout.n="$SAMPLES_PER_PROMPT" \
  actor_rollout_ref.rollout.temperature=0.95 \
  actor_rollout_ref.rollout.calculate_log_probs=true \
  actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.8 \
  actor_rollout_ref.rollout.nnodes="$ROLLOUT_NODES" \
  actor_rollout_ref.rollout.n_gpus_per_node="$GPUS_PER_NODE" \
  actor_rollout_ref.rollout.val_kwargs.n=8 \
  actor_rollout_ref.rollout.val_kwargs.temperature=0.95 \
  actor_rollout_ref.rollout.val_kwargs.do_sample=true \
  trainer.nnodes="$TRAINER_NODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" \
  trainer.project_name=verl_sat trainer.experiment_name="$EXPERIMENT" \
  trainer.logger='["console","tensorboard"]' \
  trainer.test_freq=10 trainer.save_freq=50 trainer.total_epochs=10 \
  "$@"
