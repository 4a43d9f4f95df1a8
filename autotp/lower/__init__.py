"""Stage 6: plan + captured graph -> this rank's GraphModule, with collectives that know their backward."""

from autotp.lower.rewrite import lower, shard_tensor

__all__ = ["lower", "shard_tensor"]
