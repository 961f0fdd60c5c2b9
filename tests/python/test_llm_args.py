"""LlmArgs: every engine argument declared once, validated once, offered on the command line."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from inflight.batch_manager import CapacitySchedulerPolicy, ContextChunkingPolicy
from inflight.llm_args import Int, KvCacheConfig, LlmArgs, SchedulerConfig, add_cli_arguments, arg


def _parser(args_cls=LlmArgs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_cli_arguments(p, args_cls=args_cls)
    return p


def test_defaults_and_normalisation():
    a = LlmArgs.from_kwargs(
        "m",
        dtype=torch.bfloat16,
        device="cuda:1",
        scheduler_config=SchedulerConfig("max_utilization", "equal_progress"),
        kv_cache_config=KvCacheConfig(dtype="fp16"),
    )
    assert a.dtype == "bfloat16" and a.torch_dtype == torch.bfloat16
    assert a.device == "cuda:1"
    assert a.scheduler_config.capacity_scheduler_policy == CapacitySchedulerPolicy.MAX_UTILIZATION
    assert a.scheduler_config.context_chunking_policy == ContextChunkingPolicy.EQUAL_PROGRESS
    assert a.kv_cache_config.dtype == "float16"
    assert LlmArgs.from_kwargs("m").kv_cache_config == KvCacheConfig()
    assert LlmArgs.from_kwargs("m").torch_dtype is None  # auto
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.max_batch_size = 3


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"max_batch_size": 0}, r"max_batch_size must be an integer >= 1, got 0"),
        ({"max_batch_size": True}, r"max_batch_size must be an integer >= 1, got True"),
        ({"max_num_tokens": 2.5}, r"max_num_tokens must be an integer >= 1, got 2.5"),
        ({"max_seq_len": 1}, r"max_seq_len must be None or an integer >= 2, got 1"),
        ({"seed": -1}, r"seed must be an integer in \[0, 9223372036854775807\], got -1"),
        ({"dtype": "int8"}, r"dtype must be 'auto', 'float32', 'bfloat16' or 'float16'.*got 'int8'"),
        (
            {"quantization": "awq"},
            r"quantization must be None or one of \['auto', 'gguf', 'none'\], got 'awq'",
        ),
        ({"attention_backend": "flash"}, r"attention_backend must be None or one of \['native', 'torch'\]"),
        ({"enable_chunked_prefill": 1}, r"enable_chunked_prefill must be a bool, got 1"),
        (
            {"disable_overlap_scheduler": "yes"},
            r"disable_overlap_scheduler must be None or a bool, got 'yes'",
        ),
        ({"device": "gpu9"}, r"device must be None or a device such as 'cpu'.*got 'gpu9'"),
        ({"kv_cache_config": {"max_tokens": 5}}, r"kv_cache_config must be a KvCacheConfig, got dict"),
        ({"scheduler": 42}, r"scheduler must be a RequestScheduler or a factory of one, got int"),
        ({"max_num_seqs": 8}, r"unknown LLM argument\(s\): max_num_seqs \(accepted: dtype, "),
    ],
)
def test_bad_values_name_the_argument_value_and_range(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        LlmArgs.from_kwargs("m", **kwargs)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"max_tokens": 0}, r"max_tokens must be None or an integer >= 1, got 0"),
        ({"free_memory_fraction": 0.0}, r"free_memory_fraction must be a number in \(0, 1\], got 0.0"),
        (
            {"free_memory_fraction": float("nan")},
            r"free_memory_fraction must be a number in \(0, 1\], got nan",
        ),
        ({"tokens_per_block": 12}, r"tokens_per_block must be a power of two >= 1, got 12"),
        ({"enable_block_reuse": "no"}, r"KvCacheConfig.enable_block_reuse must be a bool, got 'no'"),
        ({"dtype": "int4"}, r"KvCacheConfig.dtype must be 'auto'"),
    ],
)
def test_kv_cache_config_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        KvCacheConfig(**kwargs)


def test_scheduler_config_validation():
    with pytest.raises(
        ValueError,
        match="capacity_scheduler_policy must be one of MAX_UTILIZATION, GUARANTEED_NO_EVICT, STATIC_BATCH, got .FASTEST.",
    ):
        SchedulerConfig(capacity_scheduler_policy="FASTEST")


def test_chunked_prefill_needs_a_token_budget_of_a_block():
    """A context chunk is a whole number of KV blocks: with max_num_tokens below the block size no
    chunk of a longer prompt could ever be scheduled (the engine would wait forever), so the
    configuration is refused up front; a budget of exactly one block is fine."""
    with pytest.raises(
        ValueError, match=r"max_num_tokens must be >= KvCacheConfig.tokens_per_block \(32\).*got 16"
    ):
        LlmArgs(model="m", max_num_tokens=16, enable_chunked_prefill=True)
    LlmArgs(model="m", max_num_tokens=32, enable_chunked_prefill=True)
    LlmArgs(
        model="m",
        max_num_tokens=16,
        enable_chunked_prefill=True,
        kv_cache_config=KvCacheConfig(tokens_per_block=16),
    )
    LlmArgs(model="m", max_num_tokens=16)  # without chunking a longer prompt is refused per request


def test_every_field_is_a_keyword_and_an_option():
    """The command line offers every field that is not a Python object, under its flag, and reads
    back the defaults unchanged."""
    p = _parser()
    assert LlmArgs.from_cli(p.parse_args([]), model="m") == LlmArgs(model="m")
    options = {s for a in p._actions for s in a.option_strings}
    nested = {
        "--kv-cache-max-tokens",
        "--kv-cache-free-memory-fraction",
        "--tokens-per-block",
        "--disable-block-reuse",
        "--kv-cache-dtype",
        "--capacity-scheduler-policy",
        "--context-chunking-policy",
        "--speculative-method",
        "--max-draft-len",
        "--prompt-lookup-min",
        "--prompt-lookup-max",
        "--draft-model",
    }
    assert nested <= options
    for f in dataclasses.fields(LlmArgs):
        if f.metadata["cli"] and f.name not in ("kv_cache_config", "scheduler_config", "speculative_config"):
            assert "--" + f.name.replace("_", "-") in options, f.name
    assert "--scheduler" not in options and "--model" not in options  # Python objects; the command's own


def test_options_round_trip():
    ns = _parser().parse_args(
        [
            "--dtype",
            "bf16",
            "--max-batch-size",
            "7",
            "--enable-chunked-prefill",
            "--disable-block-reuse",
            "--kv-cache-dtype",
            "float32",
            "--context-chunking-policy",
            "EQUAL_PROGRESS",
            "--quantization",
            "gguf",
            "--log-iteration-stats",
            "5",
        ]
    )
    a = LlmArgs.from_cli(ns, model="m")
    assert (a.dtype, a.max_batch_size, a.enable_chunked_prefill, a.quantization, a.log_iteration_stats) == (
        "bfloat16",
        7,
        True,
        "gguf",
        5,
    )
    assert a.kv_cache_config == KvCacheConfig(enable_block_reuse=False, dtype="float32")
    assert a.scheduler_config.context_chunking_policy == ContextChunkingPolicy.EQUAL_PROGRESS
    assert a.disable_overlap_scheduler is None  # an absent flag keeps "decide per device"
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1, got 0"):
        LlmArgs.from_cli(_parser().parse_args(["--max-batch-size", "0"]), model="m")


def test_a_new_argument_is_one_line():
    """A field declared with arg() is validated, accepted as a keyword and offered as an option,
    with nothing else to change."""

    @dataclasses.dataclass(frozen=True)
    class MoreArgs(LlmArgs):
        num_draft_tokens: int = arg(0, "draft tokens per step", Int(0, 16))

    assert MoreArgs.from_kwargs("m", num_draft_tokens=4).num_draft_tokens == 4
    with pytest.raises(ValueError, match=r"num_draft_tokens must be an integer in \[0, 16\], got 17"):
        MoreArgs.from_kwargs("m", num_draft_tokens=17)
    p = _parser(MoreArgs)
    assert MoreArgs.from_cli(p.parse_args(["--num-draft-tokens", "3"]), model="m").num_draft_tokens == 3
    assert "draft tokens per step" in p.format_help()
