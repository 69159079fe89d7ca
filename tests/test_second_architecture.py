"""A second architecture, Llama (``models/llama.py`` and one line of
``models/registry.py``), takes every path a ReFusion checkpoint takes:
loaded from a Hugging Face folder and from a converted one (plain and
quantized), logits as transformers' ``LlamaForCausalLM`` gives them at
shuffled position ids, decode passes through the committed cache equal to
plain passes, decoded alone, batched and on both device paths with the same
tokens, split by the sharding code, and fine-tuned."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from refusion_mlx.convert import convert
from refusion_mlx.decode.batch import batch_generate
from refusion_mlx.decode.cache import CommittedCache
from refusion_mlx.decode.decoder import RefusionDecoder
from refusion_mlx.decode.params import RefusionParams
from refusion_mlx.errors import ConfigError
from refusion_mlx.models import llama, registry, sharding
from refusion_mlx.models.loading import load

from tests.helpers import FIXTURE_MODEL, decode_hidden, random_model, write_checkpoint

DATA = Path(__file__).parent / "fixtures" / "train-data"

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 128, "vocab_size": 806, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "hidden_act": "silu", "torch_dtype": "float32", "mask_token_id": 805,
}
# the first setting commits after verification, the second infills: both steps of REFUSION.md §4
PARAMS = [RefusionParams(gen_length=16, slot_size=4, serial_num_blocks=2, slot_threshold=0.6, token_threshold=0.0),
          RefusionParams(gen_length=24, slot_size=4, serial_num_blocks=1, slot_threshold=0.9, token_threshold=0.9)]
PROMPTS = [[801, 17, 90, 233, 4, 12], [5, 9, 13, 2, 7, 1, 44, 300, 12]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Hugging Face folder of a random Llama with peaky outputs, the fixture's tokenizer."""
    model = random_model(CONFIG, seed=7, scale=2.0, layer_std=0.3)
    return write_checkpoint(model, tmp_path_factory.mktemp("llama") / "hf", CONFIG, tokenizer_from=FIXTURE_MODEL)


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory):
    return convert(checkpoint, tmp_path_factory.mktemp("llama") / "mlx", progress=False).path


def test_the_registry_chooses_the_family_by_model_type():
    assert registry.family("llama") is llama
    assert type(registry.family_args(CONFIG)) is llama.ModelArgs
    assert type(registry.build(registry.family_args(CONFIG))) is llama.Model
    with pytest.raises(ConfigError, match=r"model_type is 'gpt2'.*\(known: llama, qwen3\)"):
        registry.family_args({**CONFIG, "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="rope_scaling type 'llama3' is not supported"):
        registry.family_args({**CONFIG, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_logits_match_transformers_from_both_folders(checkpoint, converted):
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    hf.eval()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CONFIG["vocab_size"], size=24)
    pos = rng.permutation(40)[:24]  # ReFusion's order: positions are not sequence indices
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)[None], position_ids=torch.tensor(pos)[None]).logits[0].numpy()
    for folder in (checkpoint, converted):
        model, _ = load(folder, dtype="float32")
        assert type(model) is llama.Model and model.args.mask_token_id == 805
        out = np.array(model(mx.array(ids)[None], mx.array(pos)))[0]
        assert np.abs(out - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())


def test_the_converted_folder_loads_in_mlx_lm(converted):
    from mlx_lm.utils import load_model as ar_load_model

    ours, _ = load(converted, dtype="float32")
    theirs, _ = ar_load_model(converted)
    tokens = mx.array([[10, 11, 12, 13, 14]])
    np.testing.assert_allclose(np.array(theirs(tokens)), np.array(ours(tokens, mx.arange(5))), atol=1e-4)


def test_a_quantized_conversion_plans_and_loads(checkpoint, tmp_path):
    out = convert(checkpoint, tmp_path / "q8", quantize=True, q_bits=8, q_group_size=32, progress=False)
    assert out.quantization["bits"] == 8
    model, _ = load(out.path, dtype="float32")
    plain, _ = load(checkpoint, dtype="float32")
    ids, pos = mx.array([[5, 9, 13, 2, 7, 1, 44, 300]]), mx.arange(8)
    top = [np.array(m(ids, pos).argmax(-1)) for m in (model, plain)]
    assert (top[0] == top[1]).mean() >= 0.75


def test_decode_passes_through_the_cache_equal_plain_passes(checkpoint):
    """The runner's cached and infill passes (decode/runner.py) give this
    architecture's plain-pass logits: committed K/V reused, each slot seeing
    the committed rows and itself only."""
    model, _ = load(checkpoint, dtype="float32")
    prompt, slots = [3, 1, 4, 1, 5, 9, 2], [[10, 11, 12, 13], [20, 21, 22, 23]]
    slot_pos = [[11, 12, 13, 14], [7, 8, 9, 10]]
    cache = CommittedCache.for_model(model)
    decode_hidden(model, mx.array(prompt), mx.arange(7), cache.extend(7))
    cache.commit(prompt, list(range(7)))
    flat = [t for s in slots for t in s]
    out = np.array(model.head(decode_hidden(model, mx.array(flat), mx.array(sum(slot_pos, [])),
                                            cache.infill(2, 4, 0))))[0].reshape(2, 4, -1)
    for i in range(2):
        alone = model(mx.array(prompt + slots[i])[None], mx.array(list(range(7)) + slot_pos[i]))
        np.testing.assert_allclose(out[i], np.array(alone)[0, 7:], atol=1e-4)


def decode_alone(model, tokenizer):
    answers, phases = [], set()
    for prompt, params in zip(PROMPTS, PARAMS):
        dec = RefusionDecoder(model, prompt, params, mask_id=model.args.mask_token_id, eos_id=tokenizer.eos_token_id)
        phases.update(step.phase for step in dec.steps())
        answers.append(dec.response())
    assert phases == {"verify", "infill"}
    return answers


def test_decodes_alone_batched_and_on_both_paths(converted, set_paths):
    by_paths = {}
    for paths in ("cpu", "gpu"):
        set_paths(paths)
        model, tokenizer = load(converted, dtype="float32")
        alone = decode_alone(model, tokenizer)
        batched = batch_generate(model, tokenizer, PROMPTS, PARAMS, max_batch=2)
        assert [r.output_ids for r in batched] == alone
        for answer, params in zip(alone, PARAMS):
            assert 1 <= len(answer) <= params.gen_length and tokenizer.eos_token_id not in answer[:-1]
        by_paths[paths] = alone
    assert by_paths["cpu"] == by_paths["gpu"]


def test_sharding_splits_it_over_a_group_of_one(checkpoint):
    """Tensor and pipeline parallelism find the projections and heads the
    family declares (``Model.tensor_parallel``); over one rank the logits stay."""
    group = mx.distributed.init()
    if group.size() != 1:
        pytest.skip("needs a process outside a distributed group")
    ids, pos = mx.array([[5, 9, 13, 2, 7]]), mx.array([0, 3, 1, 4, 2])
    whole, _ = load(checkpoint, dtype="float32", join_projections=False)
    expected = np.array(whole(ids, pos))
    for split in (sharding.shard, sharding.pipeline):
        model, _ = load(checkpoint, dtype="float32", join_projections=False)
        split(model, group)
        np.testing.assert_allclose(np.array(model(ids, pos)), expected, rtol=1e-5, atol=1e-4)
    tp, _ = load(checkpoint, dtype="float32", join_projections=False)
    sharding.shard(tp, group)
    assert type(tp.layers[0].self_attn.o_proj).__name__ == "_SumLinear" and tp.kv_heads == 2


def test_it_fine_tunes(converted, tmp_path):
    from refusion_mlx.train import fine_tune

    model, _, result = fine_tune(model=str(converted), data=str(DATA), adapter_path=str(tmp_path / "adapters"),
                                 iters=20, learning_rate=1e-3, batch_size=4, val_batches=2, steps_per_eval=20,
                                 steps_per_report=10, save_every=20, report=lambda _: None, progress=False)
    assert result.iterations == 20 and result.val_losses[-1] < result.val_losses[0]
    assert type(model.layers[0].self_attn.q_proj).__name__ == "LoRALinear"
    adapted, _ = load(converted, dtype="float32", adapter_path=tmp_path / "adapters")
    base, _ = load(converted, dtype="float32")
    ids, pos = mx.array([[5, 9, 13, 2]]), mx.arange(4)
    assert not np.allclose(np.array(adapted(ids, pos)), np.array(base(ids, pos)))


def test_the_parity_tool_checks_a_llama_conversion(checkpoint, tmp_path):
    """convert.parity runs the checkpoint's own architecture in transformers (it ran Qwen3's on a Llama: a
    correct conversion reported FAIL)."""
    from convert.parity import parity

    convert(checkpoint, tmp_path / "out", dtype="float32", progress=False)
    report = parity(checkpoint, tmp_path / "out", length=32, count=1)
    assert report["top1_agreement"] == 1.0 and report["max_abs_diff"] < 1e-3, report
