"""Tensor and pipeline parallelism: the rank math (:class:`Mapping`) and the process groups on
torch.distributed (:func:`init_process_groups`). docs/architecture.md, "The packages"."""

from inflight.parallel.distributed import (
    DEFAULT_TIMEOUT_S,
    ProcessGroups,
    destroy_process_groups,
    init_process_groups,
)
from inflight.parallel.mapping import Mapping

__all__ = ["DEFAULT_TIMEOUT_S", "Mapping", "ProcessGroups", "destroy_process_groups", "init_process_groups"]
