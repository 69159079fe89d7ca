"""RoPE (models/rope.py): the GPU paths' shapeless rotation equals the CPU
paths' per-shape one bit for bit, one trace serves every pass length, and
half precision on the GPU paths takes MLX's fused kernel, closer to the
float32 rotation than the half-precision one."""

import mlx.core as mx
import numpy as np
import pytest

from refusion_mlx.models import rope
from refusion_mlx.models.rope import PositionalRoPE, apply_rope, rotate_halves, rotate_shapeless


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("batch", [None, 3])
def test_shapeless_rotation_equals_the_per_shape_one(dtype, batch):
    rng = np.random.default_rng(0)
    H, D = 6, 16
    table = PositionalRoPE(D, 1_000_000.0, None)
    for T in (1, 2, 5, 9, 38):
        shape = (T,) if batch is None else (batch, T)
        cos, sin = table.angles(mx.array(rng.integers(0, 40000, size=shape).astype(np.int32)))
        x = mx.array(rng.standard_normal((batch or 1, H, T, D)).astype(np.float32)).astype(dtype)
        scale = mx.array(rng.standard_normal((H, 1, 1)).astype(np.float32))
        want = rotate_halves(x, cos, sin, scale)
        got = rotate_shapeless(x, cos, sin, scale)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                                   atol=1e-6, rtol=0)
        assert mx.array_equal(got, want).item()  # the same arithmetic: bit for bit


def test_apply_rope_takes_the_paths_rotation(monkeypatch, set_paths):
    taken = []
    monkeypatch.setattr(rope, "rotate_shapeless", lambda *a: taken.append("gpu"))
    monkeypatch.setattr(rope, "rotate_halves", lambda *a: taken.append("cpu"))
    for mode in ("gpu", "cpu"):
        set_paths(mode)
        apply_rope(mx.zeros((1, 2, 3, 4)), (None, None), None)
    assert taken == ["gpu", "cpu"]


def counted_rotation(monkeypatch, shapeless):
    """Swap in a rotation traced from a counting copy of rope._rotate: the
    count grows once per trace."""
    calls = []
    inner = rope._rotate

    def counted(*args):
        calls.append(args[0].shape)
        return inner(*args)

    monkeypatch.setattr(rope, "_rotate_shapeless", mx.compile(counted, shapeless=shapeless))
    return calls


def run_lengths(lengths, batch=None):
    rng = np.random.default_rng(1)
    table = PositionalRoPE(16, 10_000.0, None)
    scale = mx.ones((4, 1, 1))
    for T in lengths:
        shape = (T,) if batch is None else (batch, T)
        positions = mx.array(rng.integers(0, 100, size=shape).astype(np.int32))
        x = mx.array(rng.standard_normal((batch or 1, 4, T, 16)).astype(np.float32))
        out = rotate_shapeless(x, *table.angles(positions), scale)
        mx.eval(out)
        assert out.shape == x.shape


def test_one_trace_for_every_pass_length(monkeypatch):
    calls = counted_rotation(monkeypatch, shapeless=True)
    run_lengths(range(1, 41))
    assert len(calls) == 1
    # a batch (angles of another rank) traces once more, then serves every size
    run_lengths((3, 7, 11), batch=2)
    run_lengths((5,), batch=5)
    assert len(calls) == 2


def test_the_counter_sees_a_retrace(monkeypatch):
    """The count above means something: compiled per shape, the same
    function is traced again for every pass length."""
    calls = counted_rotation(monkeypatch, shapeless=False)
    run_lengths((1, 2, 3))
    assert len(calls) == 3


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_gpu_paths_rotate_in_the_fused_kernel(set_paths, dtype):
    """for_pass gives the positions (each token its own batch entry of
    mx.fast.rope) in half precision on the GPU paths, cos and sin otherwise;
    the fused rotation is nearer the float32 one than rounding cos, sin and
    each product to half precision, at positions up to 40,000."""
    rng = np.random.default_rng(2)
    table = PositionalRoPE(64, 1_000_000.0, None)
    B, H, T, D = 2, 6, 9, 64
    positions = mx.array(rng.integers(0, 40000, size=(B, T)).astype(np.int32))
    x = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32))
    scale = mx.array(rng.uniform(0.1, 1.0, (H, 1, 1)).astype(np.float32))
    set_paths("cpu")
    assert isinstance(table.for_pass(positions, dtype), tuple)
    set_paths("gpu")
    assert isinstance(table.for_pass(positions, mx.float32), tuple)
    fused = table.for_pass(positions, dtype)
    assert isinstance(fused, rope.TokenPositions) and fused.offsets.shape == (B * T,)
    exact = np.array(apply_rope(x, table.for_pass(positions, mx.float32), scale))
    got = apply_rope(x.astype(dtype), fused, scale.astype(dtype))
    half = apply_rope(x.astype(dtype), table.angles(positions, dtype), scale.astype(dtype))
    assert got.dtype == dtype and got.shape == x.shape
    err = np.abs(np.array(got.astype(mx.float32)) - exact)
    assert err.max() <= np.abs(np.array(half.astype(mx.float32)) - exact).max()
    assert err.mean() < 2e-3
