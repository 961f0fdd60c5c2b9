"""The decoder layers in one C++ call per step on the CPU (``inflight._C.LlamaLayerStack``).

A Python decoder layer is ~15 torch ops; at SmolLM2's size each costs more in dispatch than in
arithmetic (30 layers x 15 ops x ~15 us is ~7 ms per step, against ~3 ms of GEMM for one token in
4-bit). :class:`FusedCpuLayers` hands the whole layer stack of a step to C++ instead: same weights,
same paged KV cache, same numerics (every rounding point of the Python layer is kept), no Python
between the ops. The same call reads each token's RoPE row from the model's whole table by position and
runs the model's ends too: on the first pipeline stage the token embedding (the model-dtype table, or
the int8 rows of a GGUF embedding), on the last the final norm of the rows whose logits are wanted and
the LM head (the tied int8 embedding or a dense head in the model dtype: the same kernels as the
Python model's head). Both give the Python model's bits. Each op left in Python costs more than its
arithmetic on a decode step, because the forward has just streamed the weights through the caches and
every host op around it runs cold (``INFLIGHT_FUSED_ENDS=0`` keeps the ends in Python).

Both branches of :class:`~inflight.models.llama.LlamaDecoderLayer` run fused: the Llama one (with
Qwen3's QK-norm) and Gemma 3's (``gemma=True``: (1 + w) norms, the sandwich norms, GeGLU, the
``query_pre_attn_scalar`` scale, each layer's attention window, and the sliding layers' own RoPE table,
passed as ``local_cos_sin``).

It is used by the ``native`` attention backend on the CPU when every projection is a kernel-backed
weight (:class:`~inflight.layers.quantized_linear.W4A16Linear` /
:class:`~inflight.layers.quantized_linear.W8A16Linear` / :class:`~inflight.layers.quantized_linear.W8A8Linear`,
or a dense
:class:`~inflight.layers.linear.Linear` in the model dtype through ``dense_gemm``) and the KV cache
has the model dtype, is INT8 (:class:`~inflight.layers.attention.Int8KvCache`, every layer's: the
stack's store quantises and its attention dequantises, as the native backend's kernels do) or is FP8
(:class:`~inflight.layers.attention.Fp8KvCache`, every layer's, with its scales); any other
configuration runs the Python layers, which remain the reference.
With dense weights and batch invariance off (``LLM(batch_invariant=False)``), steps of more than
``DENSE_MAX_TOKENS`` tokens (large prefills) also run the Python layers, where torch's GEMM is
faster; batch-invariant (the default), every step runs fused. ``INFLIGHT_FUSED_LAYERS=0``
turns it off (for A/B measurements).

Under tensor parallelism the stack holds this rank's slice of each layer and calls back into Python
after every o_proj and down_proj GEMM (``reduce``, with the GIL) to all-reduce the partial product,
so a TP step still runs its layers from C++, with two short Python calls per layer.
"""

from __future__ import annotations

import operator
import os

import torch
from torch.utils.dlpack import to_dlpack

from inflight import _C
from inflight.layers.attention import AttentionMetadata, Fp8KvCache, Int8KvCache, KvCacheLike
from inflight.layers.linear import Linear
from inflight.layers.native_attention import NativeAttentionBackend, plan_kernels
from inflight.layers.quantized_linear import W4A16Linear, W8A8Linear, W8A16Linear
from inflight.ops import batch_invariant
from inflight.utils.dtypes import SUPPORTED_DTYPES, dtype_name

__all__ = ["FusedCpuLayers", "fused_layers_enabled"]


def fused_layers_enabled() -> bool:
    return os.environ.get("INFLIGHT_FUSED_LAYERS", "1") != "0"


def fused_ends_enabled() -> bool:
    """``INFLIGHT_FUSED_ENDS=0`` keeps the model's ends in Python: the embedding, the final norm and the
    LM head (for A/B measurements)."""
    return os.environ.get("INFLIGHT_FUSED_ENDS", "1") != "0"


# The float cache dtypes the stack runs over, whatever the model dtype.
_FLOAT_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _same_objects(seen: tuple, caches: list[KvCacheLike]) -> bool:
    """Whether ``caches`` holds exactly the objects of ``seen``, in order (identity, not equality)."""
    return len(seen) == len(caches) and all(map(operator.is_, seen, caches))


def _caches_fuse(kv_caches: list[KvCacheLike]) -> bool:
    """Whether the stack can take these caches: all on the CPU, all INT8 or all FP8, or all float
    tensors of one dtype (bf16 under an fp32 model too: the stack converts q, k, v to it)."""
    if all(isinstance(c, Int8KvCache) for c in kv_caches) or all(
        isinstance(c, Fp8KvCache) for c in kv_caches
    ):
        return all(c.device.type == "cpu" for c in kv_caches)
    first = kv_caches[0].dtype if kv_caches and isinstance(kv_caches[0], torch.Tensor) else None
    return first in _FLOAT_CACHE_DTYPES and all(
        isinstance(c, torch.Tensor) and c.dtype == first and c.device.type == "cpu" for c in kv_caches
    )


# Above this many tokens in a step, a model with dense (fp32 / bf16) projections runs the Python
# layers: torch's GEMM (oneDNN) is the faster one for a large prefill, the fused kernels for decode.
DENSE_MAX_TOKENS = 64


def _kernel_weight(layer: torch.nn.Module):
    """The layer's imported kernel weight object (W4A16Weight, W8A16Weight, W8A8Weight, A8Weight or DenseWeight)."""
    if isinstance(layer, (W4A16Linear, W8A16Linear, W8A8Linear)):
        return layer.kernel_weight()._w
    return layer.kernel_weight()


def _dl(t: torch.Tensor):
    return to_dlpack(t)


class FusedCpuLayers:
    """The layer stack of a :class:`~inflight.models.llama.LlamaForCausalLM`, run from C++.

    Build with :meth:`build` (None when the model does not qualify, with the reason in
    :attr:`unsupported_reason` of the model). The weights are referenced, not copied.
    """

    def __init__(self, stack, num_layers: int, max_tokens: int | None) -> None:
        self._stack = stack
        self._num_layers = num_layers
        self.max_tokens = max_tokens  # a step with more tokens runs the Python layers (None: no limit)
        self._caches: list[KvCacheLike] | None = None  # the list last given to set_kv_caches
        self._cache_ids: tuple = ()  # their data pointers and window_pool flags
        self._bound: tuple = ()  # the caches themselves (identity) when _cache_ids was taken
        # accepts(): the last caches it checked (identity) and its verdict on them; None before any
        self._accepted: tuple[tuple, bool] | None = None
        # Some layer rotates with the model's second RoPE table (rotary_local): forward needs local_cos_sin.
        self.local_rope = False
        self.layer_windows: tuple[int, ...] = (0,) * num_layers  # each layer's attention window (0: global)
        # The stack also runs the model's end (final norm and LM head, forward(logits_rows=...)) when
        # this is the width of its logits (0: the model runs its head in Python).
        self.head_vocab = 0
        # It embeds the step's tokens itself (forward(input_ids=...)): the model's start.
        self.has_embedding = False

    @staticmethod
    def unsupported_reason(model) -> str | None:
        """Why ``model`` cannot run fused (None when it can)."""
        if not fused_layers_enabled():
            return "INFLIGHT_FUSED_LAYERS=0"
        if not isinstance(model.attention_backend, NativeAttentionBackend):
            return f"attention backend is {model.attention_backend.name!r}, not 'native'"
        if model.dtype not in SUPPORTED_DTYPES:
            return f"dtype {model.dtype}"
        if model.rotary.cos_sin.device.type != "cpu":
            return "not on the CPU"
        for i, layer in enumerate(model.layers):
            if getattr(layer, "moe", None) is not None:
                return f"layers[{i}] is a mixture-of-experts layer (no fused kernel)"
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                proj = getattr(layer, name, None)
                if isinstance(proj, (W4A16Linear, W8A16Linear, W8A8Linear)):
                    device = proj.weight_device  # not proj.qweight: that would rebuild dropped tensors
                elif isinstance(proj, Linear):
                    device = proj.weight.device
                    if proj.weight.dtype != model.dtype:
                        return f"layers[{i}].{name} holds {proj.weight.dtype}, the model runs {model.dtype}"
                else:
                    return f"layers[{i}].{name} is a {type(proj).__name__} (no fused kernel)"
                if device.type != "cpu":
                    return "not on the CPU"
        return None

    @classmethod
    def build(cls, model) -> FusedCpuLayers | None:
        if cls.unsupported_reason(model) is not None:
            return None
        c = model.config
        first = model.layers[0]  # this rank's shapes (a slice of each layer under tensor parallelism)
        gemma = first.gemma
        stack = _C.LlamaLayerStack(
            c.hidden_size,
            first.num_heads,
            first.num_kv_heads,
            c.head_dim,
            first.intermediate_size,
            float(c.rms_norm_eps),
            float(first.scale),
            dtype_name(model.dtype),
            qk_norm=first.q_norm is not None,
            gemma=gemma,
        )

        def norm(module):
            return _dl(module.weight.detach()) if module is not None else None

        local_rope = False
        for layer in model.layers:
            # As the Python layer: a sliding layer rotates with the local table when the model has one.
            local = bool(layer.window) and model.rotary_local is not None
            local_rope = local_rope or local
            stack.add_layer(
                norm(layer.input_layernorm),
                norm(layer.post_attention_layernorm),
                _kernel_weight(layer.qkv_proj),
                _kernel_weight(layer.o_proj),
                _kernel_weight(layer.gate_up_proj),
                _kernel_weight(layer.down_proj),
                q_norm=norm(layer.q_norm),
                k_norm=norm(layer.k_norm),
                pre_ffn_norm=norm(layer.pre_feedforward_layernorm),
                post_ffn_norm=norm(layer.post_feedforward_layernorm),
                # The Llama branch of the Python layer attends without a window.
                window=layer.window if gemma else 0,
                local_rope=local,
            )
        dense = any(
            isinstance(getattr(layer, name), Linear)
            for layer in model.layers
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        )
        fused = cls(stack, len(model.layers), DENSE_MAX_TOKENS if dense else None)
        fused.local_rope = local_rope
        fused.head_vocab = cls._set_head(stack, model)
        fused.has_embedding = cls._set_embedding(stack, model)
        fused.layer_windows = tuple(layer.window if gemma else 0 for layer in model.layers)
        return fused

    @staticmethod
    def _set_head(stack, model) -> int:
        """Gives the stack the model's end (final norm, LM head) when the last stage's head has a kernel
        the stack runs: the tied int8 embedding (or its TP shard), or a dense head in the model dtype (the
        Python model's CPU head is then the same dense kernel). Returns the head's rows (the logits'
        width), 0 when the head stays in Python."""
        if not model.stage.last or model.norm is None or not fused_ends_enabled():
            return 0
        head = model.lm_head_shard if model.lm_head_shard is not None else model.embedding
        if isinstance(head, (W4A16Linear, W8A16Linear)):
            if head.weight_device.type != "cpu":
                return 0
            weight, vocab = _kernel_weight(head), head.out_features
        elif head is None and model.lm_head is not None:
            w = model.lm_head.detach()
            if w.dtype != model.dtype or w.device.type != "cpu" or not w.is_contiguous():
                return 0
            weight, vocab = _C.DenseWeight(_dl(w), None), w.shape[0]
        else:
            return 0
        stack.set_head(_dl(model.norm.weight.detach()), weight, vocab)
        return vocab

    @staticmethod
    def _set_embedding(stack, model) -> bool:
        """Gives the first stage's stack the token embedding when it has a form the stack reads: the
        model-dtype table, or a W8A16Embedding of int8 codes with float16 scales. False: Python embeds."""
        if not model.stage.first or not fused_ends_enabled():
            return False
        scale = (
            float(torch.tensor(model.config.hidden_size**0.5, dtype=model.dtype))
            if model.config.is_gemma
            else 0.0
        )
        emb = model.embedding
        if emb is not None and emb.originals_dropped:  # its rows live only in its head's packed copy
            stack.set_embedding_packed(emb.kernel_weight()._w, scale)
            return True
        if emb is not None:
            q, s = emb.qweight.detach(), emb.scales.detach()
            if q.dtype != torch.int8 or s.dtype != torch.float16 or q.device.type != "cpu":
                return False
            stack.set_embedding(_dl(q), _dl(s.contiguous()), emb.group_size, scale)
            return True
        table = model.embed_tokens
        if (
            table is None
            or table.dtype != model.dtype
            or table.device.type != "cpu"
            or not table.is_contiguous()
        ):
            return False
        stack.set_embedding(_dl(table.detach()), None, 0, scale)
        return True

    @property
    def has_head(self) -> bool:
        """Whether forward can run the final norm and the LM head too (``logits_rows``)."""
        return self.head_vocab > 0

    def accepts(
        self,
        kv_caches: list[KvCacheLike],
        dtype: torch.dtype,
        num_tokens: int,
        metadata: AttentionMetadata | None = None,
    ) -> bool:
        """Whether this step runs fused: caches on the CPU, all of one float dtype, all INT8 or all FP8,
        not too many tokens, and (VSWA) at most one window pool, of a window of these layers."""
        windows = metadata.window_metadata if metadata is not None else None
        if windows and (len(windows) != 1 or next(iter(windows)) not in self.layer_windows):
            return False
        # Under batch invariance every step runs fused, whatever its size: a token must not change its
        # GEMM (torch's in the Python layers) with the size of the step it is in.
        if self.max_tokens is not None and num_tokens > self.max_tokens and not batch_invariant():
            return False
        # The caches' kinds are checked once per list of caches (the same objects every step): ~30 us
        # of attribute reads per step otherwise, right after the forward left the host cold.
        if self._accepted is not None and _same_objects(self._accepted[0], kv_caches):
            return self._accepted[1]
        verdict = _caches_fuse(kv_caches)
        self._accepted = (tuple(kv_caches), verdict)
        return verdict

    def _bind_caches(
        self, kv_caches: list[KvCacheLike], window_pool: tuple[bool, ...] | None = None, key_rotation: int = 0
    ) -> None:
        int8 = bool(kv_caches) and isinstance(kv_caches[0], Int8KvCache)
        fp8 = bool(kv_caches) and isinstance(kv_caches[0], Fp8KvCache)
        key_rotation = key_rotation if int8 else 0
        # The same cache objects as last time (no cache tensor is ever re-pointed in place): only the
        # flags can differ, and the data pointers need not be read again.
        same = self._caches is kv_caches and _same_objects(self._bound, kv_caches)
        if same and self._cache_ids[1:] == (window_pool, key_rotation):
            return
        tensors = [c.kv for c in kv_caches] if int8 or fp8 else kv_caches
        ids = (tuple(c.data_ptr() for c in tensors), window_pool, key_rotation)
        if self._caches is kv_caches and ids == self._cache_ids:
            self._bound = tuple(kv_caches)
            return
        scales = [_dl(c.scales) for c in kv_caches] if int8 else None
        fp8_scales = [s for c in kv_caches for s in (float(c.k_scale), float(c.v_scale))] if fp8 else None
        self._stack.set_kv_caches(
            [_dl(c) for c in tensors],
            scales,
            fp8_scales,
            list(window_pool) if window_pool else None,
            key_rotation=key_rotation,
        )
        self._caches, self._cache_ids, self._bound = kv_caches, ids, tuple(kv_caches)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden], model dtype; updated in place and returned
        cos_sin: torch.Tensor,  # [T, 2, head_dim], model dtype
        metadata: AttentionMetadata,
        kv_caches: list[KvCacheLike],
        tp=None,
        local_cos_sin: torch.Tensor | None = None,  # [T, 2, head_dim] of rotary_local (Gemma 3)
        key_rotation: int = 0,
        positions: torch.Tensor | None = None,  # [T] int64: cos_sin / local_cos_sin are whole tables
        logits_rows: torch.Tensor | None = None,  # [R] int64 (needs has_head)
        input_ids: torch.Tensor | None = None,  # [T] int64 (needs has_embedding)
    ) -> torch.Tensor:
        """``tp``: the model's :class:`~inflight.parallel.comm.TensorParallel`; with more than one rank
        the stack calls back after each o_proj and down_proj to all-reduce the partial products.
        ``local_cos_sin``: the RoPE rows of the sliding layers' table, read when :attr:`local_rope`
        (ignored otherwise). ``key_rotation``: over an INT8 cache, the Walsh-Hadamard block the layers
        rotate q and k with after RoPE, as the Python layers' ``key_rotation`` (0: none).
        ``positions``: the tokens' positions; ``cos_sin`` and ``local_cos_sin`` are then the whole RoPE
        tables (``[max_positions, 2, head_dim]``), read at each position in C++. ``input_ids``: the
        stack first overwrites ``hidden`` with their embeddings (an id outside the vocabulary is a
        ValueError naming it).

        Returns ``hidden``; with ``logits_rows`` (the step's tokens whose logits are wanted), the logits
        ``[R, vocab]`` in the model dtype of the final norm and the LM head over those rows instead."""
        # VSWA (accepts: one window pool): its layers read it through its own slots and block tables.
        window_md = next(iter(metadata.window_metadata.values())) if metadata.window_metadata else None
        window_pool = None
        if window_md is not None:
            w = next(iter(metadata.window_metadata))
            window_pool = tuple(lw == w for lw in self.layer_windows)
        self._bind_caches(kv_caches, window_pool, key_rotation)
        plan = plan_kernels(metadata)
        wplan = plan_kernels(window_md) if window_md is not None else None
        none = None
        reduce_buffer = reduce = None
        timeout = 120.0
        if tp is not None and tp.enabled:
            buf = torch.empty_like(hidden)
            reduce_buffer = _dl(buf)
            timeout = tp.timeout
            # Shared memory: the stack calls the all-reduce itself; otherwise back into Python (gloo).
            reduce = tp.shm if tp.shm is not None else (lambda: tp.all_reduce(buf))
        if positions is not None:
            positions = positions.to(torch.int64).contiguous()
        logits = None
        if logits_rows is not None:
            logits_rows = logits_rows.to(torch.int64).contiguous()
            logits = hidden.new_empty((logits_rows.shape[0], self.head_vocab))
        self._stack.forward(
            _dl(hidden),
            _dl(cos_sin),
            _dl(metadata.slot_mapping),
            plan.num_context_tokens,
            _dl(plan.ctx_block_tables) if plan.ctx_block_tables is not None else none,
            _dl(plan.ctx_cu_seqlens) if plan.ctx_cu_seqlens is not None else none,
            _dl(plan.ctx_kv_lens) if plan.ctx_kv_lens is not None else none,
            _dl(plan.dec_block_tables) if plan.dec_block_tables is not None else none,
            _dl(plan.dec_kv_lens) if plan.dec_kv_lens is not None else none,
            torch.get_num_threads(),
            reduce_buffer,
            reduce,
            timeout,
            _dl(local_cos_sin) if self.local_rope else none,
            _dl(window_md.slot_mapping) if wplan is not None else none,
            _dl(wplan.ctx_block_tables) if wplan is not None and wplan.ctx_block_tables is not None else none,
            _dl(wplan.dec_block_tables) if wplan is not None and wplan.dec_block_tables is not None else none,
            _dl(positions) if positions is not None else none,
            _dl(logits_rows) if logits is not None else none,
            _dl(logits) if logits is not None else none,
            _dl(input_ids.to(torch.int64).contiguous()) if input_ids is not None else none,
        )
        return hidden if logits is None else logits
