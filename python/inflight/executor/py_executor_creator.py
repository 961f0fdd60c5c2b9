"""The executor factory: :class:`~inflight.llm_args.LlmArgs` in, a running :class:`PyExecutor` out.

TensorRT-LLM's assembly line, in its order: load the model (weights, config, tokenizer), size the KV
pool (on a GPU after a warm-up forward that measures the activation peak), build the resource
managers (sequence slots, then the KV cache: prepared in that order, freed in reverse), the
scheduler (the C++ capacity and micro-batch schedulers unless the caller brings one), the sampler
and the model engine, then start the executor loop. Values decided here (the device, the dtype, the
pool, a reduced ``max_seq_len``) come back in :class:`Engine`; nothing is written into the args.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inflight.batch_manager import ContextChunkingConfig, LlmRequest
from inflight.executor.draft_cost import DRAFT_COSTS
from inflight.executor.guided_decoder import GuidedDecoder, make_backend
from inflight.executor.kv_cache_creator import (
    KvBudget,
    cpu_kv_budget,
    gpu_kv_budget,
    kv_bytes_per_token,
    plan_window_pools,
    secondary_kv_blocks,
)
from inflight.executor.kv_secondary_pool import SecondaryKvPool
from inflight.executor.llm_request import Response
from inflight.executor.model_engine import ModelEngine
from inflight.executor.parallel_model import ParallelModel
from inflight.executor.parallel_runtime import (
    Cluster,
    ShardSpec,
    follower_rank_from_env,
    run_follower,
    stage_of,
)
from inflight.executor.preemption import Preemption
from inflight.executor.py_executor import PyExecutor
from inflight.executor.resource_manager import (
    KVCacheResourceManager,
    ResourceManager,
    SeqSlotManager,
    WindowKvGroup,
)
from inflight.executor.sampler import Sampler
from inflight.executor.scheduler import (
    BindCapacityScheduler,
    BindMicroBatchScheduler,
    RequestScheduler,
    ScheduledRequests,
    SimpleScheduler,
)
from inflight.executor.speculative import NgramDrafter, Speculator
from inflight.executor.step_channel import PipeLink
from inflight.layers.attention import key_rotation_mode
from inflight.llm_args import LlmArgs
from inflight.models.config import ModelConfig
from inflight.models.gguf_loader import resolve_known_model
from inflight.models.loader import load_config
from inflight.ops import set_batch_invariant
from inflight.parallel.comm import SINGLE
from inflight.parallel.mapping import Mapping
from inflight.parallel.sharding import PipelineStage, check_tensor_parallel
from inflight.utils.dtypes import kv_cache_dtype_name, parse_kv_cache_dtype

logger = logging.getLogger("inflight")

__all__ = ["Engine", "create_py_executor"]


@dataclass
class Engine:
    """What the factory built and decided."""

    executor: PyExecutor
    model_config: ModelConfig
    tokenizer: Any  # a transformers tokenizer, or None (token-id prompts only)
    device: torch.device
    dtype: torch.dtype  # the activation dtype
    max_seq_len: int  # the model's (or the args'), reduced to what the KV pool holds
    kv_budget: KvBudget
    parallel: str = "tp=1 pp=1"  # the mapping


def shard_spec(args: LlmArgs, device: torch.device) -> ShardSpec:
    """What every rank needs from ``args`` to load its shard (rank 0 of a single process too)."""
    return ShardSpec(
        model=args.model,
        dtype=args.torch_dtype,
        device=str(device),
        attention_backend=args.attention_backend,
        max_seq_len=args.max_seq_len,
        quantization=args.quantization,
        tp_size=args.tensor_parallel_size,
        pp_size=args.pipeline_parallel_size,
        timeout=args.parallel_timeout,
        activation_quantization=args.activation_quantization,
    )


def _device(args: LlmArgs) -> torch.device:
    if args.device is not None:
        return torch.device(args.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def follower_rank(args: LlmArgs) -> int:
    """This process's rank in a parallel engine: 0 unless a launcher (torchrun) started it as another."""
    if args.tensor_parallel_size * args.pipeline_parallel_size == 1:
        return 0
    rank = follower_rank_from_env()
    return 0 if rank is None else rank


def _parallel_spec(args: LlmArgs, device: torch.device) -> ShardSpec:
    """The spec sent to other processes: it must pickle, so the attention backend goes by name."""
    if args.attention_backend is not None and not isinstance(args.attention_backend, str):
        raise ValueError("a parallel engine needs attention_backend by name ('native' or 'torch')")
    return shard_spec(args, device)


def run_follower_rank(args: LlmArgs, rank: int) -> int:
    """A torchrun follower: serves its shard until rank 0 shuts down; the exit status (0: clean)."""
    return run_follower(_parallel_spec(args, _device(args)), rank)


def create_py_executor(args: LlmArgs, response_callback: Callable[[Response], None] | None = None) -> Engine:
    """Loads ``args.model`` and starts an executor over it; responses go to ``response_callback``."""
    set_batch_invariant(args.batch_invariant)  # process-wide, read by every CPU kernel launch
    device = _device(args)
    overlap = (
        not args.disable_overlap_scheduler
        if args.disable_overlap_scheduler is not None
        else device.type != "cpu"
    )
    if args.pipeline_parallel_size > 1 and overlap:
        logger.info(
            "overlap scheduler off: with pipeline stages the micro-batches in flight overlap the host work"
        )
        overlap = False

    t0 = time.perf_counter()
    cluster = stage = None
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        c = load_config(args.model)  # sizes that do not split fail here, before any rank starts
        check_tensor_parallel(
            c.num_attention_heads,
            c.num_key_value_heads,
            c.intermediate_size,
            args.tensor_parallel_size,
            moe_intermediate_size=c.moe_intermediate_size,
        )
        Mapping(args.pipeline_parallel_size, 0, 1, args.pipeline_parallel_size).layer_range(
            c.num_hidden_layers
        )
        cluster = Cluster.start(_parallel_spec(args, device))
        stage = stage_of(cluster.mapping, c.num_hidden_layers)
    try:
        return _create(args, device, overlap, cluster, stage, t0, response_callback)
    except BaseException:
        if cluster is not None:
            cluster.shutdown()
        raise


def _create(
    args: LlmArgs,
    device: torch.device,
    overlap: bool,
    cluster: Cluster | None,
    stage: PipelineStage | None,
    t0: float,
    response_callback: Callable[[Response], None] | None,
) -> Engine:
    spec = cluster.spec if cluster is not None else shard_spec(args, device)
    loaded = spec.load(device, cluster.tp if cluster is not None else SINGLE, stage)
    model = loaded.model
    if cluster is not None:
        if cluster.mapping.pp_size > 1:
            cluster.link = PipeLink(
                cluster.groups.pp, cluster.mapping, loaded.config.hidden_size, loaded.dtype, device
            )
        cluster.wait_loaded()
        model = ParallelModel(loaded.model, cluster)
    cfg = loaded.config
    model_max = cfg.max_position_embeddings
    if args.max_seq_len is not None and args.max_seq_len > model_max:
        raise ValueError(
            f"max_seq_len must be <= the model's max_position_embeddings={model_max}, got {args.max_seq_len}"
        )
    max_seq_len = args.max_seq_len if args.max_seq_len is not None else model_max
    logger.info(
        "loaded %s (%s, %s, %d layers) in %.1f s",
        args.model,
        cfg.architecture,
        loaded.dtype,
        cfg.num_hidden_layers,
        time.perf_counter() - t0,
    )

    kv_config = args.kv_cache_config
    kv_dtype = parse_kv_cache_dtype(kv_config.dtype, "KvCacheConfig.dtype") or loaded.dtype
    # This rank's heads: under tensor parallelism each rank's pool holds only its KV heads.
    kv_heads = loaded.model.num_kv_heads
    num_layers = loaded.model.num_layers  # this rank's (its pipeline stage's)
    bpt = kv_bytes_per_token(num_layers, kv_heads, cfg.head_dim, kv_dtype)
    parallel = cluster.describe() if cluster is not None else "tp=1 pp=1"
    if device.type == "cuda":
        budget = _gpu_budget_after_warmup(model, cfg, args, bpt, max_seq_len, kv_dtype, device, kv_heads)
    else:
        # The ranks of one machine share its memory.
        ranks_here = len(cluster.procs) + 1 if cluster is not None else 1
        budget = cpu_kv_budget(kv_config, bpt, max_seq_len, share=ranks_here)
    budget = dataclasses.replace(budget, dtype=kv_cache_dtype_name(kv_dtype))
    if cluster is not None:
        budget = dataclasses.replace(budget, parallel=parallel)
    num_secondary = secondary_kv_blocks(kv_config, bpt)
    if num_secondary:
        where = SecondaryKvPool.where(kv_config.host_cache_path, device)
        budget = dataclasses.replace(budget, num_secondary_blocks=num_secondary, secondary=where)
    logger.info("%s", budget.describe())
    if budget.num_tokens < max_seq_len:
        logger.warning(
            "max_seq_len reduced from %d to %d: the KV cache holds only %d tokens",
            max_seq_len,
            budget.num_tokens,
            budget.num_tokens,
        )
        max_seq_len = budget.num_tokens

    identity = None
    if num_secondary and kv_config.host_cache_path is not None and kv_config.enable_block_reuse:
        identity = model_identity(
            args.model, loaded.dtype, args.quantization, parallel, loaded.activation_quantization
        )
    windows = _plan_window_pools(args, cfg, cluster, budget, max_seq_len)
    kv_manager = KVCacheResourceManager.allocate(
        len(windows.global_layers) if windows is not None else num_layers,
        kv_heads,
        cfg.head_dim,
        windows.num_global_blocks if windows is not None else budget.num_blocks,
        kv_config.tokens_per_block,
        max_seq_len,
        kv_dtype,
        device,
        kv_config.enable_block_reuse,
        num_secondary,
        kv_config.host_cache_path,
        identity,
        # INT8: the codes are of rotated keys (or not), so a tier written under the other rule is refused.
        kv_encoding={"int8_key_rotation": key_rotation_mode()} if kv_dtype == torch.int8 else None,
    )
    if windows is not None:
        logger.info("%s", windows.describe(kv_config.tokens_per_block))
        kv_manager.window_plan = windows
        for w, n in windows.window_blocks.items():
            group_kv = KVCacheResourceManager.allocate(
                len(windows.window_layers[w]),
                kv_heads,
                cfg.head_dim,
                n,
                kv_config.tokens_per_block,
                max_seq_len,
                kv_dtype,
                device,
                kv_config.enable_block_reuse,
                attention_window=w,
            )
            kv_manager.add_window_group(WindowKvGroup(w, windows.window_layers[w], group_kv), num_layers)
    if isinstance(model, ParallelModel):  # the same pool on every rank
        model.allocate_kv(budget.num_blocks, kv_config.tokens_per_block, kv_dtype)
        kv_manager.on_block_copies = model.queue_block_copies  # beam search's copies, on every rank
    # Room for every active request (running or fitting) to hold a slot; with pipeline stages,
    # TensorRT-LLM's rule: the capacity and the slots are max_batch_size x pp (one batch per stage).
    pp = args.pipeline_parallel_size
    max_num_active = args.max_batch_size * 2 * pp
    resources = ResourceManager(
        {"seq_slot_manager": SeqSlotManager(max_num_active), "kv_cache_manager": kv_manager}
    )
    scheduler = _make_scheduler(args, kv_manager, two_steps_lookahead=overlap)
    # Requests without a seed of their own draw from torch's default generator.
    torch.manual_seed(args.seed)
    engine = ModelEngine(model, kv_manager, device, args.max_batch_size, max_num_active)
    speculator = _make_speculator(args, cfg, loaded, device, budget, max_seq_len)
    executor = PyExecutor(
        engine,
        resources,
        scheduler,
        Sampler(cfg.vocab_size),
        max_seq_len=max_seq_len,
        max_num_active_requests=max_num_active,
        disable_overlap_scheduler=not overlap,
        response_callback=response_callback,
        log_stats_every=args.log_iteration_stats,
        stats_extra={"parallel": parallel},
        pipeline_depth=pp,
        speculator=speculator,
        guided_decoder=_make_guided_decoder(args.guided_decoding_backend, loaded.tokenizer, cfg),
        preemption=Preemption(args.scheduler_config.preemption_mode, kv_manager, two_steps_lookahead=overlap),
    )
    if isinstance(model, ParallelModel):
        model.on_failure = executor.fail
    return Engine(executor, cfg, loaded.tokenizer, device, loaded.dtype, max_seq_len, budget, parallel)


# The weights' digest of a persistent KV tier (model_identity): SHA-256 of each chunk, hashed on a
# thread pool, then SHA-256 of the files' names, sizes and chunk digests in order.
_DIGEST_CHUNK = 16 << 20


def checkpoint_files(model: str) -> list[Path]:
    """The files whose bytes decide a model's KV: a GGUF file itself; for a Hugging Face directory its
    config.json and *.safetensors (what the loader reads). Empty when ``model`` names neither."""
    known = resolve_known_model(str(model))
    path = known if known is not None else Path(os.fspath(model)).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        config = path / "config.json"
        return ([config] if config.is_file() else []) + files
    return []


def weights_digest(files: list[Path]) -> str:
    """A digest of every byte of ``files`` (hex SHA-256 over names, sizes and the SHA-256 of each
    16 MiB chunk, the chunks hashed in parallel; ~1.7 GB/s per core: 0.06 s for a 100 MB GGUF)."""

    def chunk_digest(job: tuple[Path, int]) -> bytes:
        path, offset = job
        with (
            open(path, "rb") as f,
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m,
            memoryview(m) as view,
        ):
            return hashlib.sha256(view[offset : offset + _DIGEST_CHUNK]).digest()

    sizes = [f.stat().st_size for f in files]
    jobs = [(f, off) for f, n in zip(files, sizes) for off in range(0, n, _DIGEST_CHUNK)]
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        chunks = list(pool.map(chunk_digest, jobs))
    total = hashlib.sha256()
    i = 0
    for f, n in zip(files, sizes):
        total.update(f"{f.name}\0{n}\0".encode())
        for _ in range(0, n, _DIGEST_CHUNK):
            total.update(chunks[i])
            i += 1
    return total.hexdigest()


def model_identity(
    model: str,
    dtype: torch.dtype,
    quantization: str | None,
    parallel: str,
    activation_quantization: str | None = None,
) -> dict[str, Any] | None:
    """What a persistent KV tier records of the model (docs/batch-manager.md §3.10): its file name, a
    digest of its weights' bytes, the activation dtype, the quantization modes (weights, activations:
    int8 activations give other K/V values) and the parallel mapping.
    None (the tier is then not persistent, with a warning) when the checkpoint's files are not found."""
    files = checkpoint_files(model)
    if not files:
        logger.warning(
            "KvCacheConfig.host_cache_path: the checkpoint files of %r were not found, so the KV tier "
            "cannot be tied to the model's weights; it is not kept across restarts",
            model,
        )
        return None
    t0 = time.perf_counter()
    digest = weights_digest(files)
    total = sum(f.stat().st_size for f in files)
    logger.info(
        "KV tier identity: weights digest of %d files (%.1f MiB) in %.2f s",
        len(files),
        total / 2**20,
        time.perf_counter() - t0,
    )
    name = files[0].name if files[0].suffix == ".gguf" else files[0].parent.name
    return {
        "model": name,
        "weights_sha256": digest,
        "weights_bytes": total,
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": quantization,
        "activation_quantization": activation_quantization or "none",
        "parallel": parallel,
    }


def _make_guided_decoder(name: str, tokenizer, cfg: ModelConfig) -> GuidedDecoder | None:
    """Structured output's grammar backend (``guided_decoding_backend``), when it is installed and the
    model has a fast tokenizer; else None (a guided request is then refused by name)."""
    if tokenizer is None or not getattr(tokenizer, "is_fast", False):
        return None
    try:
        backend = make_backend(name, tokenizer, cfg.vocab_size, tuple(cfg.eos_token_ids))
    except ImportError as exc:
        if name != "llguidance":  # asked for by name: say why it is missing
            logger.warning("structured output is off: %s", exc)
        return None
    return GuidedDecoder(backend)


def _make_speculator(args: LlmArgs, cfg: ModelConfig, loaded, device, budget, max_seq_len: int) -> Speculator:
    """The engine's drafter (``speculative_config``; None when off: only requests with a prediction
    draft then) inside a :class:`Speculator`."""
    sc = args.speculative_config
    drafter = None
    if sc.method == "ngram":
        drafter = NgramDrafter(sc.prompt_lookup_min, sc.prompt_lookup_max)
    elif sc.method == "draft_model":
        from inflight.executor.draft_model import DraftModelDrafter

        drafter = DraftModelDrafter.create(
            sc.draft_model,
            target_config=cfg,
            target_tokenizer=loaded.tokenizer,
            device=device,
            dtype=args.torch_dtype,
            num_tokens=budget.num_tokens,
            tokens_per_block=args.kv_cache_config.tokens_per_block,
            max_seq_len=max_seq_len,
            max_batch_size=args.max_batch_size,
            quantization=args.quantization,
        )
    if drafter is not None:
        logger.info(
            "speculative decoding: %s, up to %d draft tokens per step (adapted per request)",
            drafter.name,
            sc.max_draft_len,
        )
    return Speculator(drafter, sc.max_draft_len, DRAFT_COSTS.get(device.type, DRAFT_COSTS["cuda"]))


def _plan_window_pools(args: LlmArgs, cfg: ModelConfig, cluster, budget, max_seq_len: int):
    """The VSWA split of the KV budget (kv_cache_creator.plan_window_pools), or None: not asked for,
    or no gain for this model and max_seq_len (logged)."""
    if not args.kv_cache_config.sliding_window_pools:
        return None
    if cluster is not None:
        raise ValueError(
            "KvCacheConfig.sliding_window_pools=True is not supported with tensor or pipeline parallelism yet"
        )
    if cfg.layer_windows is None:
        logger.info(
            "KvCacheConfig.sliding_window_pools: %s has no sliding-window layers; one pool", args.model
        )
        return None
    sc = args.speculative_config
    drafts = sc.max_draft_len if sc is not None and sc.method is not None else 0
    plan = plan_window_pools(
        cfg.layer_windows, budget.num_blocks, args.kv_cache_config.tokens_per_block, max_seq_len, drafts
    )
    if plan is None:
        logger.info(
            "KvCacheConfig.sliding_window_pools: no gain at max_seq_len=%d (windows %s); one pool",
            max_seq_len,
            sorted(set(cfg.layer_windows)),
        )
    return plan


def _make_scheduler(
    args: LlmArgs, kv_manager: KVCacheResourceManager, two_steps_lookahead: bool
) -> RequestScheduler:
    scheduler = args.scheduler
    if scheduler is None:
        chunking = (
            ContextChunkingConfig(
                args.scheduler_config.context_chunking_policy, args.kv_cache_config.tokens_per_block
            )
            if args.enable_chunked_prefill
            else None
        )
        return SimpleScheduler(
            BindCapacityScheduler(
                args.max_batch_size * args.pipeline_parallel_size,
                kv_manager.impl,
                args.scheduler_config.capacity_scheduler_policy,
                two_steps_lookahead=two_steps_lookahead,
                window_managers=[g.kv.impl for g in kv_manager.window_groups],
            ),
            BindMicroBatchScheduler(args.max_batch_size, args.max_num_tokens, chunking),
        )
    if isinstance(scheduler, RequestScheduler):
        return scheduler
    if not callable(scheduler):
        raise ValueError(f"scheduler must be a RequestScheduler or a factory, got {type(scheduler).__name__}")
    made = scheduler(
        kv_cache_manager=kv_manager.impl,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
    )
    if not isinstance(made, RequestScheduler):
        raise ValueError(f"the scheduler factory must return a RequestScheduler, got {type(made).__name__}")
    return made


def _gpu_budget_after_warmup(
    model: torch.nn.Module,
    cfg: ModelConfig,
    args: LlmArgs,
    bpt: int,
    max_seq_len: int,
    kv_dtype: torch.dtype,
    device: torch.device,
    kv_heads: int,
) -> KvBudget:
    """TensorRT-LLM's two passes: a warm-up forward of ``max_num_tokens`` dummy tokens over a tiny pool
    measures the activation peak, then the pool takes a fraction of what is left."""
    warm_tokens = min(args.max_num_tokens, max_seq_len)
    tpb = args.kv_cache_config.tokens_per_block
    tiny = KVCacheResourceManager.allocate(
        model.num_layers,
        kv_heads,
        cfg.head_dim,
        -(-warm_tokens // tpb),
        tpb,
        warm_tokens,
        kv_dtype,
        device,
        False,
    )
    if isinstance(model, ParallelModel):
        model.allocate_kv(-(-warm_tokens // tpb), tpb, kv_dtype)
    torch.cuda.reset_peak_memory_stats(device)
    req = LlmRequest(0, 1, [0] * warm_tokens)
    req.seq_slot = 0
    batch = ScheduledRequests([req], [])
    tiny.prepare_resources(batch)
    engine = ModelEngine(model, tiny, device, 1, 1)
    engine.forward(engine.prepare(batch))
    tiny.free_resources(req, store_for_reuse=False)
    tiny.shutdown()
    torch.cuda.synchronize(device)
    return gpu_kv_budget(args.kv_cache_config, bpt, max_seq_len, device)
