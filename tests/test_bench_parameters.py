"""The bench's parameter count is the model's logical one: a quantized weight's
packed uint32 elements unpacked, its scales and biases left out, as the converter counts."""

import mlx.nn as nn

from refusion_mlx.bench.report import header_lines, model_shape
from refusion_mlx.models.loading import load


def test_a_quantized_model_counts_its_logical_parameters():
    model, _ = load(None)
    dense = model_shape(model)
    assert dense["parameters"] == 3566336 and not dense["quantized"]
    for bits in (4, 8):
        q, _ = load(None)
        nn.quantize(q, group_size=32, bits=bits)
        shape = model_shape(q)
        assert shape["quantized"] and shape["parameters"] == dense["parameters"], bits
    env = {"model": "demo", "model_shape": shape, "blas": "x", "dtype": "float32", "device": "cpu", "mlx": "x",
           "mlx_lm": "x", "refusion_mlx": "x", "python": "3"}
    assert "; 3.57M parameters, quantized)" in header_lines(env)[0]
