"""GPT model code: ``transformer.py`` (layer) and ``gpt.py`` (embeddings, chunks, loss)."""

from megatron_like.model.gpt import GPTModel, chunk_layers

__all__ = ["GPTModel", "chunk_layers"]
