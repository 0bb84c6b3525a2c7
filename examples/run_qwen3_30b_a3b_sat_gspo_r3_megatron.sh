#!/usr/bin/env bash
# The paper's setup (arXiv 2607.18722, Sec. 5.1, App. F, Table 9): Qwen3-30B-A3B-Base, SGLang rollout and Megatron
# training on separate GPU pools, 256 prompts x 16 samples per optimizer step, response cap 32k, 544 optimizer steps,
# AIME24 with 16 samples per problem every 5 iterations. RECIPE is any recipe of `verl-sat recipes`; the recipe
# brings the paper's shared settings (clip 0.2, low-variance KL 1e-3, Adam (0.9, 0.98) at 1e-6, temperature 1.0).
# Nothing is downloaded: point the paths below at local copies.
#
#   LAG=8 bash examples/run_qwen3_30b_a3b_sat_gspo_r3_megatron.sh             # SAT-GSPO (carried quantile) w/ R3, lag 8
#   RECIPE=sat_gspo_r3 LAG=8 bash examples/run_qwen3_30b_a3b_sat_gspo_r3_megatron.sh  # the paper's row (Eq. 20)
#   RECIPE=gspo_r3 LAG=1 bash examples/run_qwen3_30b_a3b_sat_gspo_r3_megatron.sh  # its base row at lag 1
#   ... [extra verl overrides, e.g. --cfg job]
# The default row, sat_gspo_carried_r3, is NOT the paper's row: it is verl-sat's SAT-GSPO with the paper's sequence
# scores and endpoints (Eq. 20) but the tail quantile taken over the micro-batch's sequences and the last 256 sequences
# the loss scored before it (granularity=sequence_carried). Chosen because a micro-batch of this token budget holds one
# full-length sequence, and there the paper's per-micro-batch quantile (RECIPE=sat_gspo_r3) cannot gate, so the paper's
# row would train as GSPO w/ R3 (the entry point warns; docs/sat.md). Of the rules measured at one to two sequences
# per micro-batch on a long chain-of-thought task (docs/results.md, "Long chain of thought"), it is the one that can act
# on every unit it gates, keeps the paper's per-sequence clip and costs about what the paper's loss costs.
# RECIPE=sat_gspo_r3 runs the paper's row as published.
set -euo pipefail

# ---- user-adjustable --------------------------------------------------------------------------------------------
MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3-30B-A3B-Base}        # Hugging Face model folder
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/dapo-math-17k/train.parquet}  # verl parquet (prompt, reward_model.ground_truth)
VAL_FILE=${VAL_FILE:-$HOME/data/aime-2024/test.parquet}           # AIME24 in verl parquet
RECIPE=${RECIPE:-sat_gspo_carried_r3}                              # any of `verl-sat recipes`
LAG=${LAG:-8}                                                      # paper lag 1 or 8, or sync
TRAINER_NODES=${TRAINER_NODES:-2}                                  # training nodes x 8 GPUs
ROLLOUT_NODES=${ROLLOUT_NODES:-2}                                  # dedicated SGLang nodes x 8 GPUs
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PROMPTS_PER_OPTIMIZER_STEP=${PROMPTS_PER_OPTIMIZER_STEP:-256}     # Table 9: 256 prompts x 16 samples
OPTIMIZER_STEPS=${OPTIMIZER_STEPS:-544}                            # Table 9: 544 rollout iterations
MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-2048}
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-32768}                        # App. F: response cap 32k
# tokens per micro-batch and GPU (verl's dynamic batching); verl asserts that the budget holds the longest sequence,
# prompt + response, so it is at least MAX_PROMPT_LEN + MAX_RESPONSE_LEN: once responses reach the cap, one sequence
# per micro-batch, which the carried quantile handles and the paper's per-micro-batch quantile does not
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-$((MAX_PROMPT_LEN + MAX_RESPONSE_LEN))}
TP=${TP:-4}                                                        # Megatron tensor parallel size (dense layers)
EP=${EP:-8}                                                        # expert parallel size
ETP=${ETP:-1}                                                      # expert tensor parallel size: ETP x EP x PP must
                                                                   # divide the trainer GPUs (unset, Megatron takes TP)
EXPERIMENT=${EXPERIMENT:-qwen3_30b_a3b_${RECIPE}_lag${LAG}}
# ------------------------------------------------------------------------------------------------------------------
if [[ "$LAG" == sync ]]; then LAG_CHOICE=sync; N=1; else LAG_CHOICE=lag${LAG}; N=$LAG; fi
# paper lag n: one trainer step = n optimizer steps of PROMPTS_PER_OPTIMIZER_STEP prompts, then a weight broadcast, so
# the batch holds n x 256 prompts and the run n times fewer trainer steps (lags compared at equal optimizer steps)

python -m verl_sat.main --config-name ppo_megatron_trainer \
  +recipe="$RECIPE" +lag="$LAG_CHOICE" \
  data.train_files="$TRAIN_FILE" data.val_files="$VAL_FILE" \
  data.train_batch_size=$((PROMPTS_PER_OPTIMIZER_STEP * N)) \
  data.max_prompt_length="$MAX_PROMPT_LEN" data.max_response_length="$MAX_RESPONSE_LEN" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.actor.use_dynamic_bsz=true \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$MAX_TOKENS_PER_GPU" \
  actor_rollout_ref.actor.megatron.tensor_model_parallel_size="$TP" \
  actor_rollout_ref.actor.megatron.expert_model_parallel_size="$EP" \
  actor_rollout_ref.actor.megatron.expert_tensor_parallel_size="$ETP" \
  actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1 \
  actor_rollout_ref.rollout.name=sglang \
  actor_rollout_ref.rollout.calculate_log_probs=true \
  actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.8 \
  actor_rollout_ref.rollout.nnodes="$ROLLOUT_NODES" \
  actor_rollout_ref.rollout.n_gpus_per_node="$GPUS_PER_NODE" \
  actor_rollout_ref.rollout.val_kwargs.n=16 \
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
  actor_rollout_ref.rollout.val_kwargs.do_sample=true \
  trainer.nnodes="$TRAINER_NODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" \
  trainer.project_name=verl_sat trainer.experiment_name="$EXPERIMENT" \
  trainer.logger='["console","tensorboard"]' \
  trainer.total_training_steps=$((OPTIMIZER_STEPS / N)) \
  trainer.test_freq=$(( (5 + N - 1) / N )) trainer.save_freq=50 \
  "$@"
