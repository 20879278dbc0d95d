"""``benchmarks/plain_gpt_classification.py`` is the network ours is, trained from PyTorch's defaults.

``benchmarks/learning_quality.py finetune`` reads a gap between our dev accuracy and the plain fine-tune's as a
difference in how we fine-tune; that holds only while the plain classifier, given our weights, computes our
logits, loss and gradients (the same pooled token, the same head function). Pinned at a state away from the
initial one (every weight perturbed), on padded sequences of different lengths, where pooling the wrong token
would show. Its head is PyTorch's own ``nn.Linear`` (default initialization, with a bias), not our draw.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import finetune_gpt_classification
from megatron_like.config import ModelConfig
from megatron_like.model.classification import GPTClassificationModel
from megatron_like.parallel_state import ParallelState
from tests.unit.test_plain_gpt_reference import load_benchmark, plain_layout, plain_name

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, CLASSES = 2, 32, 4, 16, 256, 5


@pytest.fixture(scope="module")
def plain():
    return load_benchmark("plain_gpt_classification")


def ours_model() -> GPTClassificationModel:
    config = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                         hidden_dropout=0.0, attention_dropout=0.0)
    return GPTClassificationModel(config, ParallelState.single_process(), vocab_size=VOCAB, num_classes=CLASSES,
                                  seed=1234)


def test_plain_classifier_computes_our_loss_and_gradients(plain):
    torch.manual_seed(0)
    ours = ours_model()
    with torch.no_grad():
        for param in ours.parameters():  # leave the initial point: LayerNorms off 1/0, biases off 0
            param.add_(torch.randn_like(param) * 0.05)
    model = plain.PlainGPTClassifier(VOCAB, SEQ, LAYERS, HIDDEN, HEADS, CLASSES, hidden_dropout=0.0,
                                     attention_dropout=0.0)
    plain.plain_gpt.copy_weights(model.gpt, ours)
    with torch.no_grad():  # ours is bias-free
        model.head.weight.copy_(ours.head_weight)
        model.head.bias.zero_()
    tokens = torch.randint(0, VOCAB, (4, SEQ))
    last_index = torch.tensor([SEQ - 1, 6, 0, 11])  # full, padded, one token, padded
    labels = torch.tensor([0, 3, 4, 1])
    positions = torch.arange(SEQ).expand(4, SEQ)
    ours_logits = ours(tokens, positions, last_index=last_index)
    ours_loss, _ = finetune_gpt_classification.loss_func(labels, ours_logits)
    plain_logits = model(tokens, last_index)
    plain_loss = F.cross_entropy(plain_logits.float(), labels)
    ours_loss.backward()
    plain_loss.backward()
    torch.testing.assert_close(plain_logits, ours_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain_loss, ours_loss, rtol=1e-5, atol=0)
    plain_params = dict(model.named_parameters())
    assert len(plain_params) == len(list(ours.parameters())) + 1  # + the head's bias
    for name, param in ours.named_parameters():
        theirs = "head.weight" if name == "head_weight" else "gpt." + plain_name(name)
        torch.testing.assert_close(plain_layout(name, param.grad), plain_params[theirs].grad,
                                   rtol=1e-4, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    # The check sees the pooled token: the final position instead of the last real one moves the loss.
    with torch.no_grad():
        wrong = F.cross_entropy(model.head(model.gpt.hidden(tokens)[:, -1]), labels)
    assert abs(wrong.item() - ours_loss.item()) > 1e-3


def test_plain_head_is_pytorch_default_not_ours(plain):
    """The plain head is ``nn.Linear``'s default: a bias and U(-1/sqrt(h), 1/sqrt(h)) weights (std 1/sqrt(3h)),
    not our bias-free N(0, 0.02^2) draw."""
    torch.manual_seed(1234)
    model = plain.PlainGPTClassifier(VOCAB, SEQ, LAYERS, HIDDEN, HEADS, CLASSES)
    weight = model.head.weight
    assert model.head.bias is not None and weight.shape == ours_model().head_weight.shape
    bound = HIDDEN**-0.5
    assert weight.abs().max() <= bound and weight.abs().max() > 0.8 * bound
    assert abs(weight.std().item() / (bound / 3**0.5) - 1) < 0.15, f"plain head: std {weight.std():.4f}"


def test_plain_evaluation_leaves_the_training_rng_alone(plain):
    """``--eval-interval`` evaluates the dev set during training; the masks and the order drawn after it must be
    the ones a run without it draws (a ``DataLoader`` takes a seed from the global RNG)."""
    torch.manual_seed(1234)
    model = plain.PlainGPTClassifier(VOCAB, SEQ, LAYERS, HIDDEN, HEADS, CLASSES)
    dev = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (6, SEQ)), torch.full((6,), SEQ - 1),
                                         torch.randint(0, CLASSES, (6,)))
    before = torch.get_rng_state()
    metrics = plain.evaluate(model, dev, batch_size=4)
    assert metrics["samples"] == 6 and model.training
    assert torch.equal(torch.get_rng_state(), before)
