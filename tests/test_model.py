"""The MLX Qwen3 with per-token positions against the PyTorch model."""

import mlx.core as mx
import numpy as np
import pytest

from refusion_mlx.errors import ConfigError
from refusion_mlx.models.projections import hf_parameters, join_projections
from refusion_mlx.models.qwen3 import ModelArgs
from refusion_mlx.models.loading import load

from tests.helpers import FIXTURE_MODEL, random_config, random_model


@pytest.mark.parametrize("kind", ["plain", "slots"])
def test_logits_match_pytorch_float32(demo, golden_logits, kind):
    model, _ = demo
    ids = mx.array(golden_logits[f"{kind}_input_ids"])[None]
    pos = mx.array(golden_logits[f"{kind}_position_ids"])
    out = np.array(model(ids, pos))[0]
    assert np.abs(out - golden_logits[f"{kind}_logits"]).max() < 1e-4


def test_shuffled_positions_change_the_logits(demo, golden_logits):
    """RoPE must use each token's position id, not its index in the sequence."""
    model, _ = demo
    ids = mx.array(golden_logits["slots_input_ids"])[None]
    by_index = np.array(model(ids, mx.arange(ids.shape[1])))[0]
    assert np.abs(by_index - golden_logits["slots_logits"]).max() > 1e-2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_keeps_top1(golden_logits, dtype):
    model, _ = load(FIXTURE_MODEL, dtype=dtype)
    for kind in ("plain", "slots"):
        ids = mx.array(golden_logits[f"{kind}_input_ids"])[None]
        out = model(ids, mx.array(golden_logits[f"{kind}_position_ids"]))
        assert out.dtype == getattr(mx, dtype)
        top1 = np.array(mx.argmax(out, axis=-1))[0]
        agree = (top1 == golden_logits[f"{kind}_logits"].argmax(-1)).mean()
        assert agree >= 0.95


def test_linear_rope_scaling_divides_positions():
    base = random_model(random_config(), seed=1)
    scaled = random_model(random_config(rope_scaling={"rope_type": "linear", "factor": 2.0}), seed=1)
    ids = mx.array([[5, 9, 13, 2, 7]])
    pos = mx.array([0, 3, 1, 4, 2])
    assert np.allclose(np.array(base(ids, pos)), np.array(scaled(ids, pos * 2)), atol=1e-5)


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0}, {"type": "dynamic", "factor": 2.0}])
def test_unsupported_rope_scaling_is_a_clear_error(scaling):
    with pytest.raises(ConfigError, match="not supported"):
        ModelArgs.from_dict(random_config(rope_scaling=scaling))


def test_non_qwen3_is_refused():
    with pytest.raises(ConfigError, match="qwen3"):
        ModelArgs.from_dict(random_config(model_type="llama"))


def test_tied_embeddings_use_the_embedding_as_head():
    model = random_model(random_config(tie=True), seed=2)
    assert "lm_head" not in model
    ids = mx.array([[1, 2, 3]])
    h = model.hidden(ids, mx.arange(3))
    expected = h @ model.model.embed_tokens.weight.T
    assert np.allclose(np.array(model(ids, mx.arange(3))), np.array(expected), atol=1e-5)




@pytest.mark.parametrize("variant", [
    dict(tie=True),
    dict(vocab_size=1000),                      # padded: embedding rows > tokenizer length
    dict(heads=8, kv_heads=1, head_dim=8),      # GQA 8:1, small head_dim
    dict(attention_bias=True),
    dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
])
def test_hf_checkpoint_logits_match_transformers(tmp_path, variant):
    """Checkpoints saved by transformers load and run like Qwen3ForCausalLM."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.helpers import TOKENIZER_FILES

    cfg = random_config(**variant)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in cfg.items() if k != "architectures"}))
    hf.eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    import shutil
    for name in TOKENIZER_FILES:
        if (FIXTURE_MODEL / name).exists():
            shutil.copy(FIXTURE_MODEL / name, tmp_path / name)
    model, tokenizer = load(tmp_path, dtype="float32")
    assert model.args.mask_token_id == 805
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg["vocab_size"], size=24)
    pos = rng.permutation(40)[:24]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)[None], position_ids=torch.tensor(pos)[None]).logits[0].numpy()
    out = np.array(model(mx.array(ids)[None], mx.array(pos)))[0]
    assert out.shape == (24, cfg["vocab_size"])
    assert np.abs(out - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())


def _quantized(config, seed, **q):
    import mlx.nn as nn

    model = random_model(config, seed=seed)
    nn.quantize(model, **q)
    return model


@pytest.mark.parametrize("kind", ["float", "quantized"])
def test_joined_projections_compute_the_same(kind):
    """Joining q/k/v and gate/up changes nothing but the number of matmuls."""
    config = random_config(vocab_size=128, hidden=128, intermediate=256, head_dim=32)
    make = (lambda: random_model(config, seed=9)) if kind == "float" else \
        (lambda: _quantized(config, 9, group_size=32, bits=4))
    plain, joined = make(), make()
    assert join_projections(joined) == 2 * config["num_hidden_layers"]
    assert "qkv_proj" in joined.model.layers[0].self_attn and "q_proj" not in joined.model.layers[0].self_attn
    ids, pos = mx.array([[5, 9, 13, 2, 7, 1]]), mx.array([0, 3, 1, 4, 2, 5])
    # a wider matmul may sum in another order (OpenBLAS picks kernels by shape):
    # float32 rounding on logits of size ~20, not a different computation
    a, b = np.array(plain(ids, pos)), np.array(joined(ids, pos))
    assert np.allclose(a, b, atol=1e-4) and (a.argmax(-1) == b.argmax(-1)).all()
    from mlx.utils import tree_flatten

    named = hf_parameters(joined)
    for name, value in tree_flatten(plain.parameters()):
        assert np.array_equal(np.array(named[name]), np.array(value)), name
    assert set(named) == {n for n, _ in tree_flatten(plain.parameters())}


def test_projections_with_different_quantization_stay_apart():
    """A mixed recipe (v_proj at more bits) cannot share one quantized matmul."""
    import mlx.nn as nn

    config = random_config(vocab_size=128, hidden=128, intermediate=256, head_dim=32)
    model = random_model(config, seed=9)
    nn.quantize(model, class_predicate=lambda path, m: (
        {"group_size": 32, "bits": 8} if path.endswith("v_proj") else
        {"group_size": 32, "bits": 4} if isinstance(m, nn.Linear) else False))
    assert join_projections(model) == config["num_hidden_layers"]  # only gate/up joined
    assert "q_proj" in model.model.layers[0].self_attn and "gate_up_proj" in model.model.layers[0].mlp


def test_load_keeps_the_projections_apart_on_request():
    """``join_projections=False`` keeps q/k/v and gate/up separate (adapters need
    them); ``fuse=False``, the old spelling, still does the same."""
    attn = lambda model: model.model.layers[0].self_attn  # noqa: E731
    assert "qkv_proj" in attn(load(dtype="float32")[0])
    for kwargs in ({"join_projections": False}, {"fuse": False}):
        model, _ = load(dtype="float32", **kwargs)
        assert "q_proj" in attn(model) and "qkv_proj" not in attn(model), kwargs


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("queries", [1, 5, 16])
def test_cpu_attention_matches_the_mlx_kernel(heads, kv_heads, queries, set_paths):
    """The grouped CPU attention (queries pre-scaled) computes what mx.fast's attention computes."""
    from refusion_mlx.models.cpu_paths import attend, grouped_mask

    set_paths("cpu")

    keys, D = 23, 16
    mx.random.seed(queries)
    q = mx.random.normal((1, heads, queries, D))
    k, v = mx.random.normal((1, kv_heads, keys, D)), mx.random.normal((1, kv_heads, keys, D))
    rng = np.random.default_rng(queries)
    block = rng.random((queries, keys)) < 0.5
    block[:, 0] = True  # every query sees at least one key
    for mask in ("causal", mx.array(block)):
        expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)
        got = attend(q * D ** -0.5, k, v, grouped_mask(mask, queries, keys, heads, kv_heads, mx.float32))
        assert np.allclose(np.array(got), np.array(expected), atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("queries", [1, 3, 16])
def test_unfused_gpu_attention_matches_the_mlx_kernel(heads, kv_heads, queries):
    """The GPU paths' unfused attention (CUDA's choice for several query rows)
    takes the fused kernel's masks as they are -- none, "causal", (T, L),
    (B, 1, T, L) -- and computes what the kernel computes."""
    from refusion_mlx.models.cpu_paths import unfused_attend

    keys, D, B = 23, 16, 3
    mx.random.seed(queries)
    q = mx.random.normal((B, heads, queries, D))
    k, v = mx.random.normal((B, kv_heads, keys, D)), mx.random.normal((B, kv_heads, keys, D))
    rng = np.random.default_rng(queries)
    block = rng.random((B, 1, queries, keys)) < 0.5
    block[..., 0] = True
    for mask in (None, "causal", mx.array(block[0, 0]), mx.array(block)):
        expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)
        got = unfused_attend(q * D ** -0.5, k, v, mask)
        assert got.shape == expected.shape
        assert np.allclose(np.array(got), np.array(expected), atol=1e-5)
    half = unfused_attend((q * D ** -0.5).astype(mx.bfloat16), k.astype(mx.bfloat16), v.astype(mx.bfloat16),
                          "causal")
    assert half.dtype == mx.bfloat16
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask="causal")
    assert np.allclose(np.array(half.astype(mx.float32)), np.array(expected), atol=5e-2)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rms_norm_matches_mlx(dtype):
    from refusion_mlx.models.cpu_paths import rms_norm

    x = (mx.random.normal((3, 5, 4, 16)) * 3).astype(dtype)
    w = mx.random.normal((16,)).astype(dtype)
    expected = np.array(mx.fast.rms_norm(x, w, 1e-6).astype(mx.float32))
    assert np.allclose(np.array(rms_norm(x, w, 1e-6).astype(mx.float32)), expected,
                       atol=1e-5 if dtype == mx.float32 else 3e-2)
    per_head = mx.random.normal((4, 16)).astype(dtype)  # one weight row per head
    expected = np.array((mx.fast.rms_norm(x, None, 1e-6) * per_head).astype(mx.float32))
    assert np.allclose(np.array(rms_norm(x, per_head, 1e-6).astype(mx.float32)), expected,
                       atol=1e-5 if dtype == mx.float32 else 3e-2)


def test_rms_norm_gradient_matches_mlx():
    """The CPU paths' norm (inverse RMS per row, then the scaling) trains as
    MLX's fused one does: same gradients for the input and the weight."""
    from refusion_mlx.models.cpu_paths import rms_norm

    x, w = mx.random.normal((6, 32)) * 2, mx.random.normal((32,))
    cotangent = mx.random.normal((6, 32))
    ours = mx.grad(lambda x, w: mx.sum(rms_norm(x, w, 1e-6) * cotangent), argnums=(0, 1))(x, w)
    fused = mx.grad(lambda x, w: mx.sum(mx.fast.rms_norm(x, w, 1e-6) * cotangent), argnums=(0, 1))(x, w)
    for a, b in zip(ours, fused):
        assert np.allclose(np.array(a), np.array(b), atol=1e-4)


def test_weights_replaced_after_a_forward_are_used():
    """Arrays made once from the weights (transposed views, the q/k norm rows)
    follow load_weights: nothing stale survives a weight update."""
    from mlx.utils import tree_flatten

    config = random_config()
    model, other = random_model(config, seed=1), random_model(config, seed=2)
    ids, pos = mx.array([[5, 9, 13, 2]]), mx.array([0, 2, 1, 3])
    first = np.array(model(ids, pos))
    new = [(n, v * 1.5 if n.endswith("norm.weight") else v) for n, v in tree_flatten(other.parameters())]
    other.load_weights(new)
    model.load_weights(new)
    assert not np.allclose(np.array(model(ids, pos)), first)
    assert np.array_equal(np.array(model(ids, pos)), np.array(other(ids, pos)))


def test_cpu_kernels_match_mlx_and_differentiate():
    """The CPU exp and what uses it: within 2e-6 of MLX's, gradients too (training)."""
    from refusion_mlx.models import kernels

    x = mx.random.normal((6, 40), key=mx.random.key(0)) * 8
    for ours, ref in [(kernels.exp, mx.exp), (kernels.softmax, lambda v: mx.softmax(v, axis=-1)),
                      (kernels.logsumexp, lambda v: mx.logsumexp(v, axis=-1)),
                      (lambda v: kernels.silu_gate(v, v), lambda v: v * mx.sigmoid(v) * v)]:
        a, b = np.array(ours(x)), np.array(ref(x))
        assert np.allclose(a, b, rtol=2e-6, atol=1e-6)
        w = mx.random.normal(a.shape, key=mx.random.key(1))
        ga = np.array(mx.grad(lambda v: (ours(v) * w).sum())(x))
        gb = np.array(mx.grad(lambda v: (ref(v) * w).sum())(x))
        assert np.allclose(ga, gb, rtol=1e-4, atol=1e-4)
    # masked scores and anything below -87 give exactly 0, never a subnormal
    # (whose arithmetic is many times slower on Intel CPUs), and softmax rows
    # with masked entries hold no subnormal either
    low = np.array(kernels.exp(mx.array([-1000.0, -mx.inf, -87.5, -86.0])))
    assert low[0] == 0.0 and low[1] == 0.0 and low[2] == 0.0 and low[3] > 0
    scores = mx.concatenate([x[:, :20], mx.full((6, 20), -mx.inf)], axis=1)
    probs = np.array(kernels.softmax(scores))
    assert not ((probs != 0) & (np.abs(probs) < np.finfo(np.float32).tiny)).any()
    assert (probs[:, 20:] == 0).all()


def test_cpu_kernels_backward_keeps_no_more_than_mlxs_own(set_paths):
    """Training on the CPU paths: a backward pass through the SwiGLU and the softmax kept every intermediate
    of exp's polynomial (a LoRA run's peak doubled); each kernel states its gradient, so it keeps what MLX's
    own kernels keep, give or take the polynomial's buffers while it runs (SwiGLU 1.6x MLX's, 5x before;
    softmax 2.5x, 7x before)."""
    import mlx.nn as nn

    from refusion_mlx.models import kernels

    set_paths("cpu")
    x = mx.random.normal((64, 128, 256), key=mx.random.key(0))  # 8 MiB
    w = mx.random.normal(x.shape, key=mx.random.key(1))
    mx.eval(x, w)

    def peak(f) -> int:
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        mx.eval(mx.grad(lambda v: (f(v) * w).sum())(x))
        return mx.get_peak_memory()

    assert peak(lambda v: kernels.silu_gate(v, w)) <= 2 * peak(lambda v: nn.silu(v) * w)  # 5x before
    assert peak(kernels.softmax) <= 3 * peak(lambda v: mx.softmax(v, axis=-1, precise=True))


def test_kernels_compiled_per_shape_keep_a_bounded_number_of_traces():
    """MLX keeps a compiled function's traces, one per input shape, as long as it lives: attention scores
    take a new shape at almost every pass, so a server's grew without end (850 MB after 20,000 shapes)."""
    from refusion_mlx.models import kernels

    f = kernels.PerShape(lambda v: (v * 2.0 + 1.0), limit=8)
    first = f.compiled
    for n in range(1, 12):
        assert np.array_equal(np.array(f(mx.ones((2, n)))), np.full((2, n), 3.0))
    assert f.compiled is not first and len(f.shapes) == 3  # made afresh at the ninth shape
    f(mx.ones((2, 11)))  # a shape it holds: no new trace
    assert len(f.shapes) == 3
    from refusion_mlx.models import rope

    assert kernels.exp.limit == 256 and isinstance(kernels._swiglu_fused, kernels.PerShape)
    assert isinstance(rope.rotate_halves, kernels.PerShape)
