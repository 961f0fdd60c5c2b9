"""Sizing the KV pool: how many blocks fit, and the start-up log line that says so.

GPU: a two-pass estimate, as TensorRT-LLM does: after the weights are loaded, a warm-up forward of
``max_num_tokens`` dummy tokens with a minimal KV pool measures the activation peak; the pool then
gets ``free_memory_fraction`` of what is free afterwards. CPU: ``free_memory_fraction`` of the
available memory (honouring a cgroup limit), capped at ``CPU_POOL_CAP_BYTES`` so that a laptop is not
swamped; the tensor is allocated lazily. ``memory_share`` (an engine of a model repository: 1/N of the
machine for N models) scales either budget; ``max_tokens`` caps both.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger("inflight")

CPU_POOL_CAP_BYTES = 4 << 30


@dataclass(frozen=True)
class KvBudget:
    num_blocks: int
    tokens_per_block: int
    bytes_per_token: int
    max_seq_len: int
    source: str  # how the size was chosen
    parallel: str = ""  # the mapping of a parallel engine ("tp=2 pp=1"): the pool is per rank
    dtype: str = ""  # the KV dtype's name, as the log line shows it ("int8": with fp32 scales; "fp8")
    num_secondary_blocks: int = 0  # the secondary tier (KvCacheConfig.host_cache_size), 0: none
    secondary: str = ""  # where the secondary tier lives ("host memory", "file /path")

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.tokens_per_block

    @property
    def bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_seq_len tokens that fit at once."""
        blocks_per_seq = -(-self.max_seq_len // self.tokens_per_block)
        return self.num_blocks / blocks_per_seq

    def describe(self) -> str:
        where = f" per rank ({self.parallel}, every rank the same blocks)" if self.parallel else ""
        kinds = {"": "", "int8": "int8 + fp32 scales, ", "fp8": "fp8 e4m3, "}
        kind = kinds.get(self.dtype, f"{self.dtype}, ")
        return (
            f"KV cache{where}: {self.num_blocks} blocks x {self.tokens_per_block} tokens = {self.num_tokens} tokens, "
            f"{self.bytes / 2**20:.1f} MiB ({kind}{self.bytes_per_token} B/token); max concurrency at "
            f"max_seq_len={self.max_seq_len}: {self.max_concurrency:.2f} sequences [{self.source}]"
            + self.describe_secondary()
        )

    def describe_secondary(self) -> str:
        if not self.num_secondary_blocks:
            return ""
        tokens = self.num_secondary_blocks * self.tokens_per_block
        return (
            f"; secondary tier: {self.num_secondary_blocks} blocks = {tokens} tokens, "
            f"{tokens * self.bytes_per_token / 2**20:.1f} MiB in {self.secondary}"
        )


def secondary_kv_blocks(kv_config, bytes_per_token: int) -> int:
    """Blocks of the secondary tier: ``host_cache_size // bytes per block`` (0 without one); a size
    that is not 0 but below one block is a ValueError naming it."""
    size = kv_config.host_cache_size
    if not size:
        return 0
    block_bytes = kv_config.tokens_per_block * bytes_per_token
    if size < block_bytes:
        raise ValueError(
            f"KvCacheConfig.host_cache_size must be 0, None or at least one KV block ({block_bytes} bytes: "
            f"tokens_per_block={kv_config.tokens_per_block} x {bytes_per_token} B/token), got {size}"
        )
    return size // block_bytes


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of every layer; an int8 cache's fp32 scale per KV head included (head_dim + 4 bytes); an
    fp8 cache one byte per element (its per-tensor scales take no pool memory)."""
    if dtype == torch.int8:
        return 2 * num_layers * num_kv_heads * (head_dim + 4)
    if dtype == torch.float8_e4m3fn:
        return 2 * num_layers * num_kv_heads * head_dim
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def cgroup_memory_limit() -> int | None:
    """The container's memory limit minus its current usage, or None when unlimited/unknown."""
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path) as f:
                raw = f.read().strip()
            if raw == "max":
                return None
            limit = int(raw)
            if limit >= 1 << 60:  # cgroup v1's "unlimited"
                return None
            usage = 0
            if os.path.exists(usage_path):
                with open(usage_path) as f:
                    usage = int(f.read().strip())
            return max(limit - usage, 0)
        except (OSError, ValueError):
            continue
    return None


def available_host_memory() -> int:
    """MemAvailable, bounded by the cgroup limit when there is one."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    limit = cgroup_memory_limit()
    return min(avail, limit) if limit is not None else avail


def cpu_kv_budget(kv_config, bytes_per_token: int, max_seq_len: int, share: int = 1) -> KvBudget:
    """``share``: ranks of a parallel engine on this machine (each gets ``1 / share`` of the budget)."""
    avail = available_host_memory()
    budget = min(int(avail * kv_config.free_memory_fraction), CPU_POOL_CAP_BYTES) // max(1, share)
    source = f"CPU: min({kv_config.free_memory_fraction:g} x {avail / 2**30:.1f} GiB available, {CPU_POOL_CAP_BYTES >> 30} GiB cap)"
    if kv_config.memory_share < 1.0:
        budget = int(budget * kv_config.memory_share)
        source += f" x {kv_config.memory_share:.3g} (this engine's share of the machine)"
    if share > 1:
        source += f" / {share} ranks on this machine"
    return _budget(kv_config, budget // bytes_per_token, bytes_per_token, max_seq_len, source)


def gpu_kv_budget(kv_config, bytes_per_token: int, max_seq_len: int, device: torch.device) -> KvBudget:
    """Call after the warm-up forward (the activation peak is then in the allocator's statistics)."""
    free, _total = torch.cuda.mem_get_info(device)
    # Memory the allocator holds but does not use is also available to the pool.
    reserved_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    peak_extra = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    usable = max(free + reserved_unused - peak_extra, 0)
    budget = int(usable * kv_config.free_memory_fraction * kv_config.memory_share)
    source = (
        f"GPU: {kv_config.free_memory_fraction:g} x {usable / 2**30:.2f} GiB free after weights and warm-up"
    )
    if kv_config.memory_share < 1.0:
        source += f" x {kv_config.memory_share:.3g} (this engine's share of the device)"
    return _budget(kv_config, budget // bytes_per_token, bytes_per_token, max_seq_len, source)


def _budget(kv_config, tokens: int, bytes_per_token: int, max_seq_len: int, source: str) -> KvBudget:
    if kv_config.max_tokens is not None and kv_config.max_tokens < tokens:
        tokens = kv_config.max_tokens
        source += f", capped by max_tokens={kv_config.max_tokens}"
    tpb = kv_config.tokens_per_block
    num_blocks = (
        -(-tokens // tpb)
        if kv_config.max_tokens is not None and tokens == kv_config.max_tokens
        else tokens // tpb
    )
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({tokens} tokens from {source}) is smaller than one block of "
            f"tokens_per_block={tpb}; raise KvCacheConfig.max_tokens or free_memory_fraction"
        )
    return KvBudget(num_blocks, tpb, bytes_per_token, max_seq_len, source)


@dataclass(frozen=True)
class WindowPoolPlan:
    """How VSWA splits one KV budget (``KvCacheConfig(sliding_window_pools=True)``): the global layers'
    pool of ``num_global_blocks`` and, per window, a pool of ``window_blocks[w]`` blocks for its
    ``window_layers[w]`` layers. ``sequences``: the sequences of max_seq_len tokens that fit at once
    (every one decoding, one more prompt being admitted), against ``sequences_without`` in one pool."""

    num_global_blocks: int
    window_blocks: dict[int, int]
    window_layers: dict[int, tuple[int, ...]]
    global_layers: tuple[int, ...]
    sequences: float
    sequences_without: float

    def describe(self, tokens_per_block: int) -> str:
        parts = ", ".join(
            f"window {w} ({len(self.window_layers[w])} layers): {n} blocks"
            for w, n in self.window_blocks.items()
        )
        return (
            f"KV cache, sliding-window pools (VSWA): {len(self.global_layers)} global layers: "
            f"{self.num_global_blocks} blocks x {tokens_per_block} tokens; {parts}; max concurrency at "
            f"max_seq_len: {self.sequences:.2f} sequences (one pool: {self.sequences_without:.2f})"
        )


def plan_window_pools(
    layer_windows: tuple[int, ...],
    num_blocks: int,
    tokens_per_block: int,
    max_seq_len: int,
    max_draft_len: int = 0,
) -> WindowPoolPlan | None:
    """Splits the bytes of ``num_blocks`` blocks of every layer between a global pool and one pool per
    window, for as many sequences of ``max_seq_len`` as fit: a global layer holds a whole sequence
    (``G = ceil(max_seq_len / tpb)`` blocks), a window-``W`` layer ``c = ceil((W + max_draft_len) /
    tpb) + 1`` blocks once it decodes (what its window and a step's drafts can see), and a prompt is
    allocated whole when admitted (so each window pool also keeps ``G - c`` blocks for one). With
    ``S`` sequences: ``l0 S G + sum_w lw (G + (S - 1) c_w) = L num_blocks`` (layer-blocks). None when no
    layer has a window below max_seq_len, none is global, or the split would not gain."""
    tpb = tokens_per_block
    g = -(-max_seq_len // tpb)
    windows: dict[int, list[int]] = {}
    global_layers = []
    for i, w in enumerate(layer_windows):
        if 0 < w < max_seq_len:
            windows.setdefault(w, []).append(i)
        else:
            global_layers.append(i)
    if not windows or not global_layers:
        return None
    caps = {w: min(g, -(-(w + max_draft_len) // tpb) + 1) for w in windows}
    total = len(layer_windows) * num_blocks
    l0 = len(global_layers)
    s = (total - sum(len(ls) * (g - caps[w]) for w, ls in windows.items())) / (
        l0 * g + sum(len(ls) * caps[w] for w, ls in windows.items())
    )
    num_global = int(s * g)
    if s < 1 or num_global <= num_blocks:
        return None
    window_blocks = {w: int(g + (s - 1) * caps[w]) + 1 for w in windows}
    # Rounding up the window pools may overshoot the budget by a few blocks: take them from the global pool.
    over = sum(len(windows[w]) * n for w, n in window_blocks.items()) + l0 * num_global - total
    if over > 0:
        num_global -= -(-over // l0)
    return WindowPoolPlan(
        num_global,
        window_blocks,
        {w: tuple(ls) for w, ls in windows.items()},
        tuple(global_layers),
        s,
        num_blocks / g,
    )
