"""KV cache size math, checked against hand-computed numbers and real model configs."""

from types import SimpleNamespace

import pytest
import torch
import transformers

from kvpaging.core.kv_math import (
    dtype_nbytes,
    format_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    num_kv_cache_layers,
)


def article_config():
    """The article's worked example: 16 full-attention layers, 4 KV heads of dim 256."""
    return SimpleNamespace(
        num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=4, head_dim=256
    )


# Numbers from the published config.json files.
LLAMA_3_1_8B = dict(
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096
)  # no head_dim field: 4096 / 32 = 128
QWEN3_0_6B = dict(
    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, hidden_size=1024, head_dim=128
)  # head_dim 128, although 1024 / 16 = 64


# --- the article's example ---------------------------------------------------


def test_article_example_is_half_a_gib():
    # 2 (K and V) * 16 layers * 4 heads * 256 dims * 2 bytes = 65,536 bytes per token
    assert kv_bytes_per_token(article_config()) == 65_536
    assert kv_cache_bytes(article_config(), 8_192) == 536_870_912
    assert kv_cache_bytes(article_config(), 8_192) == 2**29  # exactly 0.5 GiB


def test_format_bytes_shows_both_units():
    assert format_bytes(536_870_912) == "536,870,912 bytes = 0.50 GiB = 0.54 GB"
    assert format_bytes(131_072) == "131,072 bytes = 128.00 KiB = 131.07 kB"
    assert format_bytes(3 * 2**40) == "3,298,534,883,328 bytes = 3.00 TiB = 3.30 TB"
    assert format_bytes(100) == "100 bytes"
    assert format_bytes(0) == "0 bytes"


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_format_bytes_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="num_bytes"):
        format_bytes(bad)


# --- real configs ------------------------------------------------------------


def test_llama_3_1_8b_derives_head_dim_from_hidden_size():
    assert kv_bytes_per_token(SimpleNamespace(**LLAMA_3_1_8B)) == 131_072
    assert kv_bytes_per_token(LLAMA_3_1_8B) == 131_072  # a plain dict works too
    assert kv_cache_bytes(LLAMA_3_1_8B, 8_192) == 1_073_741_824  # 1 GiB for 8K tokens


def test_qwen3_0_6b_reads_head_dim_first():
    assert kv_bytes_per_token(SimpleNamespace(**QWEN3_0_6B)) == 114_688
    # Ignoring head_dim would give 1024 / 16 = 64 and half the true size.
    without_head_dim = {**QWEN3_0_6B, "head_dim": None}
    assert kv_bytes_per_token(without_head_dim) == 57_344


def test_transformers_config_objects():
    llama = transformers.LlamaConfig(**LLAMA_3_1_8B)
    qwen3 = transformers.Qwen3Config(**QWEN3_0_6B)
    assert num_kv_cache_layers(llama) == 32
    assert num_kv_cache_layers(qwen3) == 28  # Qwen3Config lists 28 "full_attention" layer types
    assert kv_bytes_per_token(llama) == 131_072
    assert kv_bytes_per_token(qwen3) == 114_688


def test_transformers_nested_text_config():
    gemma3 = transformers.Gemma3Config(
        text_config=dict(
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            hidden_size=2560,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        )
    )
    assert num_kv_cache_layers(gemma3) == 1
    assert kv_bytes_per_token(gemma3) == 2 * 1 * 4 * 256 * 2


def test_transformers_hybrid_linear_attention_config():
    pattern = ["linear_attention"] * 3 + ["full_attention"]
    qwen3_next = transformers.Qwen3NextConfig(
        num_hidden_layers=8,
        layer_types=pattern * 2,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        hidden_size=2048,
    )
    assert num_kv_cache_layers(qwen3_next) == 2
    assert kv_bytes_per_token(qwen3_next) == 2 * 2 * 2 * 256 * 2


# --- config variants ---------------------------------------------------------


def test_hybrid_counts_only_full_attention_layers():
    config = SimpleNamespace(
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "linear_attention",
            "sliding_attention",
            "full_attention",
            "linear_attention",
        ],
    )
    assert num_kv_cache_layers(config) == 2
    assert kv_bytes_per_token(config) == 2 * 2 * 2 * 64 * 2


def test_no_full_attention_layer_means_no_growing_cache():
    config = SimpleNamespace(num_hidden_layers=2, layer_types=["linear_attention"] * 2)
    assert num_kv_cache_layers(config) == 0
    assert kv_bytes_per_token(config) == 0
    assert kv_cache_bytes(config, 1_000) == 0


def test_nested_text_config_is_used_when_top_level_has_no_layers():
    config = {"model_type": "some_vlm", "text_config": {**QWEN3_0_6B}}
    assert kv_bytes_per_token(config) == 114_688
    as_namespace = SimpleNamespace(text_config=SimpleNamespace(**LLAMA_3_1_8B), vision_config=None)
    assert kv_bytes_per_token(as_namespace) == 131_072


def test_multi_head_attention_default():
    # No num_key_value_heads (or None): every query head has its own K and V.
    gpt2_like = SimpleNamespace(num_hidden_layers=12, num_attention_heads=12, hidden_size=768)
    assert kv_bytes_per_token(gpt2_like) == 2 * 12 * 12 * 64 * 2 == 36_864
    gpt2_like.num_key_value_heads = None
    assert kv_bytes_per_token(gpt2_like) == 36_864


def test_zero_tokens_take_zero_bytes():
    assert kv_cache_bytes(article_config(), 0) == 0


# --- dtypes ------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, nbytes",
    [
        (torch.bfloat16, 2),
        (torch.float16, 2),
        (torch.float32, 4),
        (torch.float8_e4m3fn, 1),
        (torch.float8_e5m2, 1),
        ("bf16", 2),
        ("bfloat16", 2),
        ("fp16", 2),
        ("float16", 2),
        ("half", 2),
        ("fp32", 4),
        ("float32", 4),
        ("float", 4),
        ("fp8", 1),
        ("fp8_e4m3", 1),
        ("float8_e4m3fn", 1),
        ("fp8_e5m2", 1),
        ("BF16", 2),
    ],
)
def test_dtype_nbytes(dtype, nbytes):
    assert dtype_nbytes(dtype) == nbytes


def test_fp8_halves_bf16_and_fp32_doubles_it():
    bf16 = kv_cache_bytes(QWEN3_0_6B, 4_096)
    assert kv_cache_bytes(QWEN3_0_6B, 4_096, dtype="fp8") * 2 == bf16
    assert kv_cache_bytes(QWEN3_0_6B, 4_096, dtype=torch.float8_e5m2) * 2 == bf16
    assert kv_cache_bytes(QWEN3_0_6B, 4_096, dtype=torch.float32) == 2 * bf16


@pytest.mark.parametrize("bad", ["int4", "fp9", "", torch.int8, torch.float64, 2])
def test_unknown_dtype_is_rejected(bad):
    with pytest.raises(ValueError, match="dtype"):
        dtype_nbytes(bad)
    with pytest.raises(ValueError, match="dtype"):
        kv_bytes_per_token(article_config(), dtype=bad)


# --- bad input ---------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 1.0, 2.5, True, False, "8", None])
def test_bad_num_tokens(bad):
    with pytest.raises(ValueError, match="num_tokens"):
        kv_cache_bytes(article_config(), bad)


def test_negative_num_tokens_message_names_value():
    with pytest.raises(ValueError, match="num_tokens=-1"):
        kv_cache_bytes(article_config(), -1)


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_hidden_layers", None),
        ("num_hidden_layers", 0),
        ("num_hidden_layers", -2),
        ("num_hidden_layers", 1.5),
        ("num_key_value_heads", 0),
        ("num_key_value_heads", -4),
        ("head_dim", 0),
        ("head_dim", -128),
        ("head_dim", 64.0),
    ],
)
def test_bad_config_field_is_named(field, value):
    config = {**QWEN3_0_6B, field: value}
    with pytest.raises(ValueError, match=field):
        kv_bytes_per_token(config)


def test_missing_num_hidden_layers():
    config = {key: value for key, value in QWEN3_0_6B.items() if key != "num_hidden_layers"}
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_bytes_per_token(config)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        num_kv_cache_layers(SimpleNamespace())


def test_head_dim_that_does_not_divide():
    config = SimpleNamespace(num_hidden_layers=2, num_attention_heads=3, hidden_size=100)
    with pytest.raises(ValueError, match="hidden_size=100 is not divisible by num_attention_heads=3"):
        kv_bytes_per_token(config)


def test_missing_attention_heads_without_head_dim():
    config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, hidden_size=128)
    with pytest.raises(ValueError, match="num_attention_heads"):
        kv_bytes_per_token(config)


def test_layer_types_length_must_match_num_hidden_layers():
    config = {**QWEN3_0_6B, "layer_types": ["full_attention"] * 27}
    with pytest.raises(ValueError, match="layer_types lists 27 layers but num_hidden_layers=28"):
        num_kv_cache_layers(config)


def test_the_paged_cache_counts_sliding_layers_as_full_ones():
    """The engine keeps a sliding-window layer's blocks for the whole sequence (one block table for every
    layer), so its pool is sized per token with every layer: 2 (K and V) x 4 layers x 2 heads x 32 x 2 bytes."""
    from kvpaging.core.kv_math import kv_bytes_per_token, paged_kv_bytes_per_token

    config = SimpleNamespace(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                             hidden_size=256, sliding_window=6,
                             layer_types=["sliding_attention", "full_attention"] * 2)
    assert paged_kv_bytes_per_token(config, torch.bfloat16) == 2 * 4 * 2 * 32 * 2
    assert kv_bytes_per_token(config, torch.bfloat16) == 2 * 2 * 2 * 32 * 2  # the growing part: full layers only
