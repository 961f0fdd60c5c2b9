"""Model engine: turns a scheduled batch into the model's flat inputs and runs the forward.

One step's inputs: the tokens of each context chunk, then one token per decode request (flattened,
no padding), their positions, and the :class:`AttentionMetadata` (block tables written by the C++
KV manager in one call, slot mapping, lengths). Only rows whose logits are needed (a context's
last chunk, every decode) go through the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inflight.batch_manager import RequestList
from inflight.executor.resource_manager import KVCacheResourceManager, ScheduledBatch
from inflight.layers.attention import AttentionMetadata


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sampled_requests: list  # requests with a logits row, in row order
    # Overlap mode: decode rows whose input token is the previous step's sampled token, still on
    # the device: input_ids[dst] = prev_tokens[src].
    prev_token_dst: torch.Tensor | None = None
    prev_token_src: torch.Tensor | None = None


class ModelEngine:
    def __init__(self, model: torch.nn.Module, kv_manager: KVCacheResourceManager, device: torch.device,
                 max_batch_size: int):
        self.model = model
        self.kv = kv_manager
        self.device = device
        self.tpb = kv_manager.tokens_per_block
        # Reused host buffer for the block tables (the C++ manager writes rows in place).
        self._tables = np.zeros((max_batch_size, kv_manager.impl.max_blocks_per_seq), dtype=np.int32)

    def prepare(self, batch: ScheduledBatch, pending_rows: dict[int, int] | None = None) -> ModelInputs:
        """``pending_rows``: request id -> row of the previous step's sampled tokens that has not been
        appended to the request yet (overlap mode)."""
        ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        kv_lens: list[int] = []
        logits_indices: list[int] = []
        sampled = []
        for req in batch.context_requests:
            start = req.context_current_position
            chunk = req.context_chunk_size
            ids.extend(req.get_tokens(start, start + chunk))
            positions.extend(range(start, start + chunk))
            seq_lens.append(chunk)
            kv_lens.append(start + chunk)
            if req.is_last_context_chunk:
                logits_indices.append(len(ids) - 1)
                sampled.append(req)
        dst, src = [], []
        for req in batch.generation_requests:
            pos = req.num_tokens - 1
            row = pending_rows.get(req.request_id) if pending_rows else None
            if row is not None:
                pos += 1  # its newest token is still on the device
                dst.append(len(ids))
                src.append(row)
                ids.append(0)
            else:
                ids.append(req.last_token)
            positions.append(pos)
            seq_lens.append(1)
            kv_lens.append(pos + 1)
            logits_indices.append(len(ids) - 1)
            sampled.append(req)

        n = len(seq_lens)
        tables = self._tables[:n]
        self.kv.copy_block_tables(RequestList(batch.all_requests), tables)
        block_tables = torch.from_numpy(tables)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        seq_idx = torch.repeat_interleave(torch.arange(n), seq_lens_t)
        slot_mapping = block_tables[seq_idx, positions_t // self.tpb].to(torch.int64) * self.tpb + positions_t % self.tpb
        cu = torch.zeros(n + 1, dtype=torch.int32)
        torch.cumsum(seq_lens_t, 0, out=cu[1:])
        dev = self.device
        meta = AttentionMetadata(
            num_contexts=len(batch.context_requests),
            num_tokens=len(ids),
            tokens_per_block=self.tpb,
            seq_lens=seq_lens_t.to(dev),
            cu_seqlens=cu.to(dev),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=dev),
            positions=positions_t.to(dev),
            slot_mapping=slot_mapping.to(dev),
            block_tables=block_tables.to(dev, copy=True),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            seq_lens_host=tuple(seq_lens),
            kv_lens_host=tuple(kv_lens),
        )
        inputs = ModelInputs(torch.tensor(ids, dtype=torch.int64, device=dev), meta, sampled)
        if dst:
            inputs.prev_token_dst = torch.tensor(dst, dtype=torch.int64, device=dev)
            inputs.prev_token_src = torch.tensor(src, dtype=torch.int64, device=dev)
        return inputs

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        input_ids = inputs.input_ids
        if inputs.prev_token_dst is not None:
            input_ids = input_ids.index_copy(0, inputs.prev_token_dst, prev_tokens.index_select(0, inputs.prev_token_src))
        return self.model(input_ids, inputs.metadata.positions, inputs.metadata, self.kv.kv_caches)
