"""Test helpers: tiny random Hugging Face models (offline) and paged-KV step drivers.

- :func:`make_tiny_model` writes a tiny checkpoint of one of ``ARCHS`` (config.json +
  model.safetensors, optionally a byte-level BPE tokenizer with a chat template) into a directory.
- :func:`make_attention_metadata` builds one step's :class:`AttentionMetadata` from per-sequence
  (block_ids, num_cached, num_new).
- :class:`PagedKV` allocates shuffled, non-contiguous blocks and per-layer KV tensors, and turns
  "these sequences get these tokens this step" into (input_ids, positions, metadata).

Nothing here downloads anything.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from inflight.layers.attention import AttentionMetadata

ARCHS = ("llama", "qwen2", "mistral", "qwen3", "gemma3", "mixtral", "qwen3_moe")

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = [
    "The capital of France is Paris.",
    "What is the capital of France?",
    "Hello world! How are you today?",
    "A quick brown fox jumps over the lazy dog.",
    "Large language models predict the next token.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "One two three four five six seven eight nine ten.",
    "def main():\n    print('hello, world')\n",
    "Tokens per block, block tables and slot mappings.",
    "In the beginning there was a batch of requests waiting to be scheduled.",
]

# Per-architecture defaults: tiny, but each exercises its family's distinguishing features.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        # GQA (4 q heads per kv head) + llama3 rope scaling at a non-default theta; with head_dim 16
        # the frequencies fall in all three llama3 bands (kept, interpolated, divided by factor).
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": False,
    },
    "qwen2": {
        # q/k/v bias, tied embeddings, theta 1e6 (Qwen's).
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        # QK-norm, explicit head_dim (32 != 64 / 4), no biases, tied embeddings.
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        # Gemma 3: a sliding layer (window 8, shorter than most prompts, local RoPE base) then a global
        # one (its own base), QK-norm, GeGLU, (1 + w) norms, a query_pre_attn_scalar != head_dim.
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "tie_word_embeddings": True,
    },
    "mistral": {
        # head_dim (32) != hidden_size / num_heads (16), GQA ratio 4; no sliding window (refused otherwise).
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "sliding_window": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "mixtral": {
        # Every layer sparse: 4 experts (of intermediate_size), top-2, renormalised fp32 routing weights.
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 96,
        "sliding_window": None,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        # Layer 0 dense (decoder_sparse_step 2: only every second layer is sparse), layer 1 sparse with
        # 8 experts of moe_intermediate_size 64, top-3, norm_topk_prob; QK-norm as Qwen3.
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 64,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
}


def _config_class(arch: str):
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    return {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "mistral": MistralConfig,
        "qwen3": Qwen3Config,
        "gemma3": Gemma3TextConfig,
        "mixtral": MixtralConfig,
        "qwen3_moe": Qwen3MoeConfig,
    }[arch]


def make_tiny_tokenizer(path: str | Path, vocab_size: int = 384):
    """Train a byte-level BPE on a tiny corpus in-process and save it (with a chat template) to ``path``.

    Special tokens: <unk>=0, <s>=1 (bos), </s>=2 (eos), <|system|>, <|user|>, <|assistant|>.
    Returns the ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer vocab {tok.get_vocab_size()} exceeds vocab_size {vocab_size}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def make_tiny_config(arch: str = "llama", **overrides: Any):
    """The transformers config object a tiny model of ``arch`` is built from (overrides win)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    kwargs: dict[str, Any] = {
        "vocab_size": 384,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": None,
    }
    kwargs.update(_DEFAULTS[arch])
    kwargs.update(overrides)
    return _config_class(arch)(**kwargs)


def make_tiny_model(
    tmp_path: str | Path,
    arch: str = "llama",
    with_tokenizer: bool = True,
    *,
    seed: int = 0,
    init_std: float = 0.1,
    save_dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random ``arch`` checkpoint to ``tmp_path / f"{arch}-tiny"`` and return that path.

    ``overrides`` are transformers config fields (e.g. ``num_hidden_layers=3``). Weights are
    N(0, init_std) (embeddings N(0, 1), norm weights 1 + N(0, 0.1), biases N(0, init_std)) so that
    attention is far from uniform and greedy argmaxes are not near-ties. ``max_shard_size`` (e.g.
    ``"50KB"``) writes a sharded checkpoint with ``model.safetensors.index.json``.
    """
    from transformers import AutoModelForCausalLM

    config = make_tiny_config(arch, **overrides)
    out = Path(tmp_path) / f"{arch}-tiny"
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=gen))
    model = model.to(save_dtype)
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **save_kwargs)
    if with_tokenizer:
        make_tiny_tokenizer(out, vocab_size=config.vocab_size)
    return out


def load_hf_reference(
    path: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"
):
    """The transformers model of a checkpoint, for comparisons (eval mode)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation=attn_implementation
    )
    return model.eval()


# ---- paged KV helpers -----------------------------------------------------------------------------


def make_attention_metadata(
    seqs: Sequence[tuple[Sequence[int], int, int]],
    tokens_per_block: int,
    num_contexts: int | None = None,
    logits: str = "last",
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """One step's metadata. ``seqs[i] = (block_ids, num_cached, num_new)``, contexts first.

    ``block_ids`` must cover ``num_cached + num_new`` tokens. ``num_contexts`` defaults to the
    leading sequences with ``num_new > 1`` or ``num_cached == 0``. ``logits``: "last" (one row per
    sequence, as the executor does) or "all" (every token).
    """
    if num_contexts is None:
        num_contexts = 0
        for _, cached, new in seqs:
            if new > 1 or cached == 0:
                num_contexts += 1
            else:
                break
    seq_lens = [new for _, _, new in seqs]
    kv_lens = [cached + new for _, cached, new in seqs]
    positions: list[int] = []
    slots: list[int] = []
    for (blocks, cached, _new), kv_len in zip(seqs, kv_lens):
        if len(blocks) * tokens_per_block < kv_len:
            raise ValueError(f"{len(blocks)} blocks cannot hold {kv_len} tokens")
        for p in range(cached, kv_len):
            positions.append(p)
            slots.append(blocks[p // tokens_per_block] * tokens_per_block + p % tokens_per_block)
    max_blocks = max((len(b) for b, _, _ in seqs), default=0)
    tables = torch.zeros(len(seqs), max(max_blocks, 1), dtype=torch.int32)
    for i, (blocks, _, _) in enumerate(seqs):
        tables[i, : len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
    cu = [0]
    for s in seq_lens:
        cu.append(cu[-1] + s)
    if logits == "last":
        logits_indices = [c - 1 for c in cu[1:]]
    elif logits == "all":
        logits_indices = list(range(cu[-1]))
    else:
        raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
    i32 = {"dtype": torch.int32, "device": device}
    i64 = {"dtype": torch.int64, "device": device}
    return AttentionMetadata(
        num_contexts=num_contexts,
        num_tokens=cu[-1],
        tokens_per_block=tokens_per_block,
        seq_lens=torch.tensor(seq_lens, **i32),
        cu_seqlens=torch.tensor(cu, **i32),
        kv_lens=torch.tensor(kv_lens, **i32),
        positions=torch.tensor(positions, **i64),
        slot_mapping=torch.tensor(slots, **i64),
        block_tables=tables.to(device),
        logits_indices=torch.tensor(logits_indices, **i64),
        seq_lens_host=tuple(seq_lens),
        kv_lens_host=tuple(kv_lens),
    )


class PagedKV:
    """Test-only block allocator + per-layer KV tensors for driving a model step by step
    (``dtype=torch.int8``: :class:`~inflight.layers.attention.Int8KvCache` per layer;
    ``dtype=torch.float8_e4m3fn``: :class:`~inflight.layers.attention.Fp8KvCache`).

    Blocks are handed out from a shuffled free list, so a sequence's blocks are non-contiguous and
    out of order. The cache starts filled with random garbage (finite: masked-out NaNs would still
    poison ``softmax @ V``), so reading a slot that was never written shows up as a mismatch.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int = 64,
        tokens_per_block: int = 4,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        shape = (2, num_blocks, tokens_per_block, num_kv_heads, head_dim)
        if dtype == torch.int8:  # an INT8 cache: garbage codes with finite, positive scales
            from inflight.layers.attention import Int8KvCache

            self.kv_caches = [
                Int8KvCache(
                    torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8),
                    0.02 * torch.rand(shape[:4], generator=gen) + 1e-3,
                )
                for _ in range(num_layers)
            ]
        elif dtype == torch.float8_e4m3fn:  # an FP8 cache: E4M3 bytes of garbage (finite), unit scales
            from inflight.layers.attention import Fp8KvCache
            from inflight.ops.reference.attention import quantize_kv_fp8

            self.kv_caches = [
                Fp8KvCache(quantize_kv_fp8(torch.randn(shape, generator=gen))) for _ in range(num_layers)
            ]
        else:
            self.kv_caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(num_layers)]
        self.tokens_per_block = tokens_per_block
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_ids: dict[Any, list[int]] = {}
        self.num_cached: dict[Any, int] = {}

    @classmethod
    def for_model(cls, model, **kwargs: Any) -> PagedKV:
        c = model.config
        kwargs.setdefault("dtype", model.dtype)
        return cls(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, **kwargs)

    def step(
        self,
        batch: Sequence[tuple[Any, Sequence[int]]],
        num_contexts: int | None = None,
        logits: str = "last",
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``batch = [(seq_id, new_token_ids), ...]`` (contexts first) -> (input_ids, positions, metadata).

        Allocates blocks as needed and advances each sequence's cached length.
        """
        seqs = []
        ids: list[int] = []
        for seq_id, tokens in batch:
            cached = self.num_cached.get(seq_id, 0)
            blocks = self.block_ids.setdefault(seq_id, [])
            need = -(-(cached + len(tokens)) // self.tokens_per_block)
            while len(blocks) < need:
                blocks.append(self.free.pop())
            seqs.append((list(blocks), cached, len(tokens)))
            ids.extend(tokens)
        md = make_attention_metadata(seqs, self.tokens_per_block, num_contexts=num_contexts, logits=logits)
        for seq_id, tokens in batch:
            self.num_cached[seq_id] = self.num_cached.get(seq_id, 0) + len(tokens)
        return torch.tensor(ids, dtype=torch.int64), md.positions, md


def write_dequantized_copy(src: Path, dst: Path, group_size: int) -> Path:
    """A float checkpoint holding exactly the dequantised weights of a W4A16 (``inflight quantize``)
    checkpoint ``src``: the reference model of its kernels."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from inflight.ops.reference.gemm import dequantize_w4

    shutil.copytree(src, dst)
    tensors = load_file(str(Path(src) / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[: -len("qweight")]
            offsets = tensors.get(prefix + "offsets")
            out[prefix + "weight"] = dequantize_w4(t, tensors[prefix + "scales"], offsets, group_size)
        elif not name.endswith((".scales", ".offsets")):
            out[name] = t
    save_file(out, str(Path(dst) / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(dst) / "config.json").read_text())
    del cfg["quantization_config"]
    (Path(dst) / "config.json").write_text(json.dumps(cfg))
    return Path(dst)
