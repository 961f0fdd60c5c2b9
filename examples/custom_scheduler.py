"""A user-written capacity policy (shortest prompt first) running through SimpleScheduler.

The capacity policy is plain Python; the micro-batch scheduler (token budget, chunked prefill) and
the KV cache accounting are the C++ ones. Run: python examples/custom_scheduler.py
"""

from __future__ import annotations

import random

from inflight.batch_manager import KVCacheManager, LlmRequest
from inflight.executor.scheduler import BindMicroBatchScheduler, CapacityScheduler, SimpleScheduler
from inflight.executor.simulator import SchedulingSimulator


class ShortestPromptFirst(CapacityScheduler):
    """Requests already holding KV keep running; new ones are admitted shortest prompt first.

    Like GUARANTEED_NO_EVICT it reserves every admitted request's blocks to completion, so nothing is
    ever paused; unlike it, a long prompt at the head of the queue does not block short ones.
    """

    def __init__(self, max_num_requests: int, kv_cache_manager: KVCacheManager):
        self.max_num_requests = max_num_requests
        self.kv = kv_cache_manager

    def schedule_request(self, active_requests):
        started = [r for r in active_requests if self.kv.has_sequence(r.request_id)]
        waiting = [r for r in active_requests if not self.kv.has_sequence(r.request_id)]
        fitting = started[: self.max_num_requests]
        available = self.kv.num_free_blocks - sum(
            self.kv.get_remaining_blocks_to_completion(r) for r in fitting
        )
        for req in sorted(waiting, key=lambda r: r.prompt_len):
            if len(fitting) >= self.max_num_requests:
                break
            needed = self.kv.get_remaining_blocks_to_completion(req)
            if needed <= available:
                fitting.append(req)
                available -= needed
        return fitting, []


def main() -> None:
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=40, tokens_per_block=16, max_seq_len=1024)
    scheduler = SimpleScheduler(
        ShortestPromptFirst(4, kv), BindMicroBatchScheduler(max_batch_size=4, max_num_tokens=512)
    )
    sim = SchedulingSimulator(scheduler, kv)
    for i in range(12):
        sim.add_request(LlmRequest(i, 8, [rng.randrange(1000) for _ in range(rng.randint(4, 300))]))
    started_order = []
    while not sim.idle:
        rec = sim.step()
        started_order += rec.context_ids
        print(
            f"step {rec.step:>3}: context {rec.context_ids} generation {rec.generation_ids} "
            f"free blocks {rec.num_free_blocks}"
        )
    lengths = {r.request_id: r.orig_prompt_len for r in sim.finished}
    print("admission order (id:prompt_len):", " ".join(f"{i}:{lengths[i]}" for i in started_order))


if __name__ == "__main__":
    main()
