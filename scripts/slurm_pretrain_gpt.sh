#!/usr/bin/env bash
# SLURM: one torchrun per node, each running a launch script of this directory.
#   sbatch --nodes 4 scripts/slurm_pretrain_gpt.sh scripts/pretrain_gpt_6.7B.sh
#   MODEL_SCRIPT=scripts/pretrain_gpt_175B.sh sbatch --nodes 128 scripts/slurm_pretrain_gpt.sh
# Time limit and preemption: SLURM sends this batch shell SIGUSR1 two minutes before the end (--signal
# below). The trap requeues the job and sends SIGTERM to srun, which forwards it to each node's torchrun,
# which forwards it to its workers: every rank saves a checkpoint and exits 0 (torchrun itself reports the
# signal). When the job runs again, the launch script's --load resumes from the latest checkpoint. Inside
# one allocation, MAX_RESTARTS (torchrun --max-restarts) restarts crashed workers from it as well.
#SBATCH --job-name=megatron_like
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

MODEL_SCRIPT=${1:-${MODEL_SCRIPT:-scripts/pretrain_gpt_1.3B.sh}}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-6000}
export NNODES=$SLURM_JOB_NUM_NODES GPUS_PER_NODE=${GPUS_PER_NODE:-8} MAX_RESTARTS=${MAX_RESTARTS:-3}

srun --kill-on-bad-exit=1 bash -c 'NODE_RANK=$SLURM_NODEID exec bash "$0"' "$MODEL_SCRIPT" &
SRUN_PID=$!
trap 'echo "time limit near: saving, then requeueing"; scontrol requeue "$SLURM_JOB_ID"; kill -TERM "$SRUN_PID"' USR1
# `wait` returns early when the trap runs; wait again for the ranks to finish saving.
wait "$SRUN_PID" || wait "$SRUN_PID"
