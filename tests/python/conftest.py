from __future__ import annotations

import pytest


def _cuda_usable() -> bool:
    try:
        from inflight.cuda import cuda_available

        return cuda_available()
    except Exception:  # noqa: BLE001  (any failure to reach a GPU means: no GPU tests)
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_usable():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with a driver (none on this machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# ---- LLM API fixtures (test_llm_*.py) -------------------------------------------------------------
#
# Tiny random checkpoints are written once per session; the transformers greedy references of
# llm_utils.LLM_PROMPTS are computed once per architecture and shared by every test that needs them.


def _machine_isas() -> list[str]:
    """Every CPU kernel path this machine can run, the portable one first."""
    from inflight import _C

    order = ["portable", "avx2", "avx512f", "avx512"]
    return order[: order.index(_C.cpu_best_isa()) + 1]


@pytest.fixture(params=_machine_isas())
def isa(request):
    """Runs the test once per CPU kernel path the machine has (INFLIGHT_CPU_ISA's values), restoring the
    selected one afterwards."""
    from inflight import _C

    before = _C.cpu_isa()
    assert _C.set_cpu_isa(request.param) == request.param
    yield request.param
    _C.set_cpu_isa(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``tiny_model_dir(arch, with_tokenizer=True, **overrides)`` -> checkpoint path, cached per session."""
    from model_utils import make_tiny_model

    cache: dict = {}

    def get(arch: str = "llama", with_tokenizer: bool = True, **overrides):
        key = (arch, with_tokenizer, tuple(sorted(overrides.items())))
        if key not in cache:
            base = tmp_path_factory.mktemp(f"{arch}-{'tok' if with_tokenizer else 'notok'}")
            cache[key] = make_tiny_model(base, arch, with_tokenizer=with_tokenizer, **overrides)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def hf_greedy_refs(tiny_model_dir):
    """``hf_greedy_refs(arch)`` -> transformers' greedy outputs (LLM_MAX_NEW tokens) for LLM_PROMPTS,
    computed once per architecture per session."""
    from llm_utils import LLM_MAX_NEW, LLM_PROMPTS, hf_greedy

    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = hf_greedy(tiny_model_dir(arch), LLM_PROMPTS, LLM_MAX_NEW)
        return cache[arch]

    return get


@pytest.fixture
def make_llm(tiny_model_dir):
    """``make_llm(arch="llama", model=None, **llm_kwargs)`` -> an LLM (fp32, a 4096-token pool of
    8-token blocks unless given) that is shut down when the test ends, whatever happened; a shutdown
    that hangs fails the test instead of hanging the suite."""
    import threading

    from llm_utils import LLM_TPB

    from inflight.llm import LLM
    from inflight.llm_args import KvCacheConfig

    made = []

    def make(arch: str = "llama", model=None, **kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("kv_cache_config", KvCacheConfig(max_tokens=4096, tokens_per_block=LLM_TPB))
        llm = LLM(model if model is not None else tiny_model_dir(arch), **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        t = threading.Thread(target=llm.shutdown, daemon=True)
        t.start()
        t.join(60)
        if t.is_alive():
            pytest.fail("LLM.shutdown() did not return within 60 s")
