"""Pretrain a GPT model: Megatron's entry point, in its shape.

    torchrun --nproc_per_node=4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --num-layers 4 ... --mock-data --vocab-size 512

The four functions below are the whole model-specific part: model provider, batch, loss, forward step,
datasets provider. Everything else lives in ``megatron_like.training.pretrain``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_like import collectives as comm
from megatron_like.config import Config, DataConfig, parse_config_or_exit, print_once
from megatron_like.data.masks import get_ltor_documents_and_position_ids
from megatron_like.model import GPTModel
from megatron_like.model.context_parallel import sequence_mean_loss, split_batch
from megatron_like.model.mtp import mtp_loss
from megatron_like.parallel_state import ParallelState
from megatron_like.training import pretrain
from megatron_like.training.checkpoint_validation import exit_on_checkpoint_error
from megatron_like.training.loop import check_supported
from megatron_like.training.preflight import check_gpt_data


def vocab_and_eod(config: Config) -> tuple[int, int | None]:
    """Unpadded vocabulary size and end-of-document id (mock data: --vocab-size and no eod)."""
    if config.data.mock_data:
        return config.model.vocab_size, None
    from megatron_like.data.tokenizer import build_tokenizer

    d = config.data
    tokenizer = build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file, d.tokenizer_model,
                                config.model.vocab_size)
    return tokenizer.vocab_size, tokenizer.eod


def model_provider(config: Config, ps: ParallelState, *, layers: range, pre_process: bool,
                   post_process: bool, padded_vocab_size: int) -> GPTModel:
    """One GPT chunk holding ``layers`` (global indices) of this pipeline rank (fake-quantized with --qat)."""
    model = GPTModel(
        config.model, ps, vocab_size=padded_vocab_size, seed=config.training.seed, layers=layers,
        pre_process=pre_process, post_process=post_process,
        sequence_parallel=config.parallel.sequence_parallel, dtype=getattr(torch, config.params_dtype_name),
    )
    if config.model.qat:
        from megatron_like.quantization import insert_fake_quant

        insert_fake_quant(model, ps)
    return model


def get_batch(data_iterator: Iterator | None, device: torch.device, eod_token: int | None = None,
              data: DataConfig | None = None) -> dict[str, torch.Tensor | None]:
    """Split ``text [b, s + 1]`` into inputs ``[b, s]``, shifted labels ``[b, s]``, positions, loss mask and the
    packed documents' ids (None without --reset-attention-mask); ``data`` holds the packed-document flags
    (--eod-mask-loss, --reset-position-ids, --reset-attention-mask; None: all off) and ``eod_token`` is the data's
    end-of-document id (None for mock data, where --eod-mask-loss masks nothing)."""
    data = data or DataConfig()
    text = next(data_iterator)["text"].to(device)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    document_ids, loss_mask, positions = get_ltor_documents_and_position_ids(
        tokens, eod_token, reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask, eod_mask_loss=data.eod_mask_loss and eod_token is not None)
    return {"tokens": tokens, "labels": labels, "position_ids": positions, "loss_mask": loss_mask,
            "document_ids": document_ids}


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor, ps: ParallelState | None = None,
              mtp_loss_scaling_factor: float | None = None) -> tuple[torch.Tensor, dict]:
    """Mean of the per-token loss ``[b, s]`` over unmasked tokens; the stat is logged as 'lm loss'.

    With context parallelism (``ps.cp_size > 1``) the mean is over the whole sequence, whose other tokens the other
    cp ranks hold (``sequence_mean_loss``). With multi-token prediction (``mtp_loss_scaling_factor`` given,
    ``per_token_loss [1 + D, b, s]``) the depths' losses are added and logged as 'mtp_k loss'
    (megatron_like/model/mtp.py), each the mean over the whole sequence too.
    """
    if mtp_loss_scaling_factor is not None:
        return mtp_loss(loss_mask, per_token_loss, mtp_loss_scaling_factor, ps)
    if ps is not None and ps.cp_size > 1:
        loss, reported = sequence_mean_loss(per_token_loss, loss_mask, ps)
        return loss, {"lm loss": reported}
    loss = (per_token_loss.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator: Iterator | None, model: GPTModel, eod_token: int | None = None,
                 data: DataConfig | None = None) -> tuple[torch.Tensor, Callable]:
    """Run one micro batch through ``model``; return its output and how to turn it into a loss (``eod_token``,
    ``data``: as in get_batch).

    With context parallelism each cp rank keeps its two chunks of every ``[b, s]`` tensor (``split_batch``).
    """
    batch = split_batch(get_batch(data_iterator, model.ps.device, eod_token, data), model.ps)
    with_mtp = model.config.mtp_num_layers is not None
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                   document_ids=batch["document_ids"], with_mtp=with_mtp)
    factor = model.config.mtp_loss_scaling_factor if with_mtp else None
    return output, functools.partial(loss_func, batch["loss_mask"], ps=model.ps, mtp_loss_scaling_factor=factor)


def datasets_provider(config: Config, ps: ParallelState, num_samples: tuple[int, int, int]) -> tuple[Any, ...]:
    """Train, validation and test datasets of ``text [seq_length + 1]`` samples."""
    seq_length, seed = config.model.seq_length, config.training.seed
    if config.data.mock_data:
        from megatron_like.data.mock_dataset import MockGPTDataset

        return tuple(
            MockGPTDataset(n, seq_length, config.model.vocab_size, seed + split) if n > 0 else None
            for split, n in enumerate(num_samples)
        )
    from megatron_like.data.gpt_dataset import build_train_valid_test_datasets

    return build_train_valid_test_datasets(
        config.data.data_path, config.data.split, seq_length, seed, num_samples, config.data.data_cache_path,
        is_index_builder=ps.rank == 0, barrier=comm.barrier,
    )


def check_gpt_flags(config: Config) -> None:
    """check_supported plus the GPT data files and their token ids (before any process group starts)."""
    check_supported(config)
    if not config.data.mock_data:
        check_gpt_data(config.data, vocab_and_eod(config)[0])


def main(argv: list[str] | None = None) -> None:
    config = parse_config_or_exit(argv, extra_check=check_gpt_flags)
    vocab_size, eod = vocab_and_eod(config)
    padded_vocab_size = config.padded_vocab_size(vocab_size)
    # Megatron-LM's line, on stdout with the training log: the padding depends on tp (docs/tensor_parallel.md)
    print_once(f" > padded vocab (size: {vocab_size}) with {padded_vocab_size - vocab_size} dummy tokens "
               f"(new size: {padded_vocab_size})", file=sys.stdout)
    provider = functools.partial(model_provider, padded_vocab_size=padded_vocab_size)
    step = functools.partial(forward_step, eod_token=eod, data=config.data)
    with exit_on_checkpoint_error():  # a broken checkpoint or a busy --save: one line, status 1
        pretrain(config, provider, step, datasets_provider, padded_vocab_size=padded_vocab_size)
    comm.shutdown()


if __name__ == "__main__":
    main()
