"""Tensor parallelism on CPU gloo ranks: the sharded model against the unsharded one (logits), the
engine at tp=2 against tp=1 (greedy tokens at every step whose tp=1 margin is not a near-tie, log-probs),
and the failure and shutdown contract (a rank killed or raising, start-up failure, rank 0 dying, no
process left behind). Every wait is bounded."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch
import torch.multiprocessing as mp
from model_utils import PagedKV, make_tiny_model

from inflight import LLM, KvCacheConfig, SamplingParams
from inflight.executor.parallel_runtime import FAULT_ENV, RankFailure
from inflight.llm_args import SchedulerConfig

MARGIN = 1e-3  # a tp=1 top-1 / top-2 gap below this is a near-tie: the tokens after it may differ
TPB = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> list[psutil.Process]:
    """This process's live descendants, but multiprocessing's resource tracker (one per process, kept
    for its lifetime by design)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE or "resource_tracker" in " ".join(p.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(p)
    return out


def _tiny(tmp_path_factory, name: str, **overrides) -> str:
    kwargs = {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 128,
        "num_hidden_layers": 2,
    }
    kwargs.update(overrides)
    return str(make_tiny_model(tmp_path_factory.mktemp(name), with_tokenizer=False, **kwargs))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from inflight.quantization import quantize_checkpoint

    kv2 = _tiny(tmp_path_factory, "kv2", num_hidden_layers=3, max_position_embeddings=4096)
    kv1 = _tiny(tmp_path_factory, "kv1", num_key_value_heads=1, vocab_size=130)
    q = str(quantize_checkpoint(kv2, tmp_path_factory.mktemp("q") / "w4a16", group_size=32, symmetric=False))
    return {"kv2": kv2, "kv1": kv1, "w4a16": q}


# ---------------------------------------------------------------------------------------------- the model


def _model_worker(rank: int, world: int, port: int, path: str, backend: str, transport: str) -> None:
    """Every rank runs its shard over the same steps; rank 0 compares with the unsharded model."""
    import torch.distributed as dist

    from inflight.models.loader import load_model
    from inflight.parallel import Mapping, init_process_groups
    from inflight.parallel.comm import TensorParallel
    from inflight.parallel.shm import hosts_of, make_shm_comm

    torch.set_num_threads(1)
    os.environ["INFLIGHT_TP_TRANSPORT"] = transport
    mapping = Mapping(world, rank, world, 1)
    groups = init_process_groups(mapping, init_method=f"tcp://127.0.0.1:{port}", timeout=60)
    hosts = hosts_of(mapping, groups.control)
    shm = make_shm_comm(mapping, mapping.tp_group, groups.tp, hosts, "cpu", "TP group")
    tp = TensorParallel(mapping.tp_rank, mapping.tp_size, groups.tp, shm=shm)
    assert tp.transport == transport
    model = load_model(path, dtype="float32", attention_backend=backend, tp=tp).model
    kv = PagedKV(model.num_layers, model.num_kv_heads, model.config.head_dim, tokens_per_block=4)
    if rank == 0:
        full = load_model(path, dtype="float32", attention_backend=backend).model
        kv_full = PagedKV.for_model(full, tokens_per_block=4)
    prompt = list(range(3, 22))
    # Two prefills of different lengths, then decodes of both, then a chunk beside a decode.
    steps = [[("a", prompt), ("b", prompt[:6])]] + [[("a", [7]), ("b", [9])] for _ in range(3)]
    steps.append([("c", prompt[:9]), ("a", [11])])
    for batch in steps:
        ids, pos, md = kv.step(batch, logits="all")
        out = model(ids, pos, md, kv.kv_caches)
        if rank == 0:
            ids_f, pos_f, md_f = kv_full.step(batch, logits="all")
            want = full(ids_f, pos_f, md_f, kv_full.kv_caches)
            torch.testing.assert_close(out, want, rtol=0, atol=1e-4)
        else:
            assert out is None
    if backend == "native":  # the fused C++ stack ran (with its reduction hook), not the Python layers
        assert model.fused_layers() is not None
    dist.destroy_process_group()


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("which", ["kv2", "kv1", "w4a16"])
def test_sharded_model_matches_the_unsharded_one(models, which, backend, transport):
    """tp=2 logits within 1e-4 of tp=1 over prefills, decodes and a mixed step: 2 KV heads split, 1 KV
    head replicated with a padded vocabulary (130 over 2 ranks), and a W4A16 model sharded along whole
    quantisation groups; the Python layers and the fused C++ stack; the all-reduces over shared memory
    (the fused stack calls them from C++) and over gloo (it calls back into Python)."""
    mp.start_processes(
        _model_worker,
        args=(2, _free_port(), models[which], backend, transport),
        nprocs=2,
        start_method="spawn",
    )


# ---------------------------------------------------------------------------------------------- end to end

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 9, 30, 12, 3)] + [[40, 41, 42] * 7, [99] * 11]


def _generate(path: str, tp: int, max_tokens: int = 16, pp: int = 1, **kwargs) -> tuple[LLM, list]:
    kwargs.setdefault("kv_cache_config", KvCacheConfig(max_tokens=4096, tokens_per_block=TPB))
    llm = LLM(path, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp, **kwargs)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2, ignore_eos=True)
        return llm, llm.generate(PROMPTS, params, use_tqdm=False)
    except BaseException:
        llm.shutdown()
        raise


def _assert_equivalent(ref: list, got: list) -> None:
    """Per request and step, while tp=1's top-1 / top-2 margin is >= MARGIN: the same token, and its
    log-probability within 1e-4. At least half of all steps must be compared."""
    compared = total = 0
    for r, g in zip(ref, got):
        r_out, g_out = r.outputs[0], g.outputs[0]
        assert g_out.finish_reason == r_out.finish_reason == "length", (g_out.error, r_out.error)
        total += len(r_out.token_ids)
        for step, (tok, lp) in enumerate(zip(r_out.token_ids, r_out.logprobs)):
            top = sorted(lp.values(), reverse=True)
            if top[0] - top[1] < MARGIN:
                break  # a near-tie: what follows may legitimately differ
            assert g_out.token_ids[step] == tok, (r.prompt_token_ids, step, r_out.token_ids, g_out.token_ids)
            assert abs(g_out.logprobs[step][tok] - lp[tok]) <= 1e-4, (step, g_out.logprobs[step], lp)
            compared += 1
    assert compared >= total // 2, f"only {compared} of {total} steps had a clear margin"


@pytest.mark.parametrize(
    "which,kwargs",
    [
        ("kv2", {}),
        ("kv1", {}),
        ("kv2", {"enable_chunked_prefill": True, "max_num_tokens": 16}),
        ("kv2", {"disable_overlap_scheduler": False}),
        ("w4a16", {}),
    ],
    ids=["kv2", "kv1-replicated", "chunked-prefill", "overlap", "w4a16"],
)
def test_tp2_generates_what_tp1_generates(models, which, kwargs):
    ref_llm, ref = _generate(models[which], 1, **kwargs)
    ref_llm.shutdown()
    llm, got = _generate(models[which], 2, **kwargs)
    try:
        assert llm.parallel == "tp=2 pp=1"
        assert llm.get_stats()[-1]["parallel"] == "tp=2 pp=1"
        _assert_equivalent(ref, got)
    finally:
        llm.shutdown()
    assert not _children()


def test_tp2_over_gloo_alone(models, monkeypatch):
    """INFLIGHT_TP_TRANSPORT=gloo: every collective and the step channel over torch.distributed (the
    path between hosts), with heartbeats while idle."""
    monkeypatch.setenv("INFLIGHT_TP_TRANSPORT", "gloo")
    monkeypatch.setattr("inflight.executor.parallel_model.HEARTBEAT_S", 0.2)
    ref_llm, ref = _generate(models["kv2"], 1)
    ref_llm.shutdown()
    llm, got = _generate(models["kv2"], 2)
    try:
        model = llm.executor.model_engine.model
        assert model.tp.transport == "gloo" and model.channel.transport == "gloo"
        _assert_equivalent(ref, got)
        time.sleep(1.0)  # idle: heartbeats flow
        assert model.heartbeats >= 2
        again = llm.generate(
            PROMPTS[:2], SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
        )
        _assert_equivalent(ref[:2], again)
    finally:
        llm.shutdown()
    assert not _children()


def test_tp2_under_forced_preemption(models):
    """MAX_UTILIZATION over a pool far too small: requests are paused and recomputed, at tp=2 as at tp=1."""
    kv = KvCacheConfig(max_tokens=12 * TPB, tokens_per_block=TPB)
    sched = SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION")
    ref_llm, ref = _generate(models["kv2"], 1, kv_cache_config=kv, scheduler_config=sched)
    ref_llm.shutdown()
    llm, got = _generate(models["kv2"], 2, kv_cache_config=kv, scheduler_config=sched)
    try:
        _assert_equivalent(ref, got)
        assert sum(s["num_paused_requests"] for s in llm.get_stats()) > 0, "nothing was preempted"
    finally:
        llm.shutdown()


def test_tp2_prefix_reuse_hits_and_changes_nothing(models):
    ref_llm, ref = _generate(models["kv2"], 1)
    ref_llm.shutdown()
    llm, got = _generate(models["kv2"], 2)
    try:
        _assert_equivalent(ref, got)
        before = llm.get_stats()[-1]["kv_cache_stats"]["reused_blocks"]
        params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
        again = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.get_stats()[-1]["kv_cache_stats"]["reused_blocks"] > before, "no prefix hit"
        _assert_equivalent(ref, again)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "tp,pp,which",
    [(1, 2, "kv2"), (1, 3, "kv2"), (2, 2, "kv2"), (1, 2, "w4a16")],
    ids=["pp2", "pp3", "tp2xpp2", "pp2-w4a16"],
)
def test_pipeline_stages_generate_what_one_process_generates(models, tp, pp, which):
    """Layers split over pp stages (3 layers: 2+1, and 1+1+1), the micro-batches in flight filling the
    pipe (the stats show pp of them), TP x PP combined over 4 ranks with 8 concurrent requests."""
    ref_llm, ref = _generate(models[which], 1)
    ref_llm.shutdown()
    llm, got = _generate(models[which], tp, pp=pp)
    try:
        assert llm.parallel == f"tp={tp} pp={pp}"
        assert max(s["num_micro_batches_in_flight"] for s in llm.get_stats()) == pp
        _assert_equivalent(ref, got)
    finally:
        llm.shutdown()
    assert not _children()


def test_a_killed_last_stage_fails_every_request(models):
    llm = LLM(models["kv2"], dtype="float32", pipeline_parallel_size=2, max_batch_size=3)
    try:
        handles = _long_requests(llm)
        _follower(llm).kill()
        _assert_all_failed_naming(handles, "rank 1", within=5.0)
        assert not llm.is_alive
    finally:
        llm.shutdown()
    assert not _children()


def test_sizes_that_do_not_divide_are_refused_before_any_process_starts(models):
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        LLM(models["kv2"], dtype="float32", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_hidden_layers=3 is fewer than pipeline_parallel_size=4"):
        LLM(models["kv2"], dtype="float32", pipeline_parallel_size=4)
    assert not _children()


# ---------------------------------------------------------------------------------------------- failures


def _long_requests(llm: LLM, n: int = 3) -> list:
    """``n`` requests that run to max_seq_len (thousands of steps), once they are all decoding."""
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    handles = [llm.generate_async(PROMPTS[i], params) for i in range(n)]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = llm.get_stats()
        if stats and stats[-1]["num_active_requests"] == n and stats[-1]["num_generation_requests"] > 0:
            return handles
        time.sleep(0.01)
    raise AssertionError(f"the requests did not start decoding: {llm.get_stats()[-1:]}")


def _assert_all_failed_naming(handles: list, rank_text: str, within: float) -> None:
    t0 = time.monotonic()
    for h in handles:
        out = h.result(timeout=within)
        assert out.outputs[0].finish_reason == "error", out.outputs[0]
        assert rank_text in out.outputs[0].error, out.outputs[0].error
    assert time.monotonic() - t0 <= within


def _follower(llm: LLM) -> psutil.Process:
    return psutil.Process(llm.executor.model_engine.model.cluster.procs[1].pid)


def test_a_killed_rank_fails_every_request_within_5_s(models):
    llm = LLM(models["kv2"], dtype="float32", tensor_parallel_size=2, max_batch_size=3)
    try:
        handles = _long_requests(llm)
        queued = llm.generate_async(PROMPTS[3], SamplingParams(max_tokens=8))  # no room: it waits
        _follower(llm).kill()
        _assert_all_failed_naming(handles + [queued], "rank 1", within=5.0)
        assert not llm.is_alive
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - t0 < 1.0
    finally:
        llm.shutdown()
    assert not _children()


def test_a_rank_killed_while_idle_is_noticed(models):
    llm = LLM(models["kv2"], dtype="float32", tensor_parallel_size=2)
    try:
        follower = _follower(llm)
        follower.kill()
        deadline = time.monotonic() + 5.0
        while llm.is_alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.is_alive
        with pytest.raises(RuntimeError, match="rank 1 .*SIGKILL"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()
    assert not _children()


def test_a_rank_that_raises_mid_run_fails_every_request_with_its_error(models, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "rank=1,stage=step,after=6")
    llm = LLM(models["kv2"], dtype="float32", tensor_parallel_size=2)
    try:
        with llm.executor.arrivals():  # all three before the 6th step, however slow this machine
            handles = [
                llm.generate_async(p, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
                for p in PROMPTS[:3]
            ]
        _assert_all_failed_naming(handles, "rank 1 raised", within=10.0)
        assert "injected fault" in handles[0].result().outputs[0].error
        assert not llm.is_alive
    finally:
        llm.shutdown()
    assert not _children()


def test_start_up_failure_raises_within_seconds_with_the_rank_s_traceback(models, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "rank=1,stage=load")
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)start-up failed: rank 1 raised:.*Traceback.*injected fault"):
        LLM(models["kv2"], dtype="float32", tensor_parallel_size=2)
    assert time.monotonic() - t0 < 15.0
    assert not _children()


def test_rank_0_dying_makes_the_followers_exit(models, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(
        "import os, signal, sys\n"
        "from inflight import LLM\n"
        f"llm = LLM({models['kv2']!r}, dtype='float32', tensor_parallel_size=2)\n"
        "print(llm.executor.model_engine.model.cluster.procs[1].pid, flush=True)\n"
        "sys.stdin.readline()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        follower = psutil.Process(int(proc.stdout.readline()))
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(30) == -signal.SIGKILL
        follower.wait(10)  # raises psutil.TimeoutExpired if it is still running
    finally:
        proc.kill()


def test_shutdown_leaves_no_process_and_a_tp_engine_can_be_made_three_times(models):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = []
    for _ in range(3):
        with LLM(models["kv2"], dtype="float32", tensor_parallel_size=2) as llm:
            outs.append(llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids)
            assert len(_children()) == 1
        assert not _children()
    assert outs[0] == outs[1] == outs[2]


# ---------------------------------------------------------------------------------------------- launchers

_TORCHRUN_SCRIPT = """
import json, sys
from inflight import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2)
if llm.is_driver:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    with open(sys.argv[2], "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
    llm.shutdown()
else:
    try:
        llm.generate([[1, 2]])
    except RuntimeError as e:
        assert "follower" in str(e), e
"""


def test_torchrun_two_ranks_rank_0_equals_tp1(models, tmp_path):
    import json

    script = tmp_path / "run.py"
    script.write_text(f"PROMPTS = {PROMPTS!r}\n" + _TORCHRUN_SCRIPT)
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
        str(script),
        models["kv2"],
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(out.read_text())
    with LLM(models["kv2"], dtype="float32") as llm:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want


@pytest.mark.cuda
def test_tp2_on_two_gpus_nccl(models):
    """NCCL needs one GPU per rank: a single GPU can run NCCL only at world size 1."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (one per NCCL rank)")
    ref_llm, ref = _generate(models["kv2"], 1, device="cuda")
    ref_llm.shutdown()
    llm, got = _generate(models["kv2"], 2, device="cuda")
    try:
        _assert_equivalent(ref, got)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_speculative_decoding_across_ranks_changes_nothing(models, tp, pp):
    """n-gram drafts under tensor parallelism (drafting rows through every rank's fused stack) and with
    pipeline stages (drafts planned only for requests not in a launched micro-batch)."""
    from inflight import SpeculativeConfig

    spec = SpeculativeConfig(method="ngram", max_draft_len=3)
    ref_llm, ref = _generate(models["kv2"], 1)
    ref_llm.shutdown()
    llm, got = _generate(models["kv2"], tp, pp=pp, speculative_config=spec)
    try:
        _assert_equivalent(ref, got)
        assert llm.get_stats()[-1]["spec_decode"]["num_draft_tokens_total"] > 0, "nothing was drafted"
    finally:
        llm.shutdown()
    assert not _children()


def _beams(llm: LLM, prompts: list, params: list) -> list[list[tuple[list[int], float]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(list(c.token_ids), c.cumulative_logprob) for c in o.outputs] for o in outs]


@pytest.mark.parametrize(
    "tp,pp,kv_dtype",
    [(2, 1, "auto"), (1, 2, "auto"), (2, 2, "auto"), (2, 1, "int8"), (2, 1, "fp8")],
    ids=["tp2", "pp2", "tp2xpp2", "tp2-int8kv", "tp2-fp8kv"],
)
def test_beam_search_across_ranks_gives_the_single_process_beams(models, tp, pp, kv_dtype):
    """Beam requests (their beams forked KV sequences, the partly filled last blocks copied on write)
    beside greedy ones: each step's block copies travel with the step, so every rank's pool (an int8
    pool's codes and scales too, an fp8 pool's bytes) stays rank 0's and the beams, their order and their scores are those
    of one process."""
    prompts = PROMPTS[:4] + PROMPTS[4:6]
    beam = [
        SamplingParams(use_beam_search=True, best_of=k, n=k, max_tokens=12, ignore_eos=True)
        for k in (4, 3, 2, 4)
    ]
    greedy = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 2
    kv = KvCacheConfig(max_tokens=4096, tokens_per_block=TPB, dtype=kv_dtype)
    ref_llm = LLM(models["kv2"], dtype="float32", kv_cache_config=kv)
    try:
        want = _beams(ref_llm, prompts, beam + greedy)
    finally:
        ref_llm.shutdown()
    llm = LLM(
        models["kv2"], dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_cache_config=kv
    )
    try:
        copies = []
        model = llm.executor.model_engine.model
        queue = model.queue_block_copies

        def count(pairs) -> None:
            copies.extend(pairs)
            queue(pairs)

        llm.executor.kv_cache_manager.on_block_copies = count
        got = _beams(llm, prompts, beam + greedy)
        assert copies, "no block was copied on write: the test proves nothing"
        for w, g in zip(want, got):
            assert [t for t, _ in g] == [t for t, _ in w]
            assert [s for _, s in g] == pytest.approx([s for _, s in w], abs=1e-4)
        llm.executor.kv_cache_manager.impl.check_integrity()
    finally:
        llm.shutdown()
    assert not _children()
