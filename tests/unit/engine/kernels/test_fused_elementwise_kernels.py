"""Fused RMSNorm (+ residual add) and SwiGLU kernels against the torch formulas they replace,
and a model built with them against the torch-built model. On a CPU machine they run under
Triton's interpreter (tests/conftest.py switches it on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.checkpoint.model_config import ModelConfig
from pdserve.engine.checkpoint.weights import iterate_weights
from pdserve.engine.kernels.activation import silu_and_mul
from pdserve.engine.kernels.norm import rms_norm
from pdserve.engine.runtime.attention import AttentionContext, TorchReferenceBackend
from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.engine.runtime.models import model_class
from pdserve.engine.runtime.models.eagle import EagleConfig, EagleDraftModel
from pdserve.speculative.checkpoints import eagle_draft_config

# The interpreter on CPU (tests/conftest.py), the compiled kernels on a GPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6


class FusedTorchBackend(TorchReferenceBackend):
    fused_elementwise = True


@pytest.fixture
def nan_outputs(monkeypatch):
    """Tensors the kernels allocate start as NaN, so an element they fail to write shows."""
    for name in ("empty", "empty_like"):
        allocate = getattr(torch, name)

        def poisoned(*args, _allocate=allocate, **kwargs):
            return _allocate(*args, **kwargs).fill_(float("nan"))

        monkeypatch.setattr(torch, name, poisoned)


def _random(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=generator)).to(dtype).to(DEVICE)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    return weight * normed.to(x.dtype)


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: within 1e-6 relative. bfloat16: bit-exact but for one element in a thousand
    at most, and those at most two units in the last place (ulp) off.

    Measured under the interpreter over 3.1M norm and 1.6M SwiGLU outputs: 6 norm outputs
    differ, where the float32 sum of squares lands on the other side of a rounding boundary
    than torch's: the normalized value is then one ulp off, which a weight below 1 turns into
    two ulps of the smaller product. A missed rounding step shows as tens of percent."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert not actual.isnan().any()
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
        return
    assert (actual.sign() == expected.sign()).all()
    ulps = (actual.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert ulps.max() <= 2, f"{int((ulps > 2).sum())} elements more than two ulps apart"
    inexact = int((ulps > 0).sum())
    assert inexact <= max(1, actual.numel() // 1000), f"{inexact} of {actual.numel()} inexact"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [48, 200])
def test_rms_norm_equals_torch(nan_outputs, dtype, hidden):
    x = _random(7, hidden, dtype=dtype, seed=hidden)
    weight = _random(hidden, dtype=dtype, seed=hidden + 1, scale=0.5) + 1
    _assert_matches(rms_norm(x, weight, EPS), _torch_rms_norm(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [48, 200])
def test_rms_norm_with_residual_adds_first_and_updates_the_residual_in_place(
    nan_outputs, dtype, hidden
):
    x = _random(5, hidden, dtype=dtype, seed=hidden + 2)
    residual = _random(5, hidden, dtype=dtype, seed=hidden + 3, scale=4.0)
    weight = _random(hidden, dtype=dtype, seed=hidden + 4, scale=0.5) + 1
    expected_sum = x + residual
    out, new_residual = rms_norm(x, weight, EPS, residual)
    assert new_residual is residual
    assert torch.equal(residual, expected_sum)
    _assert_matches(out, _torch_rms_norm(expected_sum, weight))


def test_rms_norm_reads_rows_of_a_wider_tensor(nan_outputs):
    """EAGLE-3's fc_norm normalizes column slices of the captured features."""
    features = _random(3, 3 * 40, dtype=torch.float32, seed=5)
    weight = _random(40, dtype=torch.float32, seed=6) + 1
    part = features[:, 40:80]
    _assert_matches(rms_norm(part, weight, EPS), _torch_rms_norm(part, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("intermediate", [48, 200, 1100])
def test_silu_and_mul_equals_torch(nan_outputs, dtype, intermediate):
    """1100 spans two column blocks of the kernel."""
    gate_up = _random(3, 2 * intermediate, dtype=dtype, seed=intermediate, scale=3.0)
    gate, up = gate_up.split(intermediate, dim=-1)
    _assert_matches(silu_and_mul(gate_up), F.silu(gate) * up)


def test_kernels_reject_misshapen_input():
    with pytest.raises(ValueError, match=r"\[T, 8\]"):
        rms_norm(torch.ones(2, 6), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(torch.ones(2, 8), torch.ones(8), EPS, torch.ones(3, 8))
    with pytest.raises(ValueError, match=r"2 \* I"):
        silu_and_mul(torch.ones(2, 7))


# --- models built with the fused kernels ----------------------------------------------------


def _prefill_then_decode(model, num_layers: int, kv_heads: int, head_dim: int, run):
    """`run(model, ids, pool, ctx)` over a two-sequence prefill, then one decode step of
    each; the outputs of both steps."""
    pool = KVPool(
        num_layers=num_layers, num_pages=8, page_size=4, num_kv_heads=kv_heads,
        head_dim=head_dim, dtype=torch.float32, device=DEVICE,
    )  # fmt: skip
    outputs = []
    for computed, lens in (([0, 0], [5, 7]), ([5, 7], [1, 1])):
        ctx = AttentionContext.build(
            page_size=4, pages=[[0, 1], [2, 3]], num_computed=computed, query_lens=lens,
            device=DEVICE,
        )  # fmt: skip
        ids = _random(sum(lens), dtype=torch.float32, seed=sum(computed)).abs() * 97
        outputs.append(run(model, ids.long() + 3, pool, ctx))
    return outputs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.no_grad()
def test_model_built_with_fused_kernels_equals_torch_model(tiny_model_dirs, arch):
    path = tiny_model_dirs(arch)
    config = ModelConfig.from_pretrained(path)

    def build(backend):
        with torch.device(DEVICE):
            model = model_class(config.architecture)(config, backend, 64)
        model.load_weights(iterate_weights(path, DEVICE))
        return model.eval()

    def run(model, ids, pool, ctx):
        hidden, captured = model.forward_capture(ids, ctx.positions, pool, ctx, layers=(1, 0))
        return torch.cat([hidden, captured], dim=-1)

    fused_model = build(FusedTorchBackend())
    assert fused_model.model.norm.fused and fused_model.model.layers[0].mlp.fused
    shapes = (config.num_layers, config.num_kv_heads, config.head_dim)
    expected = _prefill_then_decode(build(TorchReferenceBackend()), *shapes, run)
    actual = _prefill_then_decode(fused_model, *shapes, run)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eagle3", [True, False])
@torch.no_grad()
def test_eagle_draft_built_with_fused_kernels_equals_torch_draft(tiny_model_dirs, eagle3):
    """Two layers: EAGLE-3 (with fc_norm) or EAGLE's first layer, then a decoder layer. The
    draft must leave the features it is given untouched (fused norms write residuals in
    place)."""
    target = ModelConfig.from_pretrained(tiny_model_dirs("llama"))
    hf = eagle_draft_config(
        target, eagle3=eagle3, hidden_size=64, num_layers=2, aux_layer_ids=[1, 0], fc_norm=True
    )
    config = EagleConfig.from_dict(hf, target)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        reference = EagleDraftModel(config, TorchReferenceBackend(), 64).eval()
    for name, param in reference.named_parameters():
        if "norm" in name:
            param.copy_(1 + 0.5 * torch.randn_like(param))
    with torch.device(DEVICE):
        fused = EagleDraftModel(config, FusedTorchBackend(), 64).eval()
    fused.load_state_dict(reference.state_dict())
    layers = config.layers

    def run(model, ids, pool, ctx):
        width = config.capture_width if ctx.num_tokens > 2 else config.hidden_size
        features = _random(ctx.num_tokens, width, dtype=torch.float32, seed=width)
        given = features.clone()
        out = model(ids, ctx.positions, features, ctx.num_tokens > 2, pool, ctx)
        assert torch.equal(features, given)
        return torch.cat([out, model.compute_logits(out)], dim=-1)

    shapes = (layers.num_layers, layers.num_kv_heads, layers.head_dim)
    expected = _prefill_then_decode(reference, *shapes, run)
    actual = _prefill_then_decode(fused, *shapes, run)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
