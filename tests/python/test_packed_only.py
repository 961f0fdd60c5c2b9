"""One copy of the weights: a layer whose CPU forward runs the A8 / A16 GEMM holds only the packed copy
(``set_packed_only``, what ``load_model`` sets), and rebuilds its checkpoint tensors exactly when
anything reads them.

The references are the tensors before they were dropped (``A8Weight.unpack`` must give them back bit
for bit, in their dtypes) and the same layer or model that keeps them (outputs bit-identical); the
embedding lookup from the head's packed rows is checked against ``W8A16Embedding.embed``'s formula on
the tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_utils import PagedKV
from test_fused_layers import _STEPS, _load, _quantized_dir, _run_steps

from inflight.layers.quantized_linear import W4A16Linear, W8A8Linear, W8A16Linear
from inflight.ops.gemm import A8Weight, W8A8Weight
from inflight.quantization.smoothquant import quantize_per_channel
from inflight.quantization.w4a16 import quantize_w4, quantize_w8

# (bits, group_size, symmetric)
FORMATS = [
    (4, 32, False),
    (4, 32, True),
    (4, 64, False),
    (4, 128, True),
    (8, 16, True),
    (8, 32, True),
    (8, 128, True),
]


def _weights(bits, group, symmetric, n, k, scale_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if bits == 4:
        return quantize_w4(w, group, symmetric, scale_dtype)
    q, s = quantize_w8(w, group, scale_dtype)
    return q, s, None


@pytest.mark.parametrize("bits,group,symmetric", FORMATS)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [64, 70, 200])
def test_unpack_gives_back_the_packed_tensors_exactly(bits, group, symmetric, scale_dtype, n):
    k = 256
    q, s, o = _weights(bits, group, symmetric, n, k, scale_dtype)
    if scale_dtype == torch.float32:  # values no fp16 holds: the pack keeps fp32 scales
        s = s * (1 + 2.0**-20)
    packed = A8Weight(bits, q, s, o, group)
    q2, s2, o2 = packed.unpack()
    assert q2.dtype == q.dtype and torch.equal(q2, q)
    assert s2.dtype == torch.float32 and torch.equal(s2.to(scale_dtype), s) and torch.equal(s2, s.float())
    if o is None:
        assert o2 is None
    else:
        assert torch.equal(o2.to(scale_dtype), o) and torch.equal(o2, o.float())


@pytest.mark.parametrize("n,k", [(16, 64), (70, 100), (3, 7)])
def test_w8a8_unpack_gives_back_the_packed_tensors_exactly(n, k):
    g = torch.Generator().manual_seed(n)
    q, s = quantize_per_channel(torch.randn(n, k, generator=g))
    packed = W8A8Weight(q, s, torch.rand(k, generator=g) + 0.5)
    q2, s2 = packed.unpack()
    assert q2.dtype == torch.int8 and torch.equal(q2, q)
    assert s2.dtype == torch.float32 and torch.equal(s2, s.float())
    assert packed.nbytes >= n * k


def test_unpack_and_embed_refuse_wrong_tensors():
    q, s, o = _weights(4, 32, False, 64, 128, torch.float16)
    packed = A8Weight(4, q, s, o, 32)
    from torch.utils.dlpack import to_dlpack

    qw = torch.empty(64, 64, dtype=torch.uint8)
    sc = torch.empty(64, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="offsets must be given"):
        packed._w.unpack(to_dlpack(qw), to_dlpack(sc), None)
    with pytest.raises(ValueError, match="scales"):
        packed._w.unpack(to_dlpack(qw), to_dlpack(torch.empty(64, 3)), to_dlpack(sc.clone()))
    with pytest.raises(ValueError, match="bits=8"):
        packed.embed(torch.tensor([0]), torch.empty(1, 128))
    q8, s8, _ = _weights(8, 32, True, 100, 64, torch.float16)
    packed8 = A8Weight(8, q8, s8, None, 32)
    with pytest.raises(ValueError, match=r"ids\[1\] = 100 is outside 0 \.\. 99"):
        packed8.embed(torch.tensor([3, 100]), torch.empty(2, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [16, 32])
def test_embed_from_the_packed_rows_equals_the_tensors_formula(dtype, group):
    q, s, _ = _weights(8, group, True, 150, 192, torch.float16, seed=3)
    packed = A8Weight(8, q, s, None, group)
    ids = torch.tensor([0, 149, 64, 63, 7, 7, 100])
    got = packed.embed(ids, torch.empty(len(ids), 192, dtype=dtype))
    want = (
        (q[ids].view(len(ids), -1, group).float() * s[ids].float().unsqueeze(-1)).view(len(ids), -1).to(dtype)
    )
    assert torch.equal(got, want)


def _layer(cls, bits, symmetric, mode):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=g)
    bias = torch.randn(96, generator=g)
    if cls is W8A8Linear:  # SmoothQuant's W8A8: per-channel int8, its own int8 activations
        layer = W8A8Linear(128, (96,), bias=True)
        q, s = quantize_per_channel(w)
        for name, t in (
            ("qweight", q),
            ("scales", s),
            ("smooth", torch.rand(128, generator=g) + 0.5),
            ("bias", bias),
        ):
            layer.load_shard(0, name, t)
        return layer
    layer = cls.from_weight(w, bias, group_size=32, **({"symmetric": symmetric} if bits == 4 else {}))
    layer.set_activation_quantization(mode)
    return layer


@pytest.mark.parametrize(
    "cls,bits,symmetric,mode",
    [
        (W4A16Linear, 4, False, "int8"),
        (W4A16Linear, 4, False, "int16"),
        (W4A16Linear, 4, True, "int16"),
        (W8A16Linear, 8, True, "int8"),
        (W8A16Linear, 8, True, "int16"),
        (W8A8Linear, 8, True, None),
    ],
)
def test_a_packed_only_layer_drops_and_rebuilds_its_tensors(cls, bits, symmetric, mode):
    kept = _layer(cls, bits, symmetric, mode)
    layer = _layer(cls, bits, symmetric, mode)
    names = [n for n in ("qweight", "scales", "offsets") if getattr(layer, n, None) is not None]
    want_tensors = {n: getattr(layer, n).clone() for n in names}
    want_state = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    want = kept(x)

    layer.set_packed_only()
    assert not layer.originals_dropped  # nothing packed yet
    assert torch.equal(layer(x), want)
    assert layer.originals_dropped and layer.weight_device == torch.device("cpu")
    assert {n for n, _ in layer.named_buffers()} == ({"bias", "smooth"} if cls is W8A8Linear else {"bias"})
    assert torch.equal(layer(x), want)

    # state_dict() rebuilds the tensors for the caller and keeps the layer packed-only
    state = layer.state_dict()
    assert state.keys() == want_state.keys()
    for k, v in want_state.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k
    assert layer.originals_dropped

    # reading one rebuilds all (exact, in their dtypes) and drops the packed copy; the next forward
    # packs again and drops them again
    assert torch.equal(layer.qweight, want_tensors["qweight"])
    assert not layer.originals_dropped and layer._packed is None
    for n in names:
        assert getattr(layer, n).dtype == want_tensors[n].dtype and torch.equal(
            getattr(layer, n), want_tensors[n]
        )
    assert torch.equal(layer(x), want)
    assert layer.originals_dropped

    # a write through the attribute reaches the next forward
    layer.qweight.zero_()
    assert not torch.equal(layer(x), want)
    assert layer.originals_dropped
    layer.load_state_dict(want_state)  # into a packed-only layer: rebuilt, overwritten, packed again
    assert torch.equal(layer(x), want)
    assert layer.originals_dropped

    if mode is not None:  # another activation mode, or off, rebuilds the tensors first
        layer.set_activation_quantization("none")
        assert not layer.originals_dropped
        kept.set_activation_quantization("none")
        assert torch.equal(layer(x), kept(x))
        assert not layer.originals_dropped  # the float kernel reads the tensors themselves
        layer.set_activation_quantization(mode)
    else:  # W8A8: a shard loaded into a packed-only layer (rebuilt, overwritten, packed again)
        layer.load_shard(0, "scales", want_tensors["scales"] * 2)
        assert not layer.originals_dropped and not torch.equal(layer(x), want)
        layer.load_shard(0, "scales", want_tensors["scales"])
        assert torch.equal(layer(x), want)
    layer(x)
    assert layer.originals_dropped
    layer.set_packed_only(False)
    assert not layer.originals_dropped and torch.equal(layer.qweight, want_tensors["qweight"])
    layer(x)
    assert not layer.originals_dropped

    # .to() / .float() rebuild them before converting
    layer.set_packed_only()
    layer(x)
    assert layer.originals_dropped
    layer.float()
    assert not layer.originals_dropped and torch.equal(layer.qweight, want_tensors["qweight"])


def _packed_only(model) -> int:
    count = 0
    for m in model.modules():
        if hasattr(m, "set_packed_only") and m.activation_quantization != "none":
            m.set_packed_only()
            m.kernel_weight()
            count += m.originals_dropped
    model.invalidate_fused_layers()
    return count


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ends", ["stack", "python"])
def test_packed_only_model_gives_the_same_bits(tmp_path, monkeypatch, arch, dtype, ends):
    """A model whose quantised layers and tied int8 embedding hold only their packed copies computes the
    same logits and caches as the one that keeps the tensors (the embedding read from its head's packed
    rows, by the fused stack or by Python)."""
    from test_fused_ends import _with_int8_embedding

    if ends == "python":
        monkeypatch.setenv("INFLIGHT_FUSED_ENDS", "0")
    path = _quantized_dir(tmp_path, arch)
    models = []
    for packed_only in (False, True):
        model = _with_int8_embedding(_load(path, dtype))
        assert model.set_activation_quantization("int16") > 0
        if packed_only:
            assert _packed_only(model) == 4 * len(model.layers) + 1
            assert model.embedding.originals_dropped
        models.append(model)
    kv = PagedKV.for_model(models[0], num_blocks=32, tokens_per_block=4)
    kv2 = copy.deepcopy(kv)
    want = _run_steps(models[0], kv, _STEPS)
    got = _run_steps(models[1], kv2, _STEPS)
    assert models[1].fused_layers().has_embedding == (ends == "stack")
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"step {i}: max difference {(g - w).abs().max().item()}"
    for a, b in zip(kv.kv_caches, kv2.kv_caches):
        assert torch.equal(a, b)
    # nothing on the step's path read the dropped tensors
    assert all(m.originals_dropped for m in models[1].modules() if isinstance(m, (W4A16Linear, W8A16Linear)))


def test_load_model_holds_the_weights_once(tmp_path):
    """load_model with quantised activations leaves every packed layer without its tensors; float
    activations keep the tensors (their kernels read them)."""
    from inflight.models.loader import load_model

    path = _quantized_dir(tmp_path, "llama")
    for mode, dropped in (("int16", True), ("int8", True), ("none", False)):
        model = load_model(path, activation_quantization=mode).model
        layers = [m for m in model.modules() if isinstance(m, W4A16Linear)]
        assert layers and all(m.originals_dropped == dropped for m in layers), mode
