"""Peak live CPU tensor bytes of a training step without the profiler: for sequences whose steps run too many ops
for the profiler's allocation log (``training/logging.py``'s ``CPUStepMemory`` keeps an event per op; at 32K tokens
the context-parallel ring's tiles made it outgrow a 23 GiB machine).

torch's CPU allocator reports every allocation and free (signed bytes) to the memory-reporting object installed in
the thread's debug info, which is how the profiler gets its allocation log. Here a small C++ object (compiled once
with ``torch.utils.cpp_extension.load_inline``, cached under ``~/.cache/torch_extensions``) is installed there
instead: a profiler state that says it is disabled (so nothing records ops) and keeps only the running sum of the
reported sizes and its maximum, so its memory does not grow with the step. The figure is the profiler log's:
``persistent + max over the step of the running sum``, with the same blind spot (a tensor allocated before the
step and freed during it is not subtracted: errs high by at most the previous step's batch).
``benchmarks/context_parallel.py --memory-log both`` prints both where the profiler's log still fits.

Used by ``benchmarks/context_parallel.py`` as a torchrun worker: ``run_pretrain_gpt(flags)`` makes the training
log's ``max live tensors`` come from this object, then runs ``pretrain_gpt.py``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/profiler/orchestration/observer.h>

namespace {
namespace prof = torch::profiler::impl;

// Running sum of the signed sizes the CPU allocator reports while installed, and its maximum. A profiler state in
// the type system (torch reads the thread's PROFILER_STATE slot as one) whose config says "disabled": code that
// asks whether a profiler runs gets no, only the allocator's memory reports arrive.
class LiveBytes : public prof::ProfilerStateBase {
 public:
  LiveBytes() : prof::ProfilerStateBase(prof::ProfilerConfig(prof::ProfilerState::Disabled)) {}
  void reportMemoryUsage(void*, int64_t size, size_t, size_t, c10::Device device) override {
    if (device.type() != c10::DeviceType::CPU) return;
    alive += size;
    peak = std::max(peak, alive);
  }
  bool memoryProfilingEnabled() const override { return true; }
  prof::ActiveProfilerType profilerType() override { return prof::ActiveProfilerType::NONE; }
  int64_t alive = 0, peak = 0;
};
std::shared_ptr<LiveBytes> installed;
}  // namespace

void start() {
  installed = std::make_shared<LiveBytes>();
  c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, installed);
}

std::vector<int64_t> stop() {
  c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
  std::vector<int64_t> result = {installed->alive, installed->peak};
  installed.reset();
  return result;
}
"""


def reporter() -> Any:
    """The compiled module: ``start()`` installs a fresh counter on this thread, ``stop()`` removes it and returns
    ``[bytes alive at the end, peak]`` relative to the start."""
    from torch.utils.cpp_extension import load_inline

    return load_inline("megatron_like_live_tensor_bytes", cpp_sources=_SOURCE, functions=["start", "stop"])


def run_pretrain_gpt(flags: list[str]) -> None:
    """``pretrain_gpt.py flags`` with the CPU log's peak taken from the allocator counter (no profiler)."""
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    from megatron_like.training import logging as training_logging

    counter = reporter()

    class AllocatorStepMemory(training_logging.CPUStepMemory):
        """``CPUStepMemory`` whose step peak comes from the allocator counter instead of the profiler's log."""

        @contextlib.contextmanager
        def watch(self, model: list[torch.nn.Module], optimizer: Any) -> Iterator[None]:
            persistent = training_logging.persistent_bytes(model, optimizer)
            counter.start()
            try:
                yield
            finally:
                _, peak = counter.stop()
            self.max_bytes = max(self.max_bytes, persistent + peak)

    training_logging.CPUStepMemory = AllocatorStepMemory  # the logger builds its CPUStepMemory by this name
    pretrain_gpt.main(flags)


if __name__ == "__main__":  # a torchrun worker: benchmarks/live_tensor_bytes.py <pretrain_gpt.py flags>
    run_pretrain_gpt(sys.argv[1:])
