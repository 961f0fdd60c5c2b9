"""``python -m inflight.executor.follower HOST PORT RANK SPEC``: a rank of a parallel engine started by
rank 0 (:meth:`~inflight.executor.parallel_runtime.Cluster.start`); exits when rank 0 shuts it down
(0) or when it or rank 0 fails (1)."""

from __future__ import annotations

import os
import sys

from inflight.executor.parallel_runtime import spawned_follower_main

if __name__ == "__main__":
    sys.stdout.flush()
    # No interpreter teardown: torch.distributed's and the kernels' threads must not delay the exit.
    os._exit(spawned_follower_main(sys.argv[1:]))
