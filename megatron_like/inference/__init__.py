"""Inference: generation (greedy, sampling, beam search) with a KV cache, checkpoint loading in any layout,
Hugging Face GPT-2 conversion. Entry points live in ``tools/`` (generate, server, convert_hf, evaluate, export).
"""

from megatron_like.inference.generation import Generation, GenerationParams, generate, process_logits
from megatron_like.inference.kv_cache import KVCache
from megatron_like.inference.loading import InferenceModel, load_inference_model

__all__ = [
    "Generation",
    "GenerationParams",
    "InferenceModel",
    "KVCache",
    "generate",
    "load_inference_model",
    "process_logits",
]
