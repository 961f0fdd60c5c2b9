"""The ``draft_model`` drafter: a second, smaller model with the target's tokenizer proposes drafts.

It has its own weights and its own paged KV pool (a C++ ``KVCacheManager`` without reuse, as many
tokens as the target's pool), indexed by the same request ids. Per step, for the scheduled requests
that draft:

1. catch up: the draft KV cache holds a prefix of the request's tokens. Tokens the target did not
   keep (rejected drafts fed last step) are rewound first, by comparing what was fed with what the
   request now holds; then the tokens the draft has not seen run as one causal row per request (a
   whole prompt the first time), and the row's last logits give draft 1;
2. draft ``j`` is fed back to get draft ``j + 1`` (one single-token decode per step, batched over
   requests), ``k - 1`` times.

A greedy request's drafts are the argmax of the draft model's processed logits; a sampled request's
are draws from them, returned with their distributions so the verification applies the rejection
rule (the output keeps the target's distribution). A request whose draft KV cannot grow (pool full)
gets no drafts that step. A different vocabulary, EOS or tokenizer is a ``ValueError`` at start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from inflight.executor.model_engine import build_metadata
from inflight.executor.resource_manager import KVCacheResourceManager
from inflight.executor.sampler import Sampler
from inflight.executor.speculative import Draft, Drafter

logger = logging.getLogger("inflight")


def check_compatible(target_config, target_tokenizer, draft_config, draft_tokenizer, name: str) -> None:
    """The draft must speak the target's tokens: same vocabulary size, EOS ids and tokenizer."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"SpeculativeConfig.draft_model {name!r} has a vocabulary of {draft_config.vocab_size} tokens, "
            f"the target model {target_config.vocab_size}: the draft model must share the target's tokenizer"
        )
    if tuple(draft_config.eos_token_ids) != tuple(target_config.eos_token_ids):
        raise ValueError(
            f"SpeculativeConfig.draft_model {name!r} has EOS token ids {list(draft_config.eos_token_ids)}, "
            f"the target model {list(target_config.eos_token_ids)}: the special tokens must be the same"
        )
    if target_tokenizer is not None and draft_tokenizer is not None:
        tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if tv != dv:
            diff = sorted(set(tv.items()) ^ set(dv.items()))[:3]
            raise ValueError(
                f"SpeculativeConfig.draft_model {name!r} has another tokenizer than the target model "
                f"(first differences, token -> id: {diff}): the draft model must share the target's tokenizer"
            )


class DraftModelDrafter(Drafter):
    name = "draft_model"

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCacheResourceManager,
        sampler: Sampler,
        device: torch.device,
        max_batch_size: int,
    ) -> None:
        self.model = model
        self.kv = kv
        self.sampler = sampler
        self.device = device
        self._tables = np.zeros((max_batch_size, kv.impl.max_blocks_per_seq), dtype=np.int32)
        # request id -> (tokens the request held when its drafts were fed, the drafts fed after them)
        self._fed: dict[int, tuple[int, list[int]]] = {}

    @classmethod
    def create(
        cls,
        path: str,
        *,
        target_config,
        target_tokenizer,
        device: torch.device,
        dtype: torch.dtype | None,
        num_tokens: int,
        tokens_per_block: int,
        max_seq_len: int,
        max_batch_size: int,
        quantization: str | None = None,
    ) -> DraftModelDrafter:
        """Loads the draft model and sizes its pool for ``num_tokens`` tokens (the target pool's)."""
        from inflight.models.loader import load_model

        loaded = load_model(
            path, dtype=dtype, device=device, max_seq_len=max_seq_len, quantization=quantization
        )
        check_compatible(target_config, target_tokenizer, loaded.config, loaded.tokenizer, path)
        cfg = loaded.config
        # Room for the drafts of the longest sequence beyond the target's tokens.
        kv = KVCacheResourceManager.allocate(
            loaded.model.num_layers,
            loaded.model.num_kv_heads,
            cfg.head_dim,
            -(-num_tokens // tokens_per_block) + max_batch_size,
            tokens_per_block,
            max_seq_len,
            loaded.dtype,
            device,
            False,
        )
        logger.info(
            "draft model %s: %d layers, KV pool %d blocks (%.1f MiB)",
            path,
            cfg.num_hidden_layers,
            kv.num_blocks,
            kv.bytes / 2**20,
        )
        return cls(loaded.model, kv, Sampler(target_config.vocab_size), device, max_batch_size)

    # ------------------------------------------------------------------ drafting
    def _catch_up_row(self, req) -> tuple[int, list[int]] | None:
        """(first position, tokens) the draft has not seen, after rewinding what the target rejected;
        None when the pool has no room."""
        impl = self.kv.impl
        rid = req.request_id
        n = req.num_tokens
        if not impl.has_sequence(rid):
            try:
                impl.add_sequence(rid, n, 1, None)
            except RuntimeError:
                return None
            return 0, req.get_tokens(0)
        held = impl.get_num_tokens(rid)
        valid = held
        fed = self._fed.pop(rid, None)
        if fed is not None:
            n0, drafts = fed
            now = req.get_tokens(n0, n0 + len(drafts))
            match = 0
            while match < len(now) and now[match] == drafts[match]:
                match += 1
            valid = n0 + match
        valid = min(valid, n - 1)  # the newest token is always fed (its logits give draft 1)
        if held > valid:
            impl.rewind(rid, held - valid)
        try:
            impl.add_tokens(rid, n - valid)
        except RuntimeError:
            return None
        return valid, req.get_tokens(valid)

    @torch.inference_mode()
    def _forward(self, reqs: list, starts: list[int], rows: list[list[int]]) -> torch.Tensor:
        """The draft model over one row per request (multi-token rows first); last logits of each."""
        order = sorted(range(len(reqs)), key=lambda i: -len(rows[i]))
        ids: list[int] = []
        positions: list[int] = []
        seq_lens, kv_lens, last = [], [], []
        for i in order:
            ids.extend(rows[i])
            positions.extend(range(starts[i], starts[i] + len(rows[i])))
            seq_lens.append(len(rows[i]))
            kv_lens.append(starts[i] + len(rows[i]))
            last.append(len(ids) - 1)
        meta = build_metadata(
            self.kv,
            [reqs[i] for i in order],
            self._tables,
            positions,
            seq_lens,
            kv_lens,
            last,
            sum(1 for s in seq_lens if s > 1),
            self.device,
        )
        ids_t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        logits = self.model(ids_t, meta.positions, meta, self.kv.kv_caches)
        back = torch.empty(len(order), dtype=torch.int64)
        back[torch.tensor(order)] = torch.arange(len(order))
        return logits.index_select(0, back.to(logits.device))

    def _choose(self, logits: torch.Tensor, reqs: list, drafts: list[list[int]], probs: list[list]) -> None:
        """One more draft per request: argmax for greedy requests, a keyed draw for sampled ones."""
        states = [r.py_sampling_state.extended(d) if d else r.py_sampling_state for r, d in zip(reqs, drafts)]
        processed = self.sampler.process_logits(logits, states)
        greedy = processed.argmax(dim=-1).tolist()
        for i, state in enumerate(states):
            if state.params.greedy:
                drafts[i].append(greedy[i])
                continue
            q = torch.softmax(processed[i].float(), dim=-1)
            gen = torch.Generator().manual_seed(
                (state.rng_seed * 999_983 + state.num_generated * 7 + 1) % 2**63
            )
            drafts[i].append(int(torch.multinomial(q, 1, generator=gen)))
            probs[i].append(q)

    def propose(self, requests: Sequence, max_lens: Sequence[int]) -> list[Draft]:
        out = [Draft([]) for _ in requests]
        live, starts, rows, ks = [], [], [], []
        for i, req in enumerate(requests):
            row = self._catch_up_row(req)
            if row is None:
                continue
            live.append(i)
            starts.append(row[0])
            rows.append(row[1])
            ks.append(max_lens[i])
        if not live:
            return out
        reqs = [requests[i] for i in live]
        drafts: list[list[int]] = [[] for _ in live]
        probs: list[list] = [[] for _ in live]
        self._choose(self._forward(reqs, starts, rows), reqs, drafts, probs)
        impl = self.kv.impl
        for j in range(1, max(ks)):
            step = [a for a in range(len(reqs)) if ks[a] > j]
            fed = []
            for a in step:
                try:
                    impl.add_token(reqs[a].request_id)
                except RuntimeError:
                    ks[a] = j  # no room for another draft: stop here
                    continue
                fed.append(a)
            if not fed:
                break
            logits = self._forward(
                [reqs[a] for a in fed],
                [reqs[a].num_tokens - 1 + j for a in fed],
                [[drafts[a][j - 1]] for a in fed],
            )
            sub_d = [drafts[a] for a in fed]
            sub_p = [probs[a] for a in fed]
            self._choose(logits, [reqs[a] for a in fed], sub_d, sub_p)
        for a, i in enumerate(live):
            req = reqs[a]
            # Fed into the draft KV: every draft but the last.
            self._fed[req.request_id] = (req.num_tokens, drafts[a][: len(drafts[a]) - 1])
            p = torch.stack(probs[a]) if probs[a] else None
            out[i] = Draft(drafts[a], p)
        return out

    def free(self, request) -> None:
        self._fed.pop(request.request_id, None)
        if self.kv.impl.has_sequence(request.request_id):
            self.kv.impl.remove_sequence(request.request_id, None)

    def shutdown(self) -> None:
        self.kv.shutdown()
        self.model = None
