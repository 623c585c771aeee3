"""The Megatron-Core actor: GPTModel from HF configs and weights, log-probs, the PACS train step,
checkpoints and HF weights (the ``export`` and ``parity`` commands are in tools/). Import
:class:`MegatronActor` from here."""

from pacs_megatron.actor.actor import LogprobResult, MegatronActor

__all__ = ["LogprobResult", "MegatronActor"]
