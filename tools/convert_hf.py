"""Convert between our checkpoints (any tp/pp/ep layout) and Hugging Face ``GPT2LMHeadModel``,
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MixtralForCausalLM``,
``Qwen3MoeForCausalLM`` and ``DeepseekV3ForCausalLM`` directories.

    python tools/convert_hf.py to-hf --load checkpoints/gpt --save hf/gpt
    python tools/convert_hf.py from-hf --load hf/llama --save checkpoints/llama-tp2pp2 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

The family follows the model: a GPT-2-style checkpoint (learned positions, LayerNorm, GELU, biases) becomes a
``GPT2LMHeadModel``; a Llama-style one (rope, RMSNorm, SwiGLU, no biases) a ``LlamaForCausalLM``, or a
``MistralForCausalLM`` with ``--window-size``, a ``Qwen2ForCausalLM`` with ``--add-qkv-bias``, a
``MixtralForCausalLM`` with ``--num-experts``; with ``--qk-layernorm`` a ``Qwen3ForCausalLM`` (``Qwen3MoeForCausalLM``
with ``--num-experts``); with ``--multi-latent-attention`` a ``DeepseekV3ForCausalLM`` (MTP depths included, as DeepSeek
publishes them). ``from-hf`` reads ``model_type`` (gpt2, llama, mistral, qwen2, qwen3, mixtral, qwen3_moe,
deepseek_v3).
A Mixtral, Qwen3-MoE or DeepSeek-V3 checkpoint holds each layer's experts as one
global ``[E, ...]`` tensor, which loads at any ``--expert-model-parallel-size`` (docs/moe.md); the flag here
records the layout in the saved arguments like the other layout flags.

``to-hf`` reads a checkpoint of either format and any layout as full weights, trims the padded vocabulary
to the real one (the tokenizer's, or ``--vocab-size`` of a mock-data run) and writes ``config.json``,
``model.safetensors`` and the tokenizer files when known (GPT-2 BPE: ``vocab.json`` + ``merges.txt``; HF:
``tokenizer.json``); ``transformers.GPT2LMHeadModel.from_pretrained(dir)`` loads it. ``from-hf`` writes a checkpoint at
iteration 0 in the torch_dist format, which loads at any layout (weights and config; no optimizer state:
continue training from it with ``--finetune``; the layout flags set the vocabulary padding and the saved
arguments; tools/checkpoint_reshard.py makes a torch-format one); it copies the tokenizer files into
``<save>/tokenizer/`` and records them in the checkpoint's config.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from megatron_like.config import Config, DataConfig, ModelConfig, QuietArgumentParser  # noqa: E402
from megatron_like.config.compare import lost_in_conversion  # noqa: E402
from megatron_like.inference import hf_deepseek_v3, hf_gpt2, hf_llama, hf_mixtral, hf_qwen3  # noqa: E402
from megatron_like.model.state import load_full_state  # noqa: E402


def tokenizer_files(data: DataConfig) -> dict[str, str]:
    """``{name in the HF dir: source file}`` of the tokenizer a config names (empty when unknown)."""
    if data.tokenizer_type == "HuggingFaceTokenizer" and data.tokenizer_model:
        path = data.tokenizer_model
        path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        return {"tokenizer.json": path} if os.path.isfile(path) else {}
    if data.tokenizer_type in (None, "GPT2BPETokenizer") and not (data.mock_data and data.tokenizer_type is None):
        vocab, merges = data.vocab_file, data.merge_file
        if vocab is None:
            from megatron_like.data.tokenizer import default_gpt2_files

            try:
                vocab, merges = default_gpt2_files()
            except RuntimeError:
                return {}
        if os.path.isfile(vocab) and os.path.isfile(merges):
            return {"vocab.json": vocab, "merges.txt": merges}
    return {}


def real_vocab(config: Config, rows: int, override: int | None) -> tuple[int, int | None]:
    """(real vocabulary size, end-of-text id) of a saved config."""
    if override is not None:
        return override, None
    from megatron_like.inference.loading import build_tokenizer_for

    try:
        tokenizer = build_tokenizer_for(config.data, config.model.vocab_size)
    except (OSError, ValueError, RuntimeError) as error:
        print(f"warning: cannot build the checkpoint's tokenizer ({error}); keeping the vocabulary size "
              "from the config (pass --vocab-size to choose)", file=sys.stderr)
        tokenizer = None
    if tokenizer is not None:
        return min(tokenizer.vocab_size, rows), tokenizer.eod
    return (config.model.vocab_size or rows), None


def to_hf(args: argparse.Namespace) -> None:
    config, full = load_full_state(args.load, args.iteration)
    rows = full["embedding.word_embeddings.weight"].shape[0]
    vocab, eod = real_vocab(config, rows, args.vocab_size)
    family = hf_family(config.model)
    hf_config = family.hf_config(config.model, vocab, eod)
    # Every compared model field (config/fields.py) must come back from the Hugging Face config unchanged.
    lost = lost_in_conversion(config.model, family.model_config_from_hf(hf_config), hf_config["architectures"][0])
    if lost is not None:
        raise ValueError(lost)
    hf_state = family.to_hf_state(full, config.model, vocab)
    hf_gpt2.save_hf_dir(args.save, hf_state, hf_config, tokenizer_files(config.data))
    print(f"wrote a {hf_config['architectures'][0]} ({config.model.num_layers} layers, vocabulary {vocab}) "
          f"to {args.save}")


def hf_family(model: ModelConfig):
    """The converter module of our model: DeepSeek-V3 (MLA), Qwen3 / Qwen3-MoE (QK-norm), Mixtral (experts),
    Llama-style, or GPT-2."""
    if model.multi_latent_attention:
        return hf_deepseek_v3
    if model.qk_layernorm:
        return hf_qwen3
    if model.num_experts is not None:
        return hf_mixtral
    return hf_llama if is_llama_style(model) else hf_gpt2


def is_llama_style(model: ModelConfig) -> bool:
    """Any modern-decoder flag routes to the Llama converter (which names whatever else is missing)."""
    return model.position_embedding_type == "rope" or model.normalization == "RMSNorm" or model.swiglu


def from_hf(args: argparse.Namespace) -> None:

    hf_config, hf_state = hf_gpt2.read_hf_dir(args.load)
    model_type = hf_config.get("model_type")
    families = {"mixtral": hf_mixtral, **dict.fromkeys(hf_llama.FAMILIES, hf_llama),
                **dict.fromkeys(hf_qwen3.FAMILIES, hf_qwen3), **dict.fromkeys(hf_deepseek_v3.FAMILIES, hf_deepseek_v3)}
    family = families.get(model_type, hf_gpt2)
    config = Config()
    deepseek = family is hf_deepseek_v3  # its MTP depths count only when the weights hold them
    config.model = (hf_deepseek_v3.model_config_from_hf(hf_config, hf_state.keys()) if deepseek
                    else family.model_config_from_hf(hf_config))
    p = config.parallel
    p.tensor_model_parallel_size = args.tensor_model_parallel_size
    p.pipeline_model_parallel_size = args.pipeline_model_parallel_size
    p.num_layers_per_virtual_pipeline_stage = args.num_layers_per_virtual_pipeline_stage
    p.expert_model_parallel_size = args.expert_model_parallel_size
    config.model.make_vocab_size_divisible_by = args.make_vocab_size_divisible_by
    # The smallest world of this layout: the expert-parallel ranks live inside data parallelism.
    config.world_size = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.expert_model_parallel_size
    config.data.mock_data = True  # validates without --data-path; the tokenizer below is recorded too
    tokenizer_dir = os.path.join(os.path.abspath(args.save), "tokenizer")
    if all(os.path.isfile(os.path.join(args.load, f)) for f in ("vocab.json", "merges.txt")):
        os.makedirs(tokenizer_dir, exist_ok=True)
        for name in ("vocab.json", "merges.txt"):
            shutil.copyfile(os.path.join(args.load, name), os.path.join(tokenizer_dir, name))
        config.data.tokenizer_type = "GPT2BPETokenizer"
        config.data.vocab_file = os.path.join(tokenizer_dir, "vocab.json")
        config.data.merge_file = os.path.join(tokenizer_dir, "merges.txt")
    elif os.path.isfile(os.path.join(args.load, "tokenizer.json")):
        os.makedirs(tokenizer_dir, exist_ok=True)
        shutil.copyfile(os.path.join(args.load, "tokenizer.json"), os.path.join(tokenizer_dir, "tokenizer.json"))
        config.data.tokenizer_type = "HuggingFaceTokenizer"
        config.data.tokenizer_model = os.path.join(tokenizer_dir, "tokenizer.json")
    config.validate()
    padded = config.padded_vocab_size(config.model.vocab_size)
    if deepseek:
        full = family.from_hf_state(hf_state, config.model, padded, hf_config.get("rope_interleave", True))
    else:
        full = family.from_hf_state(hf_state, config.model, padded)
    from megatron_like.training.dist_checkpointing import save_full_state

    if not config.model.untie_embeddings_and_output_weights:
        full.pop("output_layer.weight", None)  # the tied output layer reads the word embedding
    save_full_state(args.save, 0, config, {"model." + k: v for k, v in full.items()})
    print(f"wrote a torch_dist checkpoint (loads at any layout; vocabulary {config.model.vocab_size} padded to "
          f"{padded} for tp={p.tensor_model_parallel_size}) to {args.save}")


def build_parser() -> argparse.ArgumentParser:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("to-hf", help="our checkpoint -> Hugging Face GPT-2 / Llama / Qwen2 / Qwen3 / Mixtral / "
                                     "Qwen3-MoE / DeepSeek-V3 directory")
    a.add_argument("--load", required=True, help="Our checkpoint directory (any tp/pp/ep layout).")
    a.add_argument("--save", required=True, help="Output Hugging Face directory.")
    a.add_argument("--iteration", type=int, help="Iteration to convert (default: the latest).")
    a.add_argument("--vocab-size", type=int, help="Real vocabulary size (default: the tokenizer's or config's).")
    b = sub.add_parser("from-hf", help="Hugging Face GPT-2 / Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE / "
                                       "DeepSeek-V3 directory -> our checkpoint")
    b.add_argument("--load", required=True, help="Hugging Face model directory (config.json + weights).")
    b.add_argument("--save", required=True, help="Output checkpoint directory.")
    b.add_argument("--tensor-model-parallel-size", type=int, default=1)
    b.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    b.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    b.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="Mixtral, Qwen3-MoE, DeepSeek-V3: the expert-parallel size recorded in the saved arguments "
                        "(the experts load at any)")
    b.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        (to_hf if args.direction == "to-hf" else from_hf)(args)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
