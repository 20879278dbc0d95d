# Source this file (bash) to run everything as on a CPU with only the instruction set MEGATRON_LIKE_ISA
# names (avx512, avx2 or scalar; unset: the widest the CPU has). It exports PyTorch's own switches, which
# must be set before python starts, so that ATen, MKL and oneDNN take that path as our kernels do
# (megatron_like/kernels/_loader.py reads MEGATRON_LIKE_ISA; MEGATRON_LIKE_CSRC_ISA is its older name).
# Example: MEGATRON_LIKE_ISA=avx2 bash scripts/test.sh   (docs/kernels.md)
ml_isa="${MEGATRON_LIKE_ISA:-${MEGATRON_LIKE_CSRC_ISA:-}}"
case "$ml_isa" in
  "" | avx512) ;;  # PyTorch already takes its widest path
  avx2)
    export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
  scalar)
    export ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 ;;
  *)
    echo "MEGATRON_LIKE_ISA=$ml_isa is not a kernel path: set it to avx512, avx2 or scalar, or unset it" >&2
    return 1 ;;
esac
if [ -n "$ml_isa" ]; then export MEGATRON_LIKE_ISA="$ml_isa"; fi
unset ml_isa
