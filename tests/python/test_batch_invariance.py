"""Batch invariance (the CPU kernels' default): a request's tokens and logprobs are bit-identical
whether it runs alone or beside 15 others, with chunked prefill on or off (several chunk sizes), with
prefix reuse on or off, for fp32, bf16 and 4-bit models (with fp32, bf16 or int8 activations) and on
every ISA path the machine has. And
the kernels under it: an attention row is the same in a decode, in a prefill and in any chunk, alone
or in a batch (the GEMM rows are in test_ops_gemm.py)."""

from __future__ import annotations

import pytest
import torch
from llm_utils import LLM_TPB

from inflight import _C
from inflight.ops import attention as ops

# ---- attention kernels -------------------------------------------------------------------------------

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, TPB = 6, 2, 64, 8
SEQ_LEN = 150  # several key tiles of every ISA, not a multiple of any


@pytest.fixture
def invariant():
    before = _C.batch_invariant()
    _C.set_batch_invariant(True)
    yield
    _C.set_batch_invariant(before)


def _cache(cache_dtype: torch.dtype, num_blocks: int, gen: torch.Generator):
    shape = (2, num_blocks, TPB, NUM_KV_HEADS, HEAD_DIM)
    if cache_dtype == torch.int8:
        cache = torch.zeros(shape, dtype=torch.int8)
        scales = torch.zeros(2, num_blocks, TPB, NUM_KV_HEADS, dtype=torch.float32)
        return cache, scales
    if cache_dtype == torch.float8_e4m3fn:  # an FP8 cache: E4M3 bytes, unit per-tensor scales
        return torch.zeros(shape, dtype=torch.uint8), None
    return torch.zeros(shape, dtype=cache_dtype), None


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.int8),
        (torch.bfloat16, torch.float8_e4m3fn),
    ],
)
def test_attention_row_is_independent_of_batch_and_chunking(isa, invariant, dtype, cache_dtype, window):
    gen = torch.Generator().manual_seed(11 + int(window))
    # 16 sequences: ours (index 5) and 15 others of mixed lengths, some long enough that a
    # batch-dependent decode split would cut them.
    lens = [int(v) for v in torch.randint(1, 1200, (16,), generator=gen)]
    lens[5] = SEQ_LEN
    blocks_per = [(n + TPB - 1) // TPB for n in lens]
    num_blocks = sum(blocks_per) + 3
    cache, scales = _cache(cache_dtype, num_blocks, gen)
    perm = torch.randperm(num_blocks, generator=gen)[: sum(blocks_per)].to(torch.int32)
    max_blocks = max(blocks_per)
    tables = torch.zeros(16, max_blocks, dtype=torch.int32)
    at = 0
    for b, nb in enumerate(blocks_per):
        tables[b, :nb] = perm[at : at + nb]
        at += nb
    for b, n in enumerate(lens):  # every sequence's K/V, stored through the kernel
        pos = torch.arange(n)
        slots = (tables[b, pos // TPB].long() * TPB + pos % TPB).contiguous()
        k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        ops.store_kv(k, v, cache, slots, scales)
    scale = HEAD_DIM**-0.5
    q = torch.randn(SEQ_LEN, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    table = tables[5:6].contiguous()

    def decode(p: int) -> torch.Tensor:  # the query at position p alone, as a decode
        return ops.paged_attention(
            q[p : p + 1].contiguous(),
            cache,
            table,
            torch.tensor([p + 1], dtype=torch.int32),
            scale,
            window=window,
            kv_scales=scales,
        )[0]

    def chunk(a: int, b: int) -> torch.Tensor:  # positions a .. b-1 as one prefill chunk
        return ops.context_attention(
            q[a:b].contiguous(),
            cache,
            table,
            torch.tensor([0, b - a], dtype=torch.int32),
            torch.tensor([b], dtype=torch.int32),
            scale,
            window=window,
            kv_scales=scales,
        )

    want = torch.stack([decode(p) for p in range(SEQ_LEN)])
    assert torch.equal(chunk(0, SEQ_LEN), want), "a whole prefill differs from the decodes"
    for size in (1, 7, 64, 100):
        got = torch.cat([chunk(a, min(SEQ_LEN, a + size)) for a in range(0, SEQ_LEN, size)])
        bad = [p for p in range(SEQ_LEN) if not torch.equal(got[p], want[p])]
        assert not bad, f"chunks of {size}: positions {bad[:8]} differ from the decodes"
    # Chunk boundaries off the key tiles, and a chunk beside other sequences' chunks.
    got = torch.cat([chunk(0, 33), chunk(33, 97), chunk(97, SEQ_LEN)])
    assert torch.equal(got, want)
    others = [0, 9]
    qs = [torch.randn(3, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in others]
    batch_q = torch.cat([qs[0], q[97:SEQ_LEN], qs[1]]).contiguous()
    cu = torch.tensor([0, 3, 3 + SEQ_LEN - 97, 6 + SEQ_LEN - 97], dtype=torch.int32)
    kv = torch.tensor([lens[0], SEQ_LEN, lens[9]], dtype=torch.int32)
    out = ops.context_attention(
        batch_q, cache, tables[[0, 5, 9]].contiguous(), cu, kv, scale, window=window, kv_scales=scales
    )
    assert torch.equal(out[3 : 3 + SEQ_LEN - 97], want[97:])
    # The last position's decode beside 15 other decodes.
    batch_q = torch.randn(16, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    batch_q[5] = q[SEQ_LEN - 1]
    out = ops.paged_attention(
        batch_q, cache, tables, torch.tensor(lens, dtype=torch.int32), scale, window=window, kv_scales=scales
    )
    assert torch.equal(out[5], want[SEQ_LEN - 1])
    for b in (0, 9):  # and the others' rows equal their own decodes alone
        alone = ops.paged_attention(
            batch_q[b : b + 1].contiguous(),
            cache,
            tables[b : b + 1].contiguous(),
            torch.tensor([lens[b]], dtype=torch.int32),
            scale,
            window=window,
            kv_scales=scales,
        )
        assert torch.equal(out[b], alone[0])


# ---- the engine: request A alone, beside 15 others, chunked, with prefix reuse ------------------------

MAX_NEW = 6


def _prompts() -> tuple[list[int], list[int], list[list[int]]]:
    """Request A (45 tokens), B sharing A's first 32 tokens (4 blocks of 8), and 15 others of mixed
    lengths (1 .. 70 tokens)."""
    gen = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 384, (n,), generator=gen).tolist()

    a = rand(45)
    b = a[:32] + rand(9)
    lens = [1, 70, 3, 17, 45, 8, 33, 2, 61, 16, 5, 40, 24, 9, 52]
    return a, b, [rand(n) for n in lens]


def _run(llm, prompts: list[list[int]], prompt_logprobs: bool = True) -> list[tuple]:
    from inflight.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_NEW,
        ignore_eos=True,
        logprobs=3,
        prompt_logprobs=2 if prompt_logprobs else None,
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs if prompt_logprobs else None)
        for o in outs
    ]


def _plain(logprobs) -> list | None:
    """Logprobs as plain comparable values (dicts of token -> float, or Logprob objects)."""
    if logprobs is None:
        return None
    out = []
    for pos in logprobs:
        if pos is None:
            out.append(None)
            continue
        out.append({t: getattr(v, "logprob", v) for t, v in pos.items()})
    return out


def _same(got: tuple, want: tuple, what: str) -> None:
    assert got[0] == want[0], f"{what}: tokens {got[0]} != {want[0]}"
    assert _plain(got[1]) == _plain(want[1]), f"{what}: logprobs differ"
    if got[2] is not None and want[2] is not None:
        assert _plain(got[2]) == _plain(want[2]), f"{what}: prompt logprobs differ"


@pytest.fixture(scope="module")
def w4_model_dir(tmp_path_factory):
    """A tiny Llama quantised to 4 bits (``inflight quantize``: W4A16, asymmetric groups of 64)."""
    from model_utils import make_tiny_model

    from inflight.cli import main

    base = tmp_path_factory.mktemp("bi-w4")
    src = make_tiny_model(base, "llama", hidden_size=128, intermediate_size=256)
    out = base / "q"
    assert main(["quantize", "--model", str(src), "--out", str(out), "--group-size", "64"]) == 0
    return out


# "w4-fp32" / "w4-bf16": the 4-bit model with float activations (activation_quantization="none");
# "w4-a8" / "w4-a16": with int8 / 16-bit activations (the A8 GEMM; int16 is the default's choice on a
# CPU with AVX512-VNNI).
MODELS = [
    ("fp32", "float32"),
    ("bf16", "bfloat16"),
    ("w4-fp32", "float32"),
    ("w4-bf16", "bfloat16"),
    ("w4-a8-fp32", "float32"),
    ("w4-a8-bf16", "bfloat16"),
    ("w4-a16-fp32", "float32"),
    ("w4-a16-bf16", "bfloat16"),
]


@pytest.mark.parametrize("model,dtype", MODELS, ids=[m for m, _ in MODELS])
def test_request_is_bit_identical_alone_batched_chunked_and_reused(
    isa, invariant, make_llm, tiny_model_dir, w4_model_dir, model, dtype
):
    from inflight.llm_args import KvCacheConfig

    path = w4_model_dir if model.startswith("w4") else tiny_model_dir("llama")
    act = "int8" if "-a8-" in model else "int16" if "-a16-" in model else "none"
    a, b, others = _prompts()
    batch = [*others[:5], a, *others[5:]]  # A in the middle of 16

    def kv(reuse: bool) -> KvCacheConfig:
        return KvCacheConfig(max_tokens=4096, tokens_per_block=LLM_TPB, enable_block_reuse=reuse)

    base = make_llm(model=path, dtype=dtype, kv_cache_config=kv(False), activation_quantization=act)
    want = _run(base, [a])[0]
    _same(_run(base, batch)[5], want, "A beside 15 others")
    base.shutdown()

    for budget in (16, 40):  # chunked prefill: chunks of A and of the others at several sizes
        llm = make_llm(
            model=path,
            dtype=dtype,
            kv_cache_config=kv(False),
            enable_chunked_prefill=True,
            max_num_tokens=budget,
            activation_quantization=act,
        )
        _same(_run(llm, [a])[0], want, f"A alone, chunked prefill of {budget} tokens")
        _same(_run(llm, batch)[5], want, f"A beside 15 others, chunked prefill of {budget} tokens")
        llm.shutdown()

    llm = make_llm(model=path, dtype=dtype, kv_cache_config=kv(True), activation_quantization=act)
    _run(llm, [b], prompt_logprobs=False)  # publishes A's first 4 blocks

    def reused() -> int:
        return llm.get_stats()[-1]["kv_cache_stats"]["reused_blocks"]

    before = reused()
    _same(_run(llm, [a], prompt_logprobs=False)[0], want, "A over B's reused prefix")
    assert reused() > before, "A did not reuse B's blocks: the test would not test reuse"
    _same(_run(llm, batch, prompt_logprobs=False)[5], want, "A reused, beside 15 others")
    llm.shutdown()
