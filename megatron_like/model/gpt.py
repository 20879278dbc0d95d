"""GPT-style decoder language model (GPT-2/3, Llama, Mistral, Qwen2; docs/models.md) from tensor-parallel layers.

One ``GPTModel`` is one pipeline chunk: the first chunk owns the embeddings, the last owns the final
LayerNorm and the output layer, and each holds a contiguous range of global layer indices. With one
process and one stage it is simply the whole model.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_like.config import ModelConfig
from megatron_like.kernels import fused_vocab_cross_entropy
from megatron_like.model.dropout import ActivationDropout
from megatron_like.model.mtp import MultiTokenPrediction
from megatron_like.model.norms import build_norm
from megatron_like.model.transformer import (
    TransformerLayer,
    embeddings_to_layers,
    forward_layers,
)
from megatron_like.parallel_state import ParallelState
from megatron_like.pipeline_parallel.placement import virtual_stage
from megatron_like.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    init_generator,
    mark_replicated,
    new_parameter,
    normal_init,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
    weight_grad,
)
from megatron_like.tensor_parallel.initialization import draw_slice

WORD_EMBEDDINGS = "embedding.word_embeddings"


def chunk_layers(num_layers: int, pp_size: int, pp_rank: int, vp_size: int = 1, vp_rank: int = 0,
                 v_shape: bool = False) -> range:
    """Global layer indices of model chunk ``vp_rank`` on pipeline stage ``pp_rank``.

    Interleaved assignment (Megatron): chunk v of stage p holds block ``v * pp_size + p`` of
    ``pp_size * vp_size`` equal blocks. Without virtual stages that is block p. With ``v_shape`` (zb-v,
    dualpipev: two chunks) chunk 0 holds block p and chunk 1 block ``2 * pp_size - 1 - p``
    (``pipeline_parallel/placement.py``).
    """
    per_chunk = num_layers // (pp_size * vp_size)
    start = virtual_stage(pp_size, pp_rank, vp_size, vp_rank, v_shape) * per_chunk
    return range(start, start + per_chunk)


class GPTEmbedding(nn.Module):
    """Word (+ learned position) embeddings, then dropout: ids ``[b, s]`` -> ``[s, b, h]``.

    The position table exists only with ``--position-embedding-type learned_absolute``; rotary positions
    are applied inside attention instead (megatron_like/model/rotary.py).
    """

    def __init__(self, config: ModelConfig, ps: ParallelState, vocab_size: int, seed: int,
                 sequence_parallel: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp_group, self.sequence_parallel = ps.tp_group, sequence_parallel
        self.dropout = ActivationDropout(config, ps, sequence_parallel, "embedding")
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size, config.hidden_size, tp_group=ps.tp_group, init_method=normal_init(config.init_method_std),
            seed=seed, name=WORD_EMBEDDINGS, dtype=dtype, device=ps.device,
        )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            shape = (config.max_positions, config.hidden_size)

            def draw_positions(out: torch.Tensor) -> None:
                generator = init_generator(seed, "embedding.position_embeddings.weight")
                draw_slice(out, normal_init(config.init_method_std), generator, shape)

            # Built on the meta device (no draw from the global generator), then given its own parameter.
            self.position_embeddings = nn.Embedding(*shape, device="meta")
            self.position_embeddings.weight = mark_replicated(
                new_parameter(shape, dtype, ps.device, draw_positions), sequence_parallel=False
            )

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(input_ids)  # (b, s, h)
        if self.position_embeddings is not None:
            x = x + weight_grad.embedding(position_ids, self.position_embeddings.weight)  # split in zero-bubble
        return embeddings_to_layers(x, self.tp_group, self.sequence_parallel, self.dropout, self.training)


class GPTModel(nn.Module):
    """A chunk of GPT: [embedding] -> layers -> [final norm -> output layer -> loss].

    Args:
        vocab_size: the padded vocabulary (a multiple of tp).
        layers: global indices of the transformer layers this chunk holds.
        pre_process: this chunk takes token ids (first pipeline stage, first chunk).
        post_process: this chunk produces the loss or logits (last stage, last chunk).
    """

    def __init__(self, config: ModelConfig, ps: ParallelState, *, vocab_size: int, seed: int,
                 layers: range | None = None, pre_process: bool = True, post_process: bool = True,
                 sequence_parallel: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        layers = range(config.num_layers) if layers is None else layers
        self.config, self.ps = config, ps
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel
        self.share_embeddings = not config.untie_embeddings_and_output_weights
        self.vocab_size = vocab_size
        self.cross_entropy_fusion = config.cross_entropy_loss_fusion
        self.input_tensor: torch.Tensor | None = None

        if pre_process:
            self.embedding = GPTEmbedding(config, ps, vocab_size, seed, sequence_parallel, dtype)
        self.layers = nn.ModuleList(
            TransformerLayer(config, ps, layer, seed, sequence_parallel, dtype) for layer in layers
        )
        if post_process:
            self.final_layernorm = build_norm(config, sequence_parallel, dtype, ps.device)
            # Tied weights: the first stage reuses its embedding; a separate last stage holds a copy
            # drawn from the same generator (so it starts equal) whose gradient is all-reduced with the
            # first stage's over the embedding group every step.
            reuse_embedding = self.share_embeddings and pre_process
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, vocab_size, tp_group=ps.tp_group,
                init_method=normal_init(config.init_method_std), seed=seed,
                name=WORD_EMBEDDINGS if self.share_embeddings else "output_layer",
                bias=False, sequence_parallel=sequence_parallel,
                skip_weight_param_allocation=reuse_embedding, dtype=dtype, device=ps.device,
                gemm_backend=config.cpu_gemm_backend,
                # Zero-bubble schedules: W would keep the logits' gradient [s, b, v / tp] (v / h times the
                # layer's input) for every pending micro batch, on the last stage, which has the most pending.
                defer_weight_grad=False,
            )
            if self.share_embeddings and not pre_process:
                self.output_layer.weight.shared_embedding = True
        # Multi-token prediction (model/mtp.py) on the last chunk; it looks tokens up in the word embedding. A
        # separate last stage without a tied copy gets one, tied to the first stage's like the output layer's.
        self.mtp = None
        self.mtp_embedding = None
        if post_process and config.mtp_num_layers:
            self.mtp = MultiTokenPrediction(config, ps, seed, sequence_parallel, dtype)
            if not pre_process and not self.share_embeddings:
                self.mtp_embedding = VocabParallelEmbedding(
                    vocab_size, config.hidden_size, tp_group=ps.tp_group,
                    init_method=normal_init(config.init_method_std), seed=seed, name=WORD_EMBEDDINGS, dtype=dtype,
                    device=ps.device,
                )
                self.mtp_embedding.weight.shared_embedding = True

    def shared_embedding_weight(self) -> nn.Parameter | None:
        """The weight tied across first and last stage held by this chunk (None if untied/absent): the word
        embedding, its last-stage copy in the output layer (tied) or for multi-token prediction (untied)."""
        if not (self.share_embeddings or self.config.mtp_num_layers):
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight if self.share_embeddings else self.mtp_embedding.weight
        return None

    def word_embedding_weight(self) -> torch.Tensor:
        """This chunk's ``[v / tp, h]`` word embedding rows: its own, or the last stage's tied copy."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight if self.share_embeddings else self.mtp_embedding.weight

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states ``[s, b, h]`` received from the previous pipeline stage (Megatron's hook)."""
        self.input_tensor = tensor

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        inference_context=None,
        document_ids: torch.Tensor | None = None,
        with_mtp: bool = False,
    ) -> torch.Tensor:
        """Run this chunk.

        Args:
            input_ids, position_ids: ``[b, s]`` token ids and positions (first chunk only).
            labels: ``[b, s]`` next-token ids (last chunk); without them the logits are returned.
            hidden_states: ``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism) from the
                previous pipeline stage (every chunk but the first); defaults to the tensor given to
                ``set_input_tensor`` by the pipeline schedule.
            inference_context: a KV cache (``megatron_like.inference.KVCache``) for generation: the
                layers attend over the cached tokens and the last chunk computes the logits of the
                last position only (``[b, 1, v / tp]``).
            document_ids: int64 ``[b, s]`` ids of the packed documents (``--reset-attention-mask``; every chunk):
                attention stays within equal ids. None: each sample is one sequence.
            with_mtp: with ``--mtp-num-layers`` and ``labels`` (last chunk): also run the multi-token prediction
                depths (they need ``input_ids`` on the last chunk too). Off, they are skipped (generation,
                evaluation of the next-token loss).
        Returns:
            the per-token loss ``[b, s]`` (float32) on the last chunk when ``labels`` are given (``[1 + D, b, s]``
            with ``with_mtp``: the LM loss then each MTP depth's, ``model/mtp.py``), its logits ``[b, s, v / tp]``
            otherwise, and the hidden states for the next stage elsewhere.
        """
        if self.pre_process:
            hidden_states = self.embedding(input_ids, position_ids)
        elif hidden_states is None:
            hidden_states = self.input_tensor
        if hidden_states is None:
            raise ValueError("a chunk without the embedding needs hidden_states from the previous stage")
        if inference_context is not None:
            for layer in self.layers:
                hidden_states = layer(hidden_states, inference_context)
            if not self.post_process:
                return hidden_states
            hidden_states = hidden_states[-1:]  # generation needs only the next-token logits
        else:
            hidden_states = forward_layers(self.layers, hidden_states, self.config, document_ids)  # recompute-aware
            if not self.post_process:
                return hidden_states

        hidden_states = self.final_layernorm(hidden_states)
        if labels is None:
            return self.logits(hidden_states).transpose(0, 1).contiguous()
        loss = self.per_token_loss(hidden_states, labels)
        if not (with_mtp and self.mtp is not None):
            return loss
        if input_ids is None:
            raise ValueError("multi-token prediction needs input_ids on the last chunk too")
        mtp_losses = self.mtp(hidden_states, input_ids, labels, self.embed_for_mtp, self.per_token_loss, document_ids)
        return torch.stack([loss, *mtp_losses])

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The output layer: normed ``[s, b, h]`` (or its sequence shard) -> ``[s, b, v / tp]``."""
        output_weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        return self.output_layer(hidden_states, weight=output_weight)

    def per_token_loss(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross entropy ``[b, s]`` (float32) of the output layer's logits of ``hidden_states`` against ``labels``."""
        logits = self.logits(hidden_states)  # (s, b, v / tp)
        labels = labels.transpose(0, 1)  # (s, b) like the logits
        if self.cross_entropy_fusion and self.ps.tp_group is None:
            # The csrc kernel keeps no softmax around and writes its gradient over the logits.
            loss = fused_vocab_cross_entropy(logits, labels, inplace_backward=True)
        else:
            loss = vocab_parallel_cross_entropy(logits, labels, self.ps.tp_group)
        return loss.transpose(0, 1)

    def embed_for_mtp(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Word embeddings of ``token_ids [b, s]`` in the layers' layout ``[s, b, h]`` (``[s / tp, b, h]`` with
        sequence parallelism), with the embedding dropout; no position embedding (model/mtp.py)."""
        x = vocab_parallel_embedding(token_ids, self.word_embedding_weight(), self.ps.tp_group)
        dropout = ActivationDropout(self.config, self.ps, self.sequence_parallel, "mtp.embedding")
        return embeddings_to_layers(x, self.ps.tp_group, self.sequence_parallel, dropout, self.training)
