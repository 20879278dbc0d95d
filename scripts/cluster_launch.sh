# Sourced by the cluster launch scripts (scripts/pretrain_*.sh): the torchrun plumbing they share, so each
# script holds only its model, parallel and training flags, which is what a reader compares between them.
#
# Multi-node: run the launch script on every node with the same MASTER_ADDR/MASTER_PORT and NODE_RANK =
# 0..NNODES-1 (scripts/slurm_pretrain_gpt.sh does that under SLURM). Preemption: SIGTERM/SIGUSR1 make every
# rank save and exit 0; with MAX_RESTARTS > 0 torchrun restarts the workers after a failure and --load
# resumes from the latest checkpoint.
#
# Environment, with defaults: GPUS_PER_NODE=8, NNODES=the script's DEFAULT_NNODES, NODE_RANK=0,
# MASTER_ADDR=localhost, MASTER_PORT=6000, MAX_RESTARTS=0, PYTHON=.venv/bin/python (else python3),
# DRY_RUN=1 to print the per-rank memory plan (tools/plan.py) and exit, no GPU needed.

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-${DEFAULT_NNODES:-1}}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
MAX_RESTARTS=${MAX_RESTARTS:-0}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

# launch ARGS...: pretrain_gpt.py with ARGS on this node's GPUS_PER_NODE ranks, or the plan under DRY_RUN=1.
# The planner opens no files, so a script whose tokenizer it cannot count sets PLAN_ARGS=(--vocab-size N).
launch() {
    if [ "${DRY_RUN:-0}" = 1 ]; then
        exec "$PYTHON" tools/plan.py --world-size "$WORLD_SIZE" "$@" ${PLAN_ARGS[@]+"${PLAN_ARGS[@]}"}
    fi
    exec "$PYTHON" -m torch.distributed.run --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" \
        --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
        --max-restarts "$MAX_RESTARTS" pretrain_gpt.py "$@"
}
