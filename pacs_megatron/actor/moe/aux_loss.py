"""The MoE load-balancing (aux) loss, scaled so that its gradient does not depend on the RL loss.

For MoE layer l and micro-batch i with t_i real tokens (padding and dummy micro-batches excluded)::

    aux_{l,i} = E * sum_e f_e * P_e      f_e = (top-k assignments to expert e) / (k * t_i)
                                         P_e = mean over the t_i tokens of the router's softmax prob of e

and the update follows the gradient of ``c * sum_l sum_{i,d} (t_i / T) * aux_{l,i}`` (c =
``model.moe_aux_loss_coeff``, T the mini-batch's real tokens over all micro-batches and DP ranks).
Megatron's own aux loss is off: its gradient scaled with the loss's units, padding and TP. A forward hook on
each router attaches the loss with the step constant ``s = c * U / T`` (U the loss units finalize divides by).
Why, the hook's TP share and HF's coefficient (c = router_aux_loss_coef * k / L): docs/models.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pacs_megatron.actor.moe.routing import router_valid_tokens, routers
from pacs_megatron.batch.rows import Rollouts
from pacs_megatron.parallel import ParallelGroups


class MoeAuxLoss:
    """Forward hooks adding the aux loss on every router of this rank (see the module docstring).

    Between :meth:`begin` and :meth:`end` (one train step) training forwards attach the loss; every
    other forward (log-probs, evaluation, the critic) is left alone.
    """

    def __init__(self, chunks: list, coeff: float, groups: ParallelGroups) -> None:
        self.coeff, self.groups = coeff, groups
        self.scale = 0.0
        """The step constant s = coeff * U / T (0 outside a train step)."""
        for _, router in routers(chunks):
            router.register_forward_hook(self._hook)

    def begin(self, micro: Sequence[Rollouts], units: float) -> None:
        """Before a train step over ``micro`` (real micro-batches) whose loss functions return ``units``
        in all: s = coeff * U / T with U and T summed over DP (collective over the DP group)."""
        g = self.groups
        tot = torch.tensor([units, float(sum(int(mb.seq_lens.sum()) for mb in micro))], dtype=torch.float64)
        if g.dp_size > 1:
            tot = tot.to(g.device)
            dist.all_reduce(tot, group=g.dp_group)
        u, t = tot.tolist()
        self.scale = self.coeff * u / t if u > 0 and t > 0 else 0.0

    def end(self) -> None:
        self.scale = 0.0

    def _hook(self, router, args, output):
        if self.scale == 0.0 or not router.training or not torch.is_grad_enabled():
            return None  # outside a train step, or the no-grad first pass of activation recompute
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        x, valid = router_valid_tokens(router, args)
        probs, routing_map = output
        n_exp, k = router.config.num_moe_experts, router.topk
        counts = (routing_map.reshape(-1, n_exp) & valid[:, None]).sum(0).to(torch.float64)
        tot = torch.cat([counts, valid.sum().to(torch.float64)[None]])
        if router.config.sequence_parallel and self.groups.tp_size > 1:  # the micro-batch over all shards
            dist.all_reduce(tot, group=self.groups.tp_group)
        counts, tokens = tot[:-1], float(tot[-1])
        if tokens == 0:
            return None  # a dummy micro-batch (all padding): no loss
        scores = F.softmax(F.linear(x.float(), router.weight.float()), dim=-1)  # differentiable
        p_sum = (scores * valid[:, None]).sum(0)
        aux = n_exp / (k * tokens * tokens) * (p_sum * counts.to(p_sum.dtype)).sum()
        return MoEAuxLossAutoScaler.apply(probs, aux * (self.scale * tokens)), routing_map
