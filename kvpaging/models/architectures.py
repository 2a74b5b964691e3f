"""The architecture matrix: which causal LMs of the installed transformers kvpaging serves exactly.

kvpaging serves a transformers model by routing its attention through the paged
KV cache (transformers' ``AttentionInterface``). That works for a model whose
layers call attention the standard way and fails, more or less quietly, for one
that does something else: attention written inline, extra attention features
(sliding windows, soft-capping, sinks), key/value shapes of its own, recurrent
layers. The promise kvpaging makes is that every model gets one of two outcomes:

- EXACT: the engine's greedy tokens equal transformers' own ``generate()``;
- REFUSED: ``LLM(model)`` raises an error naming the reason, before serving anything.

Anything else is a bug: WRONG (different tokens and no error) or CRASH (any other
exception, while the engine is built or while it generates). This module checks
the promise for one model type at a time, on a tiny random-weight model built
offline from the type's config class:

    from kvpaging.models.architectures import causal_lm_types, check_architecture
    check_architecture("llama")   # {"default": Verdict(EXACT), "chunked_prefix": Verdict(EXACT)}

``benchmarks/architectures.py`` sweeps every type; ``tests/test_architectures.py``
checks a representative subset. A type that cannot even be built here (an optional
dependency missing, a config that cannot be made small) is SKIP, with the reason.

The tiny models keep every attention feature of the architecture's defaults:
the matrix is about what a user loading such a model would get. Only the sizes
are shrunk, under each config's own field names (``n_embd``, ``d_model``, ...).
"""

from __future__ import annotations

import dataclasses
import traceback
from dataclasses import dataclass, field

import torch

__all__ = ["causal_lm_types", "ArchitectureSkip", "tiny_model", "Verdict", "check_architecture", "MODES",
           "EXACT", "REFUSED", "WRONG", "CRASH", "SKIP", "VERDICTS", "PROMPT_LENGTH", "NUM_TOKENS"]

EXACT, REFUSED, WRONG, CRASH, SKIP = "EXACT", "REFUSED", "WRONG", "CRASH", "SKIP"
VERDICTS = (EXACT, REFUSED, WRONG, CRASH, SKIP)

MODES = ("default", "chunked_prefix")
PROMPT_LENGTH = 12
NUM_TOKENS = 8
TIE_TOLERANCE = 1e-4  # two float32 logits closer than this may be ordered either way (as in tests/)

# --------------------------------------------------------------------------- the model types


def causal_lm_types() -> list[str]:
    """Every model type the installed transformers can build as a causal LM, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class ArchitectureSkip(Exception):
    """This model type cannot be built here; ``reason`` says why (the exception and its message)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --------------------------------------------------------------------------- tiny configs

# The sizes of every tiny model, each under all the names configs use for it. A
# config gets a value for each of its fields that appears here (fields renamed by
# the config's ``attribute_map`` are looked up by their real name). The same
# table shrinks sub-configs: the text and vision configs of a multimodal model,
# MPT's and DBRX's attention and feed-forward configs.
SMALL = {
    "hidden": (64, ("hidden_size", "hidden_size_global", "n_embd", "d_model", "emb_dim", "embed_dim", "hidden_dim",
                    "n_embed", "dim")),
    "layers": (2, ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers")),
    "heads": (4, ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
                  "decoder_attention_heads", "encoder_attention_heads")),
    "kv_heads": (2, ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads", "multi_query_group_num")),
    "head_dim": (16, ("head_dim", "kv_channels", "attention_head_dim")),
    "intermediate": (128, ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "decoder_ffn_dim",
                           "encoder_ffn_dim", "d_ff")),
    "vocab": (512, ("vocab_size", "vocab_size_per_layer_input")),
    "per_layer_input": (16, ("hidden_size_per_layer_input",)),  # Gemma-3n/4's per-layer embeddings
    "positions": (512, ("max_position_embeddings", "n_positions", "max_seq_len", "context_length",
                        "model_max_length")),
    # mixture of experts: few, small experts
    "experts": (4, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
    "experts_per_token": (2, ("num_experts_per_tok", "moe_k", "moe_topk", "moe_top_k", "num_experts_per_token")),
    "expert_size": (64, ("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size")),
    "shared_experts": (1, ("n_shared_experts", "num_shared_experts")),
    "expert_groups": (1, ("n_group", "topk_group", "num_expert_group")),
    # multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...): small low-rank projections
    "kv_lora_rank": (32, ("kv_lora_rank",)),
    "rope_head_dim": (8, ("qk_rope_head_dim",)),
    "nope_head_dim": (8, ("qk_nope_head_dim",)),
    "v_head_dim": (16, ("v_head_dim",)),
    # partial rotary embeddings (GPT-J, CodeGen): half of each 16-wide head
    "rotary_dim": (8, ("rotary_dim",)),
    # DeepSeek-V3.2's sparse-attention indexer
    "indexer_heads": (4, ("index_n_heads",)),
    "indexer_head_dim": (16, ("index_head_dim",)),
    # sliding-window attention: a window shorter than the prompt (12 tokens) and the self-check's (13 and 21),
    # so that it changes which keys a query sees
    "sliding_window": (6, ("sliding_window",)),
    # random logits a few units apart, so greedy decoding has no near-ties (trained models use ~0.02)
    "init": (0.2, ("initializer_range", "init_std")),
    # token ids 0, 1, 2 are pad, bos and eos, inside the vocabulary
    "pad": (0, ("pad_token_id",)),
    "bos": (1, ("bos_token_id",)),
    "eos": (2, ("eos_token_id",)),
}

# Fields whose default is None ("this feature is off") stay None rather than taking a size above.
# (A None head_dim or expert count is usually "work it out" or "required", and gets the size.)
KEEP_IF_NONE = {"sliding_window", "kv_lora_rank", "rotary_dim", "moe_intermediate_size", "n_group", "topk_group", "n_inner",
                "shared_expert_intermediate_size", "num_kv_heads", "kv_channels", "attention_head_dim"}

# What some types need on top of (or instead of) the table above, one entry per reason. A dict value
# for a sub-config (``text_config``) is merged into that sub-config's shrunk fields.
_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
OVERRIDES: dict[str, dict] = {
    # GPT-Neo lists the attention type of every layer ("global", "local" alternating, 24 layers): one pair here.
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # Mamba-2 needs hidden_size * expand == num_heads * head_dim (64 * 1 == 4 * 16).
    "mamba2": {"expand": 1},
    # Dots3's attention has no grouped-query variant: as many key/value heads as query heads.
    "dots3_note_text": {"num_key_value_heads": 4},
    "dots3_note": {"text_config": {"num_key_value_heads": 4}},
    # Gemma-4's assistant (draft) model has no per-layer input embeddings.
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    "gemma4_unified_assistant": {"text_config": {"hidden_size_per_layer_input": 0}},
    # Hybrid models with one full-attention layer every 4th (linear attention in between): 4 layers hold one.
    "qwen3_next": {"num_hidden_layers": 4},
    "qwen3_5_text": {"num_hidden_layers": 4},
    "qwen3_5_moe_text": {"num_hidden_layers": 4},
    "qwen4_exp_text": {"num_hidden_layers": 4},
    "qwen3_5": {"text_config": {"num_hidden_layers": 4}},
    "qwen3_5_moe": {"text_config": {"num_hidden_layers": 4}},
    "qwen4_exp": {"text_config": {"num_hidden_layers": 4}},
    # RecurrentGemma's blocks go recurrent, recurrent, attention: 3 layers hold one attention layer.
    "recurrent_gemma": {"num_hidden_layers": 3},
    # Reformer's causal-LM head refuses a config that is not marked as a decoder.
    "reformer": {"is_decoder": True},
    # These configs' defaults leave the RoPE base unset (their default model cannot be built): the usual one.
    "ministral": {"rope_parameters": _DEFAULT_ROPE},
    "hunyuan_v1_dense": {"rope_parameters": _DEFAULT_ROPE},
    "hunyuan_v1_moe": {"rope_parameters": _DEFAULT_ROPE},
    # Jamba's attention layer is every 8th from the 4th and its MoE layers every 2nd from the 1st: with 2
    # layers that would be all Mamba; layer 1 is attention (and MoE) here, as in the real model's pattern.
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    # DeepSeek-V2/V3-style MoE: the first layer dense (as in the real models), the second MoE.
    "deepseek_v2": {"first_k_dense_replace": 1, "q_lora_rank": 32},
    "deepseek_v3": {"first_k_dense_replace": 1, "q_lora_rank": 32},
    # BLT hashes byte groups into a 500k-entry embedding table: a small one keeps the model tiny.
    "blt": {"encoder_hash_byte_group_vocab": 512},
    # MiniCPM3 has MLA with a query low-rank projection too.
    "minicpm3": {"q_lora_rank": 32},
    # Dory's own generate() fails with a window shorter than the prompt (a mask of the wrong width): a window of
    # 32 keeps it runnable, so its sliding layers are checked only where the window covers everything.
    "dory": {"sliding_window": 32},
    # LFM2 interleaves short convolutions with attention (its config's default, with no index list, is
    # attention everywhere): layer 0 a convolution, layer 1 attention, as in the released models.
    "lfm2": {"full_attn_idxs": [1]},
    "lfm2_moe": {"full_attn_idxs": [1]},
    # Mllama's text model has cross-attention layers (to the image) at 3, 8, ...: with 2 layers, at 1.
    "mllama": {"text_config": {"cross_attention_layers": [1]}},
}


def _config_class(model_type: str):
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except Exception as exc:  # a lazily imported module may be missing an optional dependency
        raise ArchitectureSkip(f"no config class: {type(exc).__name__}: {_first_line(exc)}") from exc


def _small_fields(config_class, extra: dict | None = None) -> dict:
    """The keyword arguments that shrink ``config_class``: the table above, in its own field names.

    Sub-configs (``text_config``, ``vision_config``, ...) are shrunk the same way and passed as dicts.
    """
    declared = {}  # field name -> its declared default
    if dataclasses.is_dataclass(config_class):
        declared = {f.name: f.default for f in dataclasses.fields(config_class)}
    aliases = dict(getattr(config_class, "attribute_map", {}) or {})
    fields = {}
    for value, candidates in SMALL.values():
        for name in candidates:
            real = aliases.get(name, name)
            if real not in declared or real in fields or (real in KEEP_IF_NONE and declared[real] is None):
                continue  # not a field of this config, already set under another name, or a feature left off
            fields[real] = value
    if "kv_lora_rank" in declared and "num_key_value_heads" in fields:
        # latent attention (MLA) expands its latent into one key and value per query head, as the real models do
        fields["num_key_value_heads"] = fields.get("num_attention_heads", fields["num_key_value_heads"])
    for name, spec in (getattr(config_class, "sub_configs_defaults", None) or {}).items():
        if name in declared:
            fields[name] = _small_sub_config(spec)
    for name, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(fields.get(name), dict):
            fields[name] = {**fields[name], **value}
        else:
            fields[name] = value
    return fields


def _small_sub_config(spec) -> dict:
    """A shrunk sub-config, as the dict a composite config accepts (``spec``: its ``SubConfigSpec``)."""
    from transformers import CONFIG_MAPPING, PreTrainedConfig

    if isinstance(spec.config_class, type) and issubclass(spec.config_class, PreTrainedConfig):
        return {**spec.init_kwargs, **_small_fields(spec.config_class)}
    # an AutoConfig slot (a vision tower of some other model type): name the type in the dict
    return {**spec.init_kwargs, **_small_fields(CONFIG_MAPPING[spec.model_type]), "model_type": spec.model_type}


def tiny_config(model_type: str, **overrides):
    """The type's config with every size small and every attention feature at its default (or ``overrides``)."""
    config_class = _config_class(model_type)
    try:
        return config_class(**_small_fields(config_class, {**OVERRIDES.get(model_type, {}), **overrides}))
    except Exception as exc:
        raise ArchitectureSkip(f"config: {type(exc).__name__}: {_first_line(exc)}") from exc


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """A tiny float32 causal LM of ``model_type`` with seeded random weights, on the CPU, in eval mode.

    transformers initialises the weights its own way (with ``initializer_range`` 0.2), from
    ``torch.manual_seed(seed)`` inside ``fork_rng``: the same seed gives the same model, and the
    caller's global random state is left as it was. Raises ``ArchitectureSkip`` when the type
    cannot be built here.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except Exception as exc:
            raise ArchitectureSkip(f"model: {type(exc).__name__}: {_first_line(exc)}") from exc
    return model.eval()


# --------------------------------------------------------------------------- checking one type


@dataclass
class Verdict:
    """What happened to one model type in one mode. ``detail`` is one line for a table."""

    verdict: str  # one of VERDICTS
    detail: str = ""
    cause: str | None = None  # REFUSED: UnsupportedModelError.cause
    error_class: str | None = None  # REFUSED / CRASH: the exception's class
    stage: str | None = None  # CRASH: "construction" or "generation"
    position: int | None = None  # WRONG: first differing token
    expected: list[int] = field(default_factory=list)  # transformers' tokens
    got: list[int] = field(default_factory=list)  # the engine's tokens

    @property
    def ok(self) -> bool:
        """True for the two outcomes kvpaging promises (SKIP is neither ok nor a failure)."""
        return self.verdict in (EXACT, REFUSED)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# How the engine runs in each mode. "chunked_prefix": the 12-token prompt is prefilled 5 tokens at a time
# into blocks of 4, then served again, when its first blocks come from the prefix cache (max_model_len 128: a
# model with a table per layer group needs the blocks of a whole sequence in its full group, and the window's in
# its sliding one, out of the same 64).
MODE_SETTINGS = {
    "default": {"block_size": 16, "num_blocks": 64, "max_model_len": 256},
    "chunked_prefix": {"block_size": 4, "num_blocks": 64, "max_model_len": 128, "max_num_batched_tokens": 5,
                       "enable_prefix_caching": True},
}
MODE_RUNS = {"default": 1, "chunked_prefix": 2}


def prompt_ids(vocab_size: int, length: int = PROMPT_LENGTH, seed: int = 0) -> list[int]:
    """A fixed prompt of ordinary tokens (never pad, bos or eos: ids 0 to 2)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=generator).tolist()


def reference_tokens(model, prompt: list[int], num_tokens: int = NUM_TOKENS) -> list[int]:
    """transformers' own greedy continuation of ``prompt`` (batch 1, no padding).

    The model's end token is removed for the reference, so generate() writes exactly
    ``num_tokens`` and may pick the eos id as greedily as the engine with ignore_eos.
    """
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=num_tokens,
                             min_new_tokens=num_tokens, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    if len(tokens) != num_tokens:
        raise RuntimeError(f"generate() gave {len(tokens)} tokens, asked for {num_tokens}")
    return tokens


def check_architecture(model_type: str, modes=MODES, seed: int = 0) -> dict[str, Verdict]:
    """The verdict for ``model_type`` in each of ``modes`` (see MODE_SETTINGS). Never raises."""
    try:
        model = tiny_model(model_type, seed=seed)
    except ArchitectureSkip as skip:
        return {mode: Verdict(SKIP, skip.reason) for mode in modes}
    vocab_size = _vocab_size(model)
    prompt = prompt_ids(vocab_size)
    try:
        expected = reference_tokens(model, prompt)
    except Exception as exc:  # transformers itself cannot generate with it: nothing to compare against
        return {mode: Verdict(SKIP, f"generate(): {type(exc).__name__}: {_first_line(exc)}") for mode in modes}
    return {mode: _check_mode(model, prompt, expected, mode) for mode in modes}


def _check_mode(model, prompt: list[int], expected: list[int], mode: str) -> Verdict:
    from kvpaging.entrypoints.llm import LLM
    from kvpaging.errors import UnsupportedModelError
    from kvpaging.sampling_params import SamplingParams

    try:
        llm = LLM(model, **MODE_SETTINGS[mode])
    except UnsupportedModelError as exc:  # the one way kvpaging refuses a model: it names the cause
        return Verdict(REFUSED, f"{exc.cause}: {_first_line(exc)}", cause=exc.cause, error_class=type(exc).__name__)
    except Exception as exc:  # anything else (a plain ValueError included) is a crash
        return _crash(exc, "construction")

    params = SamplingParams(max_tokens=len(expected), temperature=0.0, ignore_eos=True)
    details = []
    for run in range(MODE_RUNS[mode]):
        try:
            outputs = llm.generate([prompt], params, use_tqdm=False)
        except Exception as exc:
            return _crash(exc, "generation", f"run {run + 1}: ")
        got = list(outputs[0].outputs[0].token_ids)
        if got != expected:
            tie = _tie_note(model, prompt, got, expected)
            if tie is None:
                position = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                                min(len(got), len(expected)))
                return Verdict(WRONG, f"run {run + 1}: token {position} differs: engine {got} vs generate() "
                               f"{expected}", position=position, expected=expected, got=got)
            details.append(f"run {run + 1}: {tie}")
    if mode == "chunked_prefix":
        stats = llm.engine.block_manager.stats()
        slots = llm.engine.runner.state_slots
        if slots is not None:  # a hybrid model: prefix caching is off (a cached block holds no recurrent state)
            n = len(slots.layers)
            details.append(f"{n} state layer{'s' * (n != 1)}, a slot per sequence; prefix caching off")
        else:
            details.append(f"prefix hits {stats.prefix_hit_tokens} tokens")
        if stats.num_passed_blocks:  # a window on every layer: blocks it passed went back to the pool
            details.append(f"{stats.num_passed_blocks} blocks passed by the window")
    return Verdict(EXACT, "; ".join(details), expected=expected, got=expected)


def _tie_note(model, prompt, got, expected) -> str | None:
    """A note when the first difference is at a genuine tie (the top-2 logits within TIE_TOLERANCE and the
    engine's token one of them): both answers are then right, as in tests/. None otherwise."""
    position = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if position is None or len(got) != len(expected):
        return None
    try:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + expected[:position]])).logits[0, -1].float()
    except Exception:
        return None
    top2 = torch.topk(logits, 2)
    gap = (top2.values[0] - top2.values[1]).item()
    if gap < TIE_TOLERANCE and got[position] in top2.indices.tolist():
        return f"tie at token {position} (top-2 gap {gap:.2g})"
    return None


def _crash(exc: BaseException, stage: str, prefix: str = "") -> Verdict:
    # RequestFailedError carries the real failure as its cause: name that one
    cause = exc.__cause__ if exc.__cause__ is not None and stage == "generation" else None
    text = f"{type(exc).__name__}: {_first_line(exc)}"
    if cause is not None:
        text += f" <- {type(cause).__name__}: {_first_line(cause)}"
        where = traceback.extract_tb(cause.__traceback__)
        if where:
            text += f" [{where[-1].filename.rsplit('/', 1)[-1]}:{where[-1].lineno}]"
    return Verdict(CRASH, f"{stage}: {prefix}{text}", error_class=type(exc).__name__, stage=stage)


def _vocab_size(model) -> int:
    embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embeddings is not None and getattr(embeddings, "out_features", None):
        return min(embeddings.out_features, 512)
    return 512


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
