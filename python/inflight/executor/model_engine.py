"""Model engine: turns a scheduled batch into the model's flat inputs and runs the forward.

One step's inputs: the tokens of each context chunk, then the decode requests that carry draft
tokens (speculative decoding: one causal row of ``1 + k`` tokens each, the newest token then the
drafts), then one token per other decode request (flattened, no padding), their positions, and the
:class:`AttentionMetadata` (block tables written by the C++ KV manager in one call, slot mapping,
lengths). Only rows whose logits are needed (a context's last chunk, every decode token, every
position of a drafting row; after those, the prompt positions of a request that asked for its
prompt's log-probabilities) go through the LM head.

Per-request state on the device is indexed by the request's sequence slot (``seq_slot``, from the
SeqSlotManager), as TensorRT-LLM indexes its decoder state: ``new_tokens[slot]`` is the newest token
sampled for the request. In overlap mode a decode's input token is read from there, on the device,
when the host has not appended it yet (it was sampled by the step still in flight).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from inflight.batch_manager import RequestList
from inflight.executor.resource_manager import KVCacheResourceManager
from inflight.executor.scheduler import ScheduledRequests
from inflight.layers.attention import AttentionMetadata


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sampled_requests: list  # requests with a logits row, in row order
    sampled_slots: torch.Tensor  # [len(sampled_requests)] int64: their seq_slots (rows of new_tokens)
    # Overlap mode: decode rows whose input token is still only on the device:
    # input_ids[pending_dst] = new_tokens[pending_slots].
    pending_dst: torch.Tensor | None = None
    pending_slots: torch.Tensor | None = None
    # Speculative decoding: logits rows per sampled request (1, or 1 + k for one with k drafts),
    # None when no request of the step carries drafts.
    num_rows: list[int] | None = None
    # SamplingParams.prompt_logprobs: logits rows after the sampled ones (``num_sampled_rows``), one
    # per scored prompt position; per request (request, its first position, the target tokens: the
    # prompt token after each position), in row order.
    num_sampled_rows: int = 0
    prompt_rows: list[tuple] | None = None
    # Beam search: the beam requests with a logits row this step and their row counts (1 for a
    # context's last chunk, K for a decode: one row per running beam). Their rows come after the
    # other sampled requests' and are counted in num_sampled_rows.
    beam_requests: list | None = None
    beam_num_rows: list[int] | None = None

    @property
    def num_beam_rows(self) -> int:
        return sum(self.beam_num_rows) if self.beam_num_rows else 0


def build_metadata(
    kv: KVCacheResourceManager,
    requests,
    tables: np.ndarray,
    positions: list[int],
    seq_lens: list[int],
    kv_lens: list[int],
    logits_indices: list[int],
    num_contexts: int,
    device: torch.device,
) -> AttentionMetadata:
    """A step's :class:`AttentionMetadata`: ``requests`` in row order (their block tables from ``kv``,
    written into the reused host buffer ``tables``), each row's flattened tokens at ``positions``.
    The index arithmetic runs in numpy and the tensors wrap its arrays: this runs once per step right
    after the forward streamed the weights through the caches, where each torch op's dispatch costs
    several times what it costs warm (measured in a SmolLM2 decode step: 0.31 ms as torch ops, 0.14
    ms in numpy)."""
    n = len(seq_lens)
    tpb = kv.tokens_per_block
    rows = tables[:n]
    if requests and not isinstance(requests[0], int) and not isinstance(requests, RequestList):
        requests = RequestList(requests)  # else KV sequence ids (beam search), or a RequestList
    kv.copy_block_tables(requests, rows)
    pos = np.array(positions, dtype=np.int64)
    lens = np.array(seq_lens, dtype=np.int32)
    seq_idx = np.repeat(np.arange(n), lens)  # each flattened token's row
    block_of, offset = np.divmod(pos, tpb)

    def slots(tables: np.ndarray) -> torch.Tensor:  # each flattened token's slot in the pool of `tables`
        return torch.from_numpy(tables[seq_idx, block_of].astype(np.int64) * tpb + offset).to(device)

    cu = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    metadata = AttentionMetadata(
        num_contexts=num_contexts,
        num_tokens=len(positions),
        tokens_per_block=tpb,
        seq_lens=torch.from_numpy(lens).to(device),
        cu_seqlens=torch.from_numpy(cu).to(device),
        kv_lens=torch.from_numpy(np.array(kv_lens, dtype=np.int32)).to(device),
        positions=torch.from_numpy(pos).to(device),
        slot_mapping=slots(rows),
        # A copy: `tables` is rewritten by the next step while this one may still be in flight.
        block_tables=torch.from_numpy(rows.copy()).to(device),
        logits_indices=torch.from_numpy(np.array(logits_indices, dtype=np.int64)).to(device),
        seq_lens_host=tuple(seq_lens),
        kv_lens_host=tuple(kv_lens),
    )
    if not kv.window_groups:
        return metadata
    # VSWA: the layers of each window read their own pool through their own block tables.
    by_window = {}
    for g in kv.window_groups:
        g_rows = np.zeros_like(rows)
        g.kv.copy_block_tables(requests, g_rows)
        by_window[g.window] = dataclasses.replace(
            metadata, block_tables=torch.from_numpy(g_rows).to(device), slot_mapping=slots(g_rows)
        )
    return dataclasses.replace(metadata, window_metadata=by_window)


class ModelEngine:
    """Builds a step's inputs and runs the model's forward; ``max_num_slots`` bounds ``seq_slot``."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_manager: KVCacheResourceManager,
        device: torch.device,
        max_batch_size: int,
        max_num_slots: int,
    ):
        self.model = model
        self.kv = kv_manager
        self.device = device
        self.tpb = kv_manager.tokens_per_block
        # Reused host buffer for the block tables (the C++ manager writes rows in place).
        self._tables = np.zeros((max_batch_size, kv_manager.impl.max_blocks_per_seq), dtype=np.int32)
        self.new_tokens = torch.zeros(max_num_slots, dtype=torch.int64, device=device)

    def prepare(
        self, batch: ScheduledRequests, pending_ids: set[int] | frozenset[int] = frozenset()
    ) -> ModelInputs:
        """``pending_ids``: requests whose newest token was sampled by the step still in flight and is
        not appended to the request yet (overlap mode): it is read from ``new_tokens``."""
        ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        kv_lens: list[int] = []
        logits_indices: list[int] = []
        sampled = []
        prompt_rows: list[tuple] = []  # (request, first position, count, first flattened token)
        # Beam search: (request, its rows' flattened tokens), logits rows placed after the others.
        beam_rows: list[tuple] = []
        table_ids: list[int] | None = None  # KV sequence per attention row, when beams add rows
        for req in batch.context_requests:
            start = req.context_current_position
            chunk = req.context_chunk_size
            base = len(ids)
            ids.extend(req.get_tokens(start, start + chunk))
            positions.extend(range(start, start + chunk))
            seq_lens.append(chunk)
            kv_lens.append(start + chunk)
            if req.is_last_context_chunk:
                if getattr(req, "py_beam", None) is not None:
                    beam_rows.append((req, [len(ids) - 1]))
                else:
                    logits_indices.append(len(ids) - 1)
                    sampled.append(req)
            if getattr(req, "py_prompt_logprobs", None) is not None:
                # Position p scores prompt token p + 1; the last prompt position is the sampled row.
                # A chunk computed again (a paused request's resume) scores nothing twice.
                lo = max(start, req.py_prompt_rows_planned)
                hi = min(start + chunk, req.orig_prompt_len - 1)
                if hi > lo:
                    prompt_rows.append((req, lo, hi - lo, base + lo - start))
                    req.py_prompt_rows_planned = hi
        gens = batch.generation_requests
        beams = [r for r in gens if getattr(r, "py_beam", None) is not None]
        if beams:
            gens = [r for r in gens if getattr(r, "py_beam", None) is None]
            table_ids = [r.request_id for r in batch.context_requests]
        drafting = [r for r in gens if r.has_draft_tokens]
        num_rows = None
        if drafting:
            # Drafting rows first (next to the contexts: both go through context attention), then the
            # single-token decodes (paged attention).
            gens = drafting + [r for r in gens if not r.has_draft_tokens]  # a list now
            num_rows = [1] * len(sampled)
        dst, src = [], []
        for req in gens:
            pos = req.num_tokens - 1
            if req.has_draft_tokens:
                drafts = req.draft_tokens
                k = len(drafts)
                first = len(ids)
                ids.append(req.last_token)
                ids.extend(drafts)
                positions.extend(range(pos, pos + 1 + k))
                seq_lens.append(1 + k)
                kv_lens.append(pos + 1 + k)
                logits_indices.extend(range(first, first + 1 + k))
                sampled.append(req)
                num_rows.append(1 + k)
                continue
            if req.request_id in pending_ids:
                pos += 1  # its newest token is still on the device
                dst.append(len(ids))
                src.append(req.seq_slot)
                ids.append(0)
            else:
                ids.append(req.last_token)
            positions.append(pos)
            seq_lens.append(1)
            kv_lens.append(pos + 1)
            logits_indices.append(len(ids) - 1)
            sampled.append(req)
            if num_rows is not None:
                num_rows.append(1)
        if table_ids is not None:
            table_ids.extend(r.request_id for r in gens)
        for req in beams:  # one decode row per running beam, each on its own KV sequence
            pos = req.num_tokens - 1
            first = len(ids)
            for sid, tok in zip(req.py_beam.seq_ids, req.py_beam.last_tokens):
                ids.append(tok)
                positions.append(pos)
                seq_lens.append(1)
                kv_lens.append(pos + 1)
                table_ids.append(sid)
            beam_rows.append((req, list(range(first, len(ids)))))
        for _, rows in beam_rows:
            logits_indices.extend(rows)

        num_sampled_rows = len(logits_indices)
        for _, _, count, first in prompt_rows:
            logits_indices.extend(range(first, first + count))
        if table_ids is not None:
            order = table_ids
            if len(order) > self._tables.shape[0]:  # beams: more rows than requests
                self._tables = np.zeros((len(order), self._tables.shape[1]), dtype=np.int32)
        elif num_rows is None:
            order = batch.all_requests
        else:
            order = list(batch.context_requests) + gens
        meta = build_metadata(
            self.kv,
            order,
            self._tables,
            positions,
            seq_lens,
            kv_lens,
            logits_indices,
            len(batch.context_requests),
            self.device,
        )
        dev = self.device
        slots = torch.tensor([r.seq_slot for r in sampled], dtype=torch.int64, device=dev)
        inputs = ModelInputs(torch.tensor(ids, dtype=torch.int64, device=dev), meta, sampled, slots)
        inputs.num_rows = num_rows
        inputs.num_sampled_rows = num_sampled_rows
        if beam_rows:
            inputs.beam_requests = [req for req, _ in beam_rows]
            inputs.beam_num_rows = [len(rows) for _, rows in beam_rows]
        if prompt_rows:
            # With each position's target: the prompt token after it.
            inputs.prompt_rows = [
                (req, lo, req.get_tokens(lo + 1, lo + 1 + count)) for req, lo, count, _ in prompt_rows
            ]
        if dst:
            inputs.pending_dst = torch.tensor(dst, dtype=torch.int64, device=dev)
            inputs.pending_slots = torch.tensor(src, dtype=torch.int64, device=dev)
        return inputs

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """The logits of the sampled rows (``[inputs.num_sampled_rows, vocab]``), then those of the
        scored prompt positions (``inputs.prompt_rows``)."""
        input_ids = inputs.input_ids
        if inputs.pending_dst is not None:
            input_ids = input_ids.index_copy(
                0, inputs.pending_dst, self.new_tokens.index_select(0, inputs.pending_slots)
            )
        return self.model(input_ids, inputs.metadata.positions, inputs.metadata, self.kv.kv_caches)

    @torch.inference_mode()
    def launch(self, inputs: ModelInputs):
        """Starts the forward: with pipeline stages a handle for :meth:`collect` (the micro-batch is on
        its way down the pipe), else the logits themselves."""
        launch = getattr(self.model, "launch", None)
        if launch is None:
            return self.forward(inputs)
        return launch(inputs.input_ids, inputs.metadata.positions, inputs.metadata, self.kv.kv_caches)

    def collect(self, launched) -> torch.Tensor:
        """The logits of a :meth:`launch`."""
        collect = getattr(self.model, "collect", None)
        return launched if collect is None else collect(launched)

    def store_new_tokens(self, inputs: ModelInputs, token_ids: torch.Tensor) -> None:
        """Records a step's sampled tokens in ``new_tokens``, by slot (on the device, no sync)."""
        self.new_tokens.index_copy_(0, inputs.sampled_slots, token_ids)

    def shutdown(self) -> None:
        """Drops the model (its weights) and the device buffers; a parallel model stops its ranks."""
        stop = getattr(self.model, "shutdown", None)
        if callable(stop):
            stop()
        self.model = None
        self.new_tokens = torch.empty(0, dtype=torch.int64)
