"""Model factories. Everything here is built from configs in memory: no downloads."""

import pytest
import torch

from kvpaging.models import (
    TINY_ARCHS,
    available_configs,
    default_cpu_dtype,
    load_config,
    load_model,
    load_tokenizer,
    real_shaped,
    tiny,
)


def weights(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def same_weights(a, b):
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@torch.no_grad()
def greedy_tokens(model, prompt, num_tokens):
    """Plain greedy decoding without a KV cache: the reference the engine must match."""
    ids = prompt
    for _ in range(num_tokens):
        next_token = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_token], dim=1)
    return ids[0, prompt.shape[1] :].tolist()


# --------------------------------------------------------------------------- tiny


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_each_tiny_arch_builds_and_writes_varied_tokens(arch):
    model = tiny(arch)
    config = model.config
    assert config.model_type == arch
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (4096, 256, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 32)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    assert config._attn_implementation == "sdpa"
    assert getattr(config, "sliding_window", None) is None
    assert not model.training
    assert model.model.layers[0].self_attn.head_dim == 32  # the modules agree with the config

    prompt = torch.randint(3, 4096, (1, 8), generator=torch.Generator().manual_seed(0))
    tokens = greedy_tokens(model, prompt, 32)
    assert len(set(tokens)) >= 8, f"greedy decoding collapsed: {tokens}"


def test_same_seed_same_weights_other_seed_other_weights():
    assert same_weights(tiny("llama", seed=3), tiny("llama", seed=3))
    assert not same_weights(tiny("llama", seed=3), tiny("llama", seed=4))


def test_building_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    tiny("qwen3")
    assert torch.equal(torch.rand(4), expected)


def test_overrides_apply_and_typos_are_refused():
    model = tiny("qwen3", num_hidden_layers=2, vocab_size=512, dtype=torch.bfloat16, tie_word_embeddings=True)
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    assert model.lm_head.weight.shape == (512, 256)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="num_layers"):
        tiny("qwen3", num_layers=2)
    with pytest.raises(ValueError, match="qwen3"):
        tiny("gpt5")


# --------------------------------------------------------------------------- real-shaped


def test_shipped_configs_have_the_published_numbers():
    assert {"Qwen3-0.6B", "Qwen3-8B", "Llama-3.1-8B"} <= set(available_configs())
    c = load_config("Qwen3-0.6B")
    assert c.model_type == "qwen3"
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (28, 16, 8)
    assert (c.head_dim, c.hidden_size, c.intermediate_size, c.vocab_size) == (128, 1024, 3072, 151936)
    assert c.tie_word_embeddings and c.rms_norm_eps == 1e-6
    c = load_config("Qwen3-8B")
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (36, 4096, 32, 8)
    assert not c.tie_word_embeddings
    c = load_config("Llama-3.1-8B")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (32, 4096, 14336, 128256)
    assert c.rope_parameters["rope_type"] == "llama3" and c.rope_parameters["rope_theta"] == 500000.0
    for name in available_configs():
        config = load_config(name)
        assert config.head_dim * config.num_attention_heads > 0  # every shape spells out head_dim


@pytest.mark.parametrize("name, billions", [("Qwen3-0.6B", 0.596), ("Qwen3-8B", 8.19), ("Llama-3.1-8B", 8.03)])
def test_real_shaped_on_meta_has_the_published_size(name, billions):
    model = real_shaped(name, device="meta")
    assert model.lm_head.weight.device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)


def test_real_shaped_truncates_layers():
    model = real_shaped("Qwen3-0.6B", num_hidden_layers=1, device="meta")
    assert len(model.model.layers) == 1 and model.config.num_hidden_layers == 1
    assert model.dtype == torch.bfloat16
    assert model.config.hidden_size == 1024


def test_real_shaped_weights_use_the_config_std():
    model = real_shaped("Qwen2.5-0.5B", num_hidden_layers=1, device="cpu", dtype=torch.float32)
    assert model.model.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.model.layers[0].self_attn.q_proj.bias.abs().max().item() == 0.0


def test_unknown_config_lists_the_available_ones():
    with pytest.raises(ValueError, match="Qwen3-8B"):
        load_config("Qwen9-1T")
    with pytest.raises(ValueError, match="Qwen3-0.6B"):
        real_shaped("nope", device="meta")


# --------------------------------------------------------------------------- loading


def test_load_model_round_trips_through_safetensors(tmp_path):
    model = tiny("llama", num_hidden_layers=2)
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path, dtype=torch.float32)
    assert same_weights(model, loaded)
    assert not loaded.training
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits)
    assert load_model(tmp_path, dtype=torch.bfloat16, device="cpu").dtype == torch.bfloat16


def _cpuinfo(tmp_path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx2 {flags}\n")
    return str(path)


def test_the_cpus_default_dtype_follows_its_bfloat16_units(tmp_path):
    assert default_cpu_dtype(_cpuinfo(tmp_path, "avx512f amx_bf16 amx_tile")) == torch.bfloat16
    assert default_cpu_dtype(_cpuinfo(tmp_path, "avx512f avx512_bf16")) == torch.bfloat16
    assert default_cpu_dtype(_cpuinfo(tmp_path, "avx512f")) == torch.float32
    assert default_cpu_dtype(str(tmp_path / "no-such-file")) == torch.float32  # not Linux: no flags to read


@pytest.mark.parametrize("units", [True, False])
def test_a_checkpoint_loads_on_the_cpu_in_the_dtype_its_units_want(tmp_path, monkeypatch, caplog, units):
    """A folder (or hub id) loaded with no dtype: bfloat16 where the CPU has bfloat16 matrix units, float32
    elsewhere, even for a bfloat16 checkpoint, and the log says which and why; an explicit dtype wins."""
    import kvpaging.models as models

    flags = "avx512_bf16" if units else "avx2"
    monkeypatch.setattr(models, "bf16_matrix_units", lambda cpuinfo=None: "AVX-512 BF16" if units else None)
    tiny("llama", num_hidden_layers=1).to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    with caplog.at_level("INFO", logger="kvpaging.models"):
        loaded = load_model(tmp_path)
    assert loaded.dtype == (torch.bfloat16 if units else torch.float32), flags
    assert ("has bfloat16 matrix units" if units else "has no bfloat16 matrix units") in caplog.text
    assert load_model(tmp_path, dtype=torch.float32).dtype == torch.float32
    model = tiny("llama", num_hidden_layers=1)
    assert load_model(model) is model and model.dtype == torch.float32  # a model object keeps its dtype


def test_load_model_refuses_pickles(tmp_path):
    model = tiny("llama", num_hidden_layers=1)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)


def test_load_model_passes_instances_through_and_refuses_missing_paths(tmp_path):
    model = tiny("qwen3", num_hidden_layers=1)
    assert load_model(model) is model
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "missing")


def test_load_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny("qwen3", num_hidden_layers=1)
    assert load_tokenizer(model) is None  # built in memory: nothing to load
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert load_tokenizer(tmp_path) is None  # weights but no tokenizer files
    assert load_tokenizer(tmp_path / "gone") is None

    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path)("hello world")["input_ids"] == [1, 2]
    assert load_tokenizer(load_model(tmp_path))("world")["input_ids"] == [2]
