"""Mixture of experts (docs/moe.md), one job per module, in the order a token meets them:

* ``router.py``: scores ``[T, E]`` (softmax, sigmoid), (group-limited) top-k, load-balancing (aux loss, sequence
  aux loss, Sinkhorn, expert bias), z-loss, capacity dropping;
* ``expert_bias.py``: the expert bias's update after each optimizer step (auxiliary-loss-free balancing);
* ``aux_losses.py``: how the router's losses reach the gradient (an autograd hook) and the training log;
* ``permutation.py``: tokens sorted by expert and back (argsort / index_select / index_add, no Python loop);
* ``token_dispatcher.py``: getting tokens to the expert-parallel rank holding their expert (all-gather or
  all-to-all) and the outputs back;
* ``experts.py``: the local experts, weights ``[E_local, in, out]``, one matmul per expert or a grouped GEMM;
* ``moe_layer.py``: the layer that replaces the MLP: the above in order, plus a shared expert.
"""

from megatron_like.model.moe.aux_losses import reduce_aux_losses, reset_aux_losses, set_aux_loss_backward_scale
from megatron_like.model.moe.moe_layer import MoELayer

__all__ = ["MoELayer", "reduce_aux_losses", "reset_aux_losses", "set_aux_loss_backward_scale"]
