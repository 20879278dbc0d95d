"""Data: tokenizers, the mmap indexed dataset, GPT samples, blending, samplers.

Import submodules directly (``from megatron_like.data.tokenizer import build_tokenizer``): the data tools
import the torch-free ones (``tokenizer``, ``indexed_dataset``, ``index_helpers``) without loading torch.
"""
