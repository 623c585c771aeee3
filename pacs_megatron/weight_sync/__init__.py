"""Actor -> rollout engine weight resharding: bucketed, measured, verified by a log-prob probe."""

from pacs_megatron.weight_sync.buckets import iter_buckets
from pacs_megatron.weight_sync.sync import SyncResult, WeightSync, WeightSyncer, WeightSyncError, probe_prompts

__all__ = ["SyncResult", "WeightSync", "WeightSyncError", "WeightSyncer", "iter_buckets", "probe_prompts"]
