#!/usr/bin/env bash
# Check the CUDA paths on a machine with an NVIDIA GPU, in one command, and print a table of the results:
#   1. a python with a CUDA build of torch: $PYTHON if set, else .venv/bin/python, else python3 (e.g. a machine
#      with torch preinstalled and no network); failing those, .venv from scripts/setup.sh (PyPI's torch wheel
#      is the CUDA build; needs the network);
#   2. csrc/ built in place with that python (megatron_like/_csrc/, csrc/cuda/*.cu with nvcc for this GPU;
#      no pip, nothing downloaded);
#   3. `python -m megatron_like.kernels` (the path each kernel takes), the suite tests/gpu, and a short
#      pretrain_gpt.py run under torchrun on the GPUs (NCCL and tensor parallelism when there are two or more).
# Exit status: 0 when every step passed, 1 when one failed, 2 when there is no GPU here: then it stops at once
# with one line and runs nothing. Logs: $GPU_CHECK_LOGS (default build/gpu_check/).
set -uo pipefail
cd "$(dirname "$0")/.."

LOGS=${GPU_CHECK_LOGS:-build/gpu_check}
cuda_python() {  # $1 has torch with CUDA and sees a GPU
    command -v "$1" >/dev/null 2>&1 &&
        "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
fi
PY=""
for candidate in "${PYTHON:-}" .venv/bin/python python3; do
    if [ -n "$candidate" ] && cuda_python "$candidate"; then PY=$candidate; break; fi
done
if [ -z "$PY" ] && [ "$gpus" -eq 0 ]; then
    echo "gpu_check: no GPU on this machine (nvidia-smi lists none, no python's torch sees CUDA): nothing to check"
    exit 2
fi
if [ -z "$PY" ]; then
    if [ -n "${PYTHON:-}" ]; then
        echo "gpu_check: PYTHON=$PYTHON has no CUDA build of torch that sees the GPU: point PYTHON at one, or unset it"
        exit 1
    fi
    echo "gpu_check: no python here has a CUDA torch; setting up .venv (scripts/setup.sh)" >&2
    bash scripts/setup.sh || exit 1
    PY=.venv/bin/python
    if ! cuda_python "$PY"; then
        echo "gpu_check: .venv's torch does not see the GPU: install a CUDA build of torch==2.13.0 into .venv"
        exit 1
    fi
fi
mkdir -p "$LOGS"
rows=()
failed=0
row() {  # step, result (ok / FAILED / note), detail
    rows+=("$1|$2|$3")
    if [ "$2" = FAILED ]; then failed=1; fi
}

device=$("$PY" -c 'import torch; print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")')
row "python" ok "$PY: $device"

sources=$(ls csrc/cuda/*.cu | wc -l)
# csrc in place, for this GPU's architecture. nvcc may live outside PATH on a CUDA machine.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then PATH=/usr/local/cuda/bin:$PATH; fi
suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
rm -f megatron_like/_csrc/cuda_*"$suffix"  # count only what this build makes
if MEGATRON_LIKE_BUILD_CUDA=1 MEGATRON_LIKE_CUDA_ARCH=${MEGATRON_LIKE_CUDA_ARCH:-native} \
        "$PY" setup.py build_ext --inplace >"$LOGS/build.log" 2>&1; then
    built=$(ls megatron_like/_csrc/cuda_*"$suffix" 2>/dev/null | wc -l)
    if [ "$built" -eq "$sources" ]; then
        row "build csrc (nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))" ok "$built of $sources CUDA twins"
    else
        row "build csrc" FAILED "$built of $sources CUDA twins built (nvcc on PATH? see $LOGS/build.log)"
    fi
else
    row "build csrc" FAILED "setup.py build_ext failed: $LOGS/build.log"
fi

if "$PY" -m megatron_like.kernels >"$LOGS/kernels.txt" 2>&1; then
    twins=$(grep -c "CUDA twin$" "$LOGS/kernels.txt")
    [ "$twins" -eq "$sources" ] && result=ok || result=FAILED
    row "kernel paths (python -m megatron_like.kernels)" "$result" "$twins of $sources ops take their CUDA twin ($LOGS/kernels.txt)"
else
    row "kernel paths" FAILED "$(tail -1 "$LOGS/kernels.txt")"
fi

if "$PY" -c 'import pytest' 2>/dev/null; then
    "$PY" -m pytest tests/gpu -q -p no:cacheprovider --junitxml="$LOGS/gpu.xml" >"$LOGS/pytest.log" 2>&1
    summary=$("$PY" - "$LOGS/gpu.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

files: dict[str, dict[str, int]] = {}
for case in ET.parse(sys.argv[1]).iter("testcase"):
    name = case.get("classname", "").rsplit(".", 1)[-1]
    outcome = "passed"
    for child in case:
        if child.tag in ("failure", "error"):
            outcome = "failed"
        elif child.tag == "skipped":
            outcome = "skipped"
    files.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0})[outcome] += 1
for name, counts in sorted(files.items()):
    result = "FAILED" if counts["failed"] or counts["skipped"] or not counts["passed"] else "ok"
    print(f"tests/gpu/{name}.py|{result}|" + ", ".join(f"{n} {k}" for k, n in counts.items() if n))
EOF
)
    while IFS= read -r line; do
        [ -n "$line" ] && rows+=("$line") && case "$line" in *"|FAILED|"*) failed=1 ;; esac
    done <<<"$summary"
    [ -n "$summary" ] || row "tests/gpu" FAILED "no results: $LOGS/pytest.log"
else
    row "tests/gpu" FAILED "$PY has no pytest: pip install pytest (or set PYTHON to a python with CUDA torch and pytest)"
fi

# A short training run under torchrun: tensor parallelism over NCCL with two or more GPUs; with one GPU, one
# process (which starts no process group, so NCCL is not exercised).
nproc=$("$PY" -c 'import torch; print(min(2, torch.cuda.device_count()))')
# Sequence parallelism at tp > 1 exercises the column linears' async re-gather and reduce-scatter over NCCL.
sp_flag=$([ "$nproc" -gt 1 ] && echo "--sequence-parallel")
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$nproc" pretrain_gpt.py \
    --tensor-model-parallel-size "$nproc" --num-layers 4 --hidden-size 256 --num-attention-heads 8 \
    --seq-length 128 --max-position-embeddings 128 --micro-batch-size 4 --global-batch-size 8 --train-iters 20 \
    --lr 1e-3 --mock-data --vocab-size 1024 --bf16 --log-interval 5 --eval-iters 1 --seed 1234 $sp_flag \
    >"$LOGS/torchrun.log" 2>&1
status=$?
loss=$(grep -o 'lm loss: [0-9.E+-]*' "$LOGS/torchrun.log" | tail -1)
backend=$([ "$nproc" -gt 1 ] && echo "NCCL, tp $nproc + sp" || echo "1 GPU: no process group, NCCL not exercised")
if [ "$status" -eq 0 ] && [ -n "$loss" ]; then
    row "torchrun pretrain_gpt.py bf16" ok "$backend; last logged $loss"
else
    row "torchrun pretrain_gpt.py bf16" FAILED "exit $status: $LOGS/torchrun.log"
fi

printf '\n%-48s %-7s %s\n' "step" "result" "detail"
for entry in "${rows[@]}"; do
    IFS='|' read -r step result detail <<<"$entry"
    printf '%-48s %-7s %s\n' "$step" "$result" "$detail"
done
exit "$failed"
