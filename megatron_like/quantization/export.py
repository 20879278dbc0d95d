"""Export a QAT-trained GPT checkpoint as an int8 model, and load it back for inference.

    python -m megatron_like.quantization.export --load ckpt/gpt_qat --output gpt_int8.safetensors

The checkpoint (``pretrain_gpt.py --qat --save``, any tp/pp layout) is merged into the single-process
model, its QAT linears are frozen to int8 (:func:`megatron_like.quantization.qat.convert_to_int8`), and
the state is written as safetensors. File contents, per transformer linear ``<p>`` (e.g.
``layers.0.attention.qkv``):

* ``<p>.weight_int8``: int8 ``[out, in]``, codes in [-127, 127];
* ``<p>.weight_scale``: float32 ``[out]``, so ``W ~= weight_int8 * weight_scale[:, None]``;
* ``<p>.input_scale``: float32 ``[]``, the input's per-tensor scale (moving-average range / 127);
* ``<p>.bias``: float32.

Everything else (embeddings, LayerNorms, output layer when untied) is float32 under its usual name; the
metadata entry ``config`` holds the training config as JSON. :func:`load_int8_model` rebuilds the model.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from megatron_like.config import Config
from megatron_like.model.gpt import GPTModel
from megatron_like.model.state import load_full_state
from megatron_like.parallel_state import ParallelState
from megatron_like.quantization.qat import convert_to_int8, insert_fake_quant


def load_qat_checkpoint(root: str, iteration: int | None = None) -> tuple[Config, dict[str, torch.Tensor]]:
    """(saved config, full state with global layer names) of a (QAT) GPT checkpoint of any layout and format.

    Quantizer ranges are the same on every tp rank (they are reduced over tp): stored once (torch_dist) or
    kept from tp rank 0 (torch), see ``megatron_like/model/state.py``.
    """
    return load_full_state(root, iteration)


def build_single_process_qat_model(config: Config, vocab_size: int) -> GPTModel:
    """The whole GPT of ``config`` in one process with fake quantization inserted (float32)."""
    ps = ParallelState.single_process(torch.device("cpu"))
    model = GPTModel(config.model, ps, vocab_size=vocab_size, seed=config.training.seed)
    insert_fake_quant(model, ps)
    return model


def export_int8(root: str, output: str, iteration: int | None = None) -> dict[str, torch.Tensor]:
    """Write the int8 model of the QAT checkpoint under ``root`` to ``output`` (safetensors); return its state."""
    from safetensors.torch import save_file

    config, full = load_qat_checkpoint(root, iteration)
    model = build_single_process_qat_model(config, full["embedding.word_embeddings.weight"].shape[0])
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in full.items()})
    convert_to_int8(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, output, metadata={"config": json.dumps(config.to_dict())})
    return state


def load_int8_model(path: str) -> tuple[GPTModel, Config]:
    """The int8 GPT (one process, eval mode) stored at ``path`` by :func:`export_int8`, and its config."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as f:
        config = Config.from_dict(json.loads(f.metadata()["config"]))
    state = load_file(path)
    model = build_single_process_qat_model(config, state["embedding.word_embeddings.weight"].shape[0])
    convert_to_int8(model)
    model.load_state_dict(state)
    return model.eval(), config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export a QAT GPT checkpoint (pretrain_gpt.py --qat) to int8")
    parser.add_argument("--load", required=True, help="checkpoint directory (any tp/pp layout)")
    parser.add_argument("--output", required=True, help="safetensors file to write")
    parser.add_argument("--iteration", type=int, default=None, help="default: the latest")
    args = parser.parse_args(argv)
    state = export_int8(args.load, args.output, args.iteration)
    n_int8 = sum(v.numel() for k, v in state.items() if k.endswith(".weight_int8"))
    n_float = sum(v.numel() for v in state.values() if v.is_floating_point())
    print(f"wrote {args.output}: {n_int8} int8 weights, {n_float} float32 values "
          f"({os.path.getsize(args.output) / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
