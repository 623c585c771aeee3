"""Process groups for the Megatron actor: start-up checks, megatron's parallel_state, CPU patches.

Only this package and ``actor/`` import megatron; the rest of the project sees :class:`ParallelGroups`.
"""

from pacs_megatron.parallel.groups import (
    ParallelGroups,
    check_layout,
    destroy_parallel,
    init_distributed,
    initialize_parallel,
)

__all__ = ["ParallelGroups", "check_layout", "destroy_parallel", "init_distributed", "initialize_parallel"]
