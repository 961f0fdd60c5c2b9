"""LlamaForCausalLM: one native model for Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2 and TinyLlama checkpoints.

Mixtral and Qwen3-MoE too: their sparse layers' MLP is a :class:`~inflight.models.moe.SparseMoeBlock`.

Numerics follow transformers' implementation op for op where it matters (RMSNorm in fp32 then cast,
RoPE cos/sin from fp32 tables cast to the model dtype, residual adds in the model dtype), so fp32
logits agree with ``AutoModelForCausalLM`` to ~1e-5.

Per layer the Python work is a fixed, small number of ops regardless of the batch: q/k/v are one
matmul and gate/up another (per-op overhead dominates at small sizes), RoPE is applied to q and k
together, and the attention backend handles all sequences of the flattened batch at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from inflight.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    Int8KvCache,
    KvCacheLike,
    key_rotation_block,
    key_rotation_enabled,
    key_rotation_matrices,
    key_rotation_shifts,
)
from inflight.layers.fused_cpu import FusedCpuLayers
from inflight.layers.linear import Linear, LinearFactory
from inflight.layers.norm import GemmaRMSNorm, RMSNorm
from inflight.layers.quantized_linear import W8A16Linear
from inflight.layers.rotary import RotaryEmbedding, apply_rotary, grow_tables
from inflight.layers.torch_attention import TorchAttentionBackend
from inflight.models.config import ModelConfig
from inflight.models.moe import make_moe_block, split_stacked_experts
from inflight.ops import batch_invariant
from inflight.ops.gemm import dense_gemm
from inflight.parallel.comm import SINGLE, TensorParallel
from inflight.parallel.sharding import (
    AttentionShard,
    PipelineStage,
    column_shard,
    head_rows,
    padded_vocab_size,
    row_parallel_slicer,
    vocab_shard,
)
from inflight.utils.dtypes import SUPPORTED_DTYPES

# Where a checkpoint tensor goes: a fused Linear's shard, or a plain parameter.
_LinearTarget = tuple[nn.Module, int, str]
_Target = _LinearTarget | nn.Parameter
# Tensor parallelism: what this rank keeps of a checkpoint tensor (applied before it is loaded).
_Slicer = Callable[[torch.Tensor], torch.Tensor]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        attention_backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str | None,
        linear_factory: LinearFactory,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        # This rank's heads (all of them with one rank): KV heads replicated when fewer than the ranks.
        self.shard = AttentionShard.of(
            config.num_attention_heads, config.num_key_value_heads, tp.rank, tp.size
        )
        self.num_heads = self.shard.num_heads
        self.num_kv_heads = self.shard.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if config.intermediate_size % tp.size:
            raise ValueError(
                f"intermediate_size={config.intermediate_size} is not divisible by "
                f"tensor_parallel_size={tp.size}"
            )
        self.intermediate_size = config.intermediate_size // tp.size
        self.scale = config.attention_scale
        self.window = config.window_of(layer_idx)  # 0: a global layer
        self.gemma = config.is_gemma
        self.attention_backend = attention_backend
        d = config.hidden_size
        kw = {"dtype": dtype, "device": device}
        norm = GemmaRMSNorm if self.gemma else RMSNorm
        self.input_layernorm = norm(d, config.rms_norm_eps, **kw)
        # A factory with for_module (a GGUF file's per-tensor types) picks each module's layer class.
        pick = getattr(linear_factory, "for_module", None)
        make = (lambda name: pick(layer_idx, name)) if pick is not None else (lambda name: linear_factory)
        self.qkv_proj = make("qkv_proj")(
            d, (self.q_size, self.kv_size, self.kv_size), bias=config.attention_bias, **kw
        )
        self.o_proj = make("o_proj")(self.q_size, (d,), bias=config.o_proj_bias, **kw)
        # QK-norm (Qwen3, Gemma 3): one RMSNorm over the head dimension for every q head, another for
        # every k head.
        self.q_norm = norm(config.head_dim, config.rms_norm_eps, **kw) if config.qk_norm else None
        self.k_norm = norm(config.head_dim, config.rms_norm_eps, **kw) if config.qk_norm else None
        self.post_attention_layernorm = norm(d, config.rms_norm_eps, **kw)
        # Gemma's "sandwich": the attention output is normed before the residual add (by
        # post_attention_layernorm), and the MLP has a norm on each side.
        self.pre_feedforward_layernorm = norm(d, config.rms_norm_eps, **kw) if self.gemma else None
        self.post_feedforward_layernorm = norm(d, config.rms_norm_eps, **kw) if self.gemma else None
        # A sparse (mixture-of-experts) layer's MLP; it has no dense gate_up_proj / down_proj then.
        # A GGUF file's quantised experts: one W4A16 / W8A16 layer per expert (dense: stacked experts).
        experts = (make("experts_gate_up"), make("experts_down")) if pick is not None else None
        if experts is not None and all(cls is Linear for cls in experts):
            experts = None
        self.moe = make_moe_block(config, layer_idx, dtype, device, tp, experts)
        # INT8 KV key rotation (attention.key_rotation_matrices): (k_mat, q_mat / k_mat: 1 or 1/2), set
        # by the model on its first step over an INT8 cache; None: queries and keys attend as they are.
        self.key_rotation: tuple[torch.Tensor, float] | None = None
        self.gate_up_proj = self.down_proj = None
        if self.moe is None:
            self.gate_up_proj = make("gate_up_proj")(
                d, (self.intermediate_size,) * 2, bias=config.mlp_bias, **kw
            )
            self.down_proj = make("down_proj")(self.intermediate_size, (d,), bias=config.mlp_bias, **kw)

    def checkpoint_targets(self, prefix: str) -> dict[str, _Target]:
        """HF tensor name -> where it is loaded."""
        targets: dict[str, _Target] = {
            f"{prefix}.input_layernorm.weight": self.input_layernorm.weight,
            f"{prefix}.post_attention_layernorm.weight": self.post_attention_layernorm.weight,
        }
        if self.q_norm is not None:
            targets[f"{prefix}.self_attn.q_norm.weight"] = self.q_norm.weight
            targets[f"{prefix}.self_attn.k_norm.weight"] = self.k_norm.weight
        if self.gemma:
            targets[f"{prefix}.pre_feedforward_layernorm.weight"] = self.pre_feedforward_layernorm.weight
            targets[f"{prefix}.post_feedforward_layernorm.weight"] = self.post_feedforward_layernorm.weight
        shards = [
            ("self_attn.q_proj", self.qkv_proj, 0),
            ("self_attn.k_proj", self.qkv_proj, 1),
            ("self_attn.v_proj", self.qkv_proj, 2),
            ("self_attn.o_proj", self.o_proj, 0),
            ("mlp.gate_proj", self.gate_up_proj, 0),
            ("mlp.up_proj", self.gate_up_proj, 1),
            ("mlp.down_proj", self.down_proj, 0),
        ]
        if self.moe is not None:
            targets.update(self.moe.checkpoint_targets(prefix))
            shards = shards[:4]
        for hf_name, module, shard in shards:
            for tensor_name in module.checkpoint_tensor_names():
                targets[f"{prefix}.{hf_name}.{tensor_name}"] = (module, shard, tensor_name)
        return targets

    def shard_slicers(self, prefix: str) -> dict[str, _Slicer]:
        """HF tensor name -> what this tensor-parallel rank keeps of it (empty with one rank). Each
        source tensor is sliced before it goes into its fused projection: rank r's q/k/v is
        ``cat(q_r, k_r, v_r)``."""
        tp = self.tp
        if not tp.enabled:
            return {}
        sh, hd = self.shard, self.head_dim
        column: dict[str, tuple[nn.Module, _Slicer]] = {
            "self_attn.q_proj": (self.qkv_proj, lambda t: head_rows(t, sh.q_start, sh.num_heads, hd)),
            "self_attn.k_proj": (self.qkv_proj, lambda t: head_rows(t, sh.kv_start, sh.num_kv_heads, hd)),
            "self_attn.v_proj": (self.qkv_proj, lambda t: head_rows(t, sh.kv_start, sh.num_kv_heads, hd)),
            "mlp.gate_proj": (self.gate_up_proj, lambda t: column_shard(t, tp.rank, tp.size)),
            "mlp.up_proj": (self.gate_up_proj, lambda t: column_shard(t, tp.rank, tp.size)),
        }
        row = [("self_attn.o_proj", self.o_proj), ("mlp.down_proj", self.down_proj)]
        slicers: dict[str, _Slicer] = {}
        if self.moe is not None:
            slicers.update(self.moe.shard_slicers(prefix))
            column = {k: v for k, v in column.items() if k.startswith("self_attn.")}
            row = row[:1]
        for hf_name, (module, fn) in column.items():
            for tensor_name in module.checkpoint_tensor_names():
                slicers[f"{prefix}.{hf_name}.{tensor_name}"] = fn
        for hf_name, module in row:
            for tensor_name in module.checkpoint_tensor_names():
                slicers[f"{prefix}.{hf_name}.{tensor_name}"] = row_parallel_slicer(
                    module, tensor_name, tp.rank, tp.size
                )
        return slicers

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        kv_cache: KvCacheLike,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(hidden))
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(num_tokens, -1, self.head_dim)
        if self.q_norm is not None:  # QK-norm per head, before RoPE
            qk = torch.cat(
                (self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1
            )
        # q and k rotate together: one RoPE application instead of two.
        qk = apply_rotary(qk, cos, signed_sin)
        rotate = self.key_rotation is not None and isinstance(kv_cache, Int8KvCache)
        if rotate:  # every head times k_mat (one matmul), then q by the rest of its scaling
            qk = qk @ self.key_rotation[0]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if rotate and self.key_rotation[1] != 1.0:
            q = q * self.key_rotation[1]
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.gemma:
            attn = self.attention_backend.forward(q, k, v, kv_cache, metadata, self.scale, self.window)
            attn = self.tp.all_reduce(self.o_proj(attn.reshape(num_tokens, self.q_size)))
            hidden = hidden + self.post_attention_layernorm(attn)
            gate_up = self.gate_up_proj(self.pre_feedforward_layernorm(hidden))
            inter = self.intermediate_size
            mlp = self.down_proj(F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:])
            return hidden + self.post_feedforward_layernorm(self.tp.all_reduce(mlp))
        attn = self.attention_backend.forward(q, k, v, kv_cache, metadata, self.scale)
        # Row-parallel o_proj / down_proj: each rank's partial product, summed over the ranks.
        hidden = hidden + self.tp.all_reduce(self.o_proj(attn.reshape(num_tokens, self.q_size)))
        if self.moe is not None:
            return hidden + self.tp.all_reduce(self.moe(self.post_attention_layernorm(hidden)))
        gate_up = self.gate_up_proj(self.post_attention_layernorm(hidden))
        inter = self.intermediate_size
        return hidden + self.tp.all_reduce(self.down_proj(F.silu(gate_up[:, :inter]) * gate_up[:, inter:]))


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids, positions, metadata, kv_caches) -> logits`` of the ``logits_indices`` rows.

    Parameters are allocated uninitialised; :meth:`load_weights` must fill every one of them (it
    raises otherwise). ``max_seq_len`` bounds the RoPE table (default: max_position_embeddings).

    Tensor parallelism (``tp`` of more than one rank): this rank's slice of every layer (its heads, its
    part of the MLP; ``load_weights`` slices the full checkpoint tensors), an all-reduce after o_proj and
    down_proj, replicated embedding, norms and RoPE, and a vocab-parallel LM head (the vocabulary padded
    to ``tp * ceil(V / tp)``) whose logits are gathered on TP rank 0: ``forward`` returns them there and
    None on the other ranks.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        attention_backend: AttentionBackend | None = None,
        *,
        max_seq_len: int | None = None,
        device: torch.device | str | None = None,
        linear_factory: LinearFactory = Linear,
        embedding_factory: Callable[..., nn.Module] | None = None,
        tp: TensorParallel = SINGLE,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, got {dtype}")
        if max_seq_len is None:
            max_seq_len = config.max_position_embeddings
        config.check_max_seq_len(max_seq_len)
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.stage = stage if stage is not None else PipelineStage.whole(config.num_hidden_layers)
        stage = self.stage
        tied = config.tie_word_embeddings
        # The token table: for the lookup (first stage) and, tied, as the LM head of the last stage
        # (under tensor parallelism that head is a block of the table, loaded on its own).
        has_table = stage.first or (stage.last and tied and not tp.enabled)
        self.max_seq_len = max_seq_len
        self.attention_backend = (
            attention_backend if attention_backend is not None else TorchAttentionBackend()
        )
        kw = {"dtype": dtype, "device": device}
        # A quantised tied embedding (e.g. W8A16Embedding): ``embed(ids)`` is the lookup, ``forward(hidden)``
        # the LM head, loaded through ``checkpoint_tensor_names`` / ``load_shard`` like a linear layer.
        self.embedding: nn.Module | None = None
        if embedding_factory is not None:
            if not tied:
                raise ValueError("embedding_factory needs tie_word_embeddings (it is also the LM head)")
            if has_table:
                self.embedding = embedding_factory(config.vocab_size, config.hidden_size, **kw)
        self.embed_tokens = (
            nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, **kw), requires_grad=False)
            if self.embedding is None and has_table and embedding_factory is None
            else None
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.attention_backend, dtype, device, linear_factory, tp)
            for i in stage.layers
        )
        norm = GemmaRMSNorm if config.is_gemma else RMSNorm
        self.norm = norm(config.hidden_size, config.rms_norm_eps, **kw) if stage.last else None
        # Tied: the very same tensor, so loading the embedding loads the head (and no memory is doubled).
        # Under tensor parallelism the head is this rank's block of the padded vocabulary (a tied one
        # too: loaded from the same checkpoint tensor); the embedding stays whole.
        self.head_rows = padded_vocab_size(config.vocab_size, tp.size) // tp.size
        self.lm_head_shard: nn.Module | None = None  # a quantised tied embedding's head block (TP)
        self.lm_head: nn.Parameter | None = None
        if not stage.last:
            pass  # no head on this stage
        elif tp.enabled and self.embedding is not None:
            emb = self.embedding
            self.lm_head_shard = W8A16Linear(
                config.hidden_size,
                (self.head_rows,),
                False,
                dtype,
                device,
                group_size=emb.group_size,
                scale_dtype=emb.scales.dtype,
            )
        elif tp.enabled:
            self.lm_head = nn.Parameter(
                torch.empty(self.head_rows, config.hidden_size, **kw), requires_grad=False
            )
        else:
            self.lm_head = (
                self.embed_tokens
                if config.tie_word_embeddings
                else nn.Parameter(
                    torch.empty(config.vocab_size, config.hidden_size, **kw), requires_grad=False
                )
            )
        # FusedCpuLayers once built, False when unsupported, None: not decided yet.
        self._fused = None
        self._key_rotation_set = False  # _set_key_rotation has run (on the first INT8-KV step)
        self.rotary = RotaryEmbedding(
            config.head_dim, max_seq_len, config.rope_theta, config.rope_scaling, dtype=dtype, device=device
        )
        # Gemma 3's sliding-window layers rotate with their own base (and no scaling).
        self.rotary_local = (
            RotaryEmbedding(
                config.head_dim, max_seq_len, config.rope_local_theta, None, dtype=dtype, device=device
            )
            if config.rope_local_theta is not None
            else None
        )

    # ---- shapes for the resource manager -------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Decoder layers on this rank (its pipeline stage's; all of them without pipelining)."""
        return len(self.layers)

    @property
    def num_kv_heads(self) -> int:
        """KV heads in this rank's cache (all of them with one rank)."""
        return self.layers[0].num_kv_heads if len(self.layers) else self.config.num_key_value_heads

    def kv_cache_shape(self, num_blocks: int, tokens_per_block: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's KV cache tensor (the layout of ``inflight.layers.attention``)."""
        return (2, num_blocks, tokens_per_block, self.num_kv_heads, self.config.head_dim)

    # ---- forward ---------------------------------------------------------------------------------

    def _set_key_rotation(self) -> None:
        """On the first step over an INT8 cache: every layer rotates its queries and keys
        (attention.key_rotation_matrices) unless ``INFLIGHT_KV_KEY_ROTATION=0``."""
        self._key_rotation_set = True
        if key_rotation_enabled():
            _, k_mat = key_rotation_matrices(self.config.head_dim, self.dtype, self.rotary.cos_sin.device)
            a, b = key_rotation_shifts(key_rotation_block(self.config.head_dim))
            for layer in self.layers:
                layer.key_rotation = (k_mat, 2.0 ** (b - a))

    def fused_layers(self):
        """The layer stack run from C++ (:class:`~inflight.layers.fused_cpu.FusedCpuLayers`), or None.

        Built on the first forward after the weights are loaded; None when the configuration does not
        qualify (see ``FusedCpuLayers.unsupported_reason``), and then the Python layers run.
        """
        if self._fused is False:
            return None
        if self._fused is None:
            built = FusedCpuLayers.build(self)
            self._fused = built if built is not None else False
            return built
        return self._fused

    def set_activation_quantization(self, mode: str) -> int:
        """``"int8"``: every weight-only-quantised linear layer (and a quantised LM head) quantises its
        input to int8 per group of 32 and runs the A8 GEMM on the CPU; ``"int16"``: the same with 16-bit
        codes (A16); ``"none"``: the model dtype. A MoE layer's experts keep the model dtype (their
        grouped kernel has no A8 path). Returns how many layers now run quantised activations."""
        skip = {id(self)} | {
            id(m) for layer in self.layers if layer.moe is not None for m in layer.moe.modules()
        }
        count = 0
        for module in self.modules():
            if id(module) not in skip and hasattr(module, "set_activation_quantization"):
                count += int(module.set_activation_quantization(mode))
        self._fused = None  # the fused stack holds the previous kernel weights
        return count

    def invalidate_fused_layers(self) -> None:
        """Forget the fused stack (it is rebuilt on the next forward): after replacing weights."""
        self._fused = None

    def _apply(self, fn, recurse: bool = True):  # .to() / .cuda() replace the tensors
        self._fused = None
        return super()._apply(fn, recurse)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        metadata: AttentionMetadata,
        kv_caches: list[
            KvCacheLike
        ],  # one per layer of this stage (a float tensor, Int8KvCache or Fp8KvCache)
        hidden: torch.Tensor | None = None,  # [T, hidden]: the previous stage's output (not on the first)
    ) -> torch.Tensor:  # [len(metadata.logits_indices), vocab] float32; [T, hidden] before the last stage
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"kv_caches must hold one tensor per layer ({len(self.layers)}), got {len(kv_caches)}"
            )
        fused = self.fused_layers()
        run_fused = fused is not None and fused.accepts(kv_caches, self.dtype, input_ids.shape[0], metadata)
        embed_ids = None  # the stack embeds these itself
        if hidden is None:
            if not self.stage.first:
                raise ValueError("a pipeline stage after the first needs the previous stage's hidden states")
            if run_fused and fused.has_embedding:
                embed_ids = input_ids
                hidden = torch.empty(input_ids.shape[0], self.config.hidden_size, dtype=self.dtype)
            elif self.embedding is not None:
                hidden = self.embedding.embed(input_ids)
            else:
                hidden = F.embedding(input_ids, self.embed_tokens)
            if self.config.is_gemma and embed_ids is None:  # scaled by sqrt(hidden), rounded to the dtype
                hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        grow_tables((self.rotary, self.rotary_local), positions)  # the CPU's tables follow the positions
        if not self._key_rotation_set and kv_caches and isinstance(kv_caches[0], Int8KvCache):
            self._set_key_rotation()
        if run_fused:
            rotated = len(self.layers) > 0 and self.layers[0].key_rotation is not None
            rotation = key_rotation_block(self.config.head_dim) if rotated else 0
            # Then the stack returns the logits (its buffers hold at most one row per token).
            head = self.stage.last and fused.has_head and len(metadata.logits_indices) <= input_ids.shape[0]
            out = fused.forward(
                hidden,
                self.rotary.cos_sin,  # read at each position in C++
                metadata,
                kv_caches,
                self.tp,
                self.rotary_local.cos_sin if fused.local_rope else None,
                key_rotation=rotation,
                positions=positions,
                logits_rows=metadata.logits_indices if head else None,
                input_ids=embed_ids,
            )
            if head:
                return self.tp.gather_logits(out.float(), self.config.vocab_size)
            hidden = out
        else:
            rope = self.rotary.lookup(positions)
            local = self.rotary_local.lookup(positions) if self.rotary_local is not None else rope
            for layer, kv_cache in zip(self.layers, kv_caches):
                md = metadata.for_window(layer.window)
                hidden = layer(hidden, *(local if layer.window else rope), kv_cache, md)
        if not self.stage.last:
            return hidden
        # The final norm is per token: apply it (and the LM head) only to the rows whose logits are wanted.
        hidden = self.norm(hidden.index_select(0, metadata.logits_indices))
        if self.lm_head_shard is not None:
            logits = self.lm_head_shard(hidden)
        elif self.embedding is not None:
            logits = self.embedding(hidden)
        elif run_fused or (hidden.is_cpu and batch_invariant()):
            # A decode-size step on the CPU: the small-M dense kernel (the head is ~20 % of the
            # weights); under batch invariance every CPU step (torch's GEMM depends on the rows).
            logits = dense_gemm(hidden, self.lm_head)
        else:
            logits = F.linear(hidden, self.lm_head)
        return self.tp.gather_logits(logits.float(), self.config.vocab_size)

    # ---- weights ---------------------------------------------------------------------------------

    def checkpoint_targets(self) -> dict[str, _Target]:
        """HF tensor name -> destination, for every tensor a checkpoint must provide."""
        targets: dict[str, _Target] = {}
        if self.norm is not None:
            targets["model.norm.weight"] = self.norm.weight
        if self.embedding is not None:
            for tensor_name in self.embedding.checkpoint_tensor_names():
                targets[f"model.embed_tokens.{tensor_name}"] = (self.embedding, 0, tensor_name)
        elif self.embed_tokens is not None:
            targets["model.embed_tokens.weight"] = self.embed_tokens
        if not self.config.tie_word_embeddings and self.lm_head is not None:
            targets["lm_head.weight"] = self.lm_head
        for layer in self.layers:
            targets.update(layer.checkpoint_targets(f"model.layers.{layer.layer_idx}"))
        return targets

    def _elsewhere(self, name: str) -> bool:
        """A checkpoint tensor another pipeline stage loads (never one this stage needs)."""
        if name.startswith("model.layers."):
            index = name.split(".", 3)[2]
            if not index.isdigit() or int(index) >= self.config.num_hidden_layers:
                return False  # no stage's: unexpected
            return int(index) not in self.stage.layers
        if name == "model.norm.weight" or name == "lm_head.weight":
            return not self.stage.last
        if name.startswith("model.embed_tokens."):
            return not self.stage.first and not (self.stage.last and self.config.tie_word_embeddings)
        return False

    def shard_slicers(self) -> dict[str, _Slicer]:
        """HF tensor name -> what this tensor-parallel rank keeps of it (empty with one rank)."""
        slicers: dict[str, _Slicer] = {}
        if not self.tp.enabled:
            return slicers
        tp = self.tp
        if not self.config.tie_word_embeddings:
            slicers["lm_head.weight"] = lambda t: vocab_shard(t, tp.rank, tp.size)
        for layer in self.layers:
            slicers.update(layer.shard_slicers(f"model.layers.{layer.layer_idx}"))
        return slicers

    def _load_tied_head(self, name: str, tensor: torch.Tensor) -> None:
        """Tensor parallelism with tied embeddings: this rank's head block, from the embedding tensor."""
        tp = self.tp
        if self.lm_head_shard is not None:
            tensor_name = name.rpartition(".")[2]
            self.lm_head_shard.load_shard(0, tensor_name, vocab_shard(tensor, tp.rank, tp.size))
        elif name == "model.embed_tokens.weight":
            self.lm_head.copy_(vocab_shard(tensor, tp.rank, tp.size))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (cast to the model dtype); every expected tensor exactly once.

        Raises ValueError naming the tensors on missing, unexpected or duplicate names and on a
        shape mismatch. Rotary ``inv_freq`` buffers are ignored (we compute our own), as is a
        ``lm_head.weight`` saved alongside tied embeddings (transformers ignores it too).
        """
        if self.config.num_experts:  # transformers' stacked expert tensors -> the per-expert names
            weights = split_stacked_experts(weights, self.config.model_type)
        targets = self.checkpoint_targets()
        slicers = self.shard_slicers()
        tied_tp = self.tp.enabled and self.config.tie_word_embeddings and self.stage.last
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if self._elsewhere(name):
                continue
            target = targets.get(name)
            if name in loaded:
                raise ValueError(f"checkpoint tensor {name!r} appears twice")
            if tied_tp and name.startswith("model.embed_tokens."):
                self._load_tied_head(name, tensor)
                if target is None:  # the table itself is the first stage's
                    loaded.add(name)
                    continue
            if target is None:
                unexpected.append(name)
                continue
            slicer = slicers.get(name)
            if slicer is not None:
                tensor = slicer(tensor)
            if isinstance(target, nn.Parameter):
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"shape mismatch for {name!r}: model expects {tuple(target.shape)}, "
                        f"checkpoint has {tuple(tensor.shape)}"
                    )
                target.copy_(tensor)
            else:
                module, shard, tensor_name = target
                try:
                    module.load_shard(shard, tensor_name, tensor)
                except ValueError as e:
                    raise ValueError(f"shape mismatch for {name!r}: {e}") from None
            loaded.add(name)
        self._fused = None  # the fused stack references the old weight objects
        missing = sorted(set(targets) - loaded)
        if unexpected or missing:
            parts = []
            if missing:
                parts.append(f"missing tensors ({len(missing)}): {_preview(missing)}")
            if unexpected:
                parts.append(f"unexpected tensors ({len(unexpected)}): {_preview(sorted(unexpected))}")
            raise ValueError("checkpoint does not match the model config: " + "; ".join(parts))


def _preview(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
