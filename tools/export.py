"""Export a checkpoint (any tp/pp layout) as a self-contained inference artifact.

    python tools/export.py --load ckpt --save exported --format torch-export
    python tools/export.py --load ckpt --save exported --format hf

``torch-export`` writes ``<save>/model.pt2``: a ``torch.export`` program ``input_ids [b, s] -> logits
[b, s, vocab]`` (real vocabulary, dynamic batch and sequence up to the position table), loadable with
``torch.export.load(path).module()`` and nothing of this repository; plus ``<save>/export_config.json``
(vocabulary, end-of-text id, model shape) and the tokenizer files when known. ``hf`` writes the same as
``tools/convert_hf.py to-hf`` (a ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM`` or ``MixtralForCausalLM`` directory, following the model).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from megatron_like.config import ModelConfig, QuietArgumentParser  # noqa: E402
from megatron_like.inference.loading import load_inference_model  # noqa: E402
from megatron_like.parallel_state import ParallelState  # noqa: E402


class LogitsProgram(nn.Module):
    """``input_ids [b, s]`` -> logits ``[b, s, vocab]`` of a single-process GPT (positions 0..s-1)."""

    def __init__(self, model: nn.Module, vocab_size: int) -> None:
        super().__init__()
        self.model, self.vocab_size = model, vocab_size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        return self.model(input_ids, positions)[..., : self.vocab_size]


def export_program(load: str, iteration: int | None = None):
    """(torch.export program, loaded InferenceModel) of the checkpoint under ``load``."""
    # The fused C++ kernels are opaque to torch.export: trace the pure-PyTorch paths (same math).
    # MKL GEMMs: F.linear is a portable aten op, oneDNN's linear is not.
    plain = {"bias_gelu_fusion": False, "masked_softmax_fusion": False, "attention_backend": "sdpa",
             "cpu_gemm_backend": "mkl"}
    plain = {k: v for k, v in plain.items() if hasattr(ModelConfig(), k)}
    loaded = load_inference_model(load, ParallelState.single_process(torch.device("cpu")), iteration=iteration,
                                  with_tokenizer=True, model_overrides=plain)
    program = LogitsProgram(loaded.model[0], loaded.vocab_size).eval()
    max_positions = loaded.config.model.max_positions
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("seq", min=2, max=max_positions)
    example = torch.zeros(2, min(8, max_positions), dtype=torch.long)
    with torch.no_grad():
        exported = torch.export.export(program, (example,), dynamic_shapes={"input_ids": {0: batch, 1: seq}})
    return exported, loaded


def main(argv: list[str] | None = None) -> None:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="Checkpoint directory (any tp/pp layout).")
    parser.add_argument("--save", required=True, help="Output directory.")
    parser.add_argument("--format", choices=["torch-export", "hf"], default="torch-export")
    parser.add_argument("--iteration", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        if args.format == "hf":
            from convert_hf import main as convert

            convert(["to-hf", "--load", args.load, "--save", args.save]
                    + (["--iteration", str(args.iteration)] if args.iteration is not None else []))
            return
        exported, loaded = export_program(args.load, args.iteration)
        os.makedirs(args.save, exist_ok=True)
        torch.export.save(exported, os.path.join(args.save, "model.pt2"))
        m = loaded.config.model
        meta = {"format": "torch.export", "inputs": "input_ids [batch, seq] int64",
                "outputs": "logits [batch, seq, vocab_size] float", "vocab_size": loaded.vocab_size,
                "eod": loaded.eod, "max_positions": m.max_positions, "num_layers": m.num_layers,
                "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads}
        from convert_hf import tokenizer_files

        for name, source in tokenizer_files(loaded.config.data).items():
            shutil.copyfile(source, os.path.join(args.save, name))
        with open(os.path.join(args.save, "export_config.json"), "w") as f:
            json.dump(meta, f, indent=2)
        print(f"exported {args.load} to {os.path.join(args.save, 'model.pt2')}")
    except (OSError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
