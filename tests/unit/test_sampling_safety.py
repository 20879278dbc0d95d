"""Sampling is numerically safe for every temperature the server accepts (issue 18: temperature 1e-300
gave inf/nan probabilities and killed a tensor-parallel server), row by row (a row's values do not depend on the
rows processed with it), and non-finite parameters are refused."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_like.inference import GenerationParams, process_logits


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40, 1e-8, 100.0])
def test_any_positive_temperature_gives_a_valid_distribution(temperature):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 4
    logits[0, 7] = logits[0].max() + 1e-3  # a near tie: the largest must keep all the mass when t -> 0
    logits[1, 3] = float("-inf")  # an id already removed (e.g. end-of-text before min_tokens)
    processed = process_logits(logits, temperature=temperature, top_k=10, top_p=0.9)
    probs = processed.softmax(dim=-1)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3))
    torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(1))  # raised on inf/nan before
    if temperature < 1e-30:
        assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and bool((probs.max(-1).values == 1).all())


def test_moderate_temperatures_keep_the_plain_division():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    assert torch.equal(process_logits(logits, temperature=0.7), logits / 0.7)  # Hugging Face's values


def test_each_row_is_processed_as_if_alone():
    """The server processes the rows of one sampling setting together: a row that overflows at a small temperature
    (a logit of 1e30 / 1e-10) must not change how its neighbour is processed."""
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    logits[0, 4] = 1e30
    together = process_logits(logits, temperature=1e-10, top_k=5, top_p=0.9)
    for row in range(2):
        assert torch.equal(together[row], process_logits(logits[row:row + 1], 1e-10, 5, 0.9)[0]), row


@pytest.mark.parametrize("field,value", [("temperature", math.nan), ("temperature", math.inf),
                                         ("top_p", math.nan), ("length_penalty", math.inf)])
def test_non_finite_parameters_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        GenerationParams(do_sample=field != "length_penalty", **{field: value}).validate()
