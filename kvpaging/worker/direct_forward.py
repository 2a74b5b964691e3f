"""A Llama-structured model's forward pass with its layers' own ``forward`` functions called straight (CPU).

transformers' forward pass goes through an ``nn.Module`` call for every decoder layer, attention, MLP, norm and
linear (each looks up hooks), passes its keyword arguments down through decorators, finds the attention function by
name at every layer, and applies the rotary embedding in the ``[batch, heads, tokens, dim]`` layout the attention
interface wants, six tensor operations per tensor. On a CPU, where a decode step of the trained model takes tens of
milliseconds, that is 7-14% of the step (``benchmarks/module_overhead.py`` measures it on the trained model).
``DirectForward`` computes the same
step with the same tensor operations in the same order, calling each layer's own ``forward`` (the engine's fast
layers' where they have one) one after the other. The rotary embedding runs on the projections' own
``[tokens, heads, dim]`` views (elementwise: the same numbers), in one C pass per tensor where the CPU kernels are
built (``kernels/cpu/rotary.c``: each product and the sum rounded where torch rounds them; transformers' own
``apply_rotary_pos_emb`` otherwise), and each residual connection with the norm after it in one C call where that
norm is the engine's C RMSNorm (``add_rms_norm``: the sum rounded as torch rounds it, then the norm's own arithmetic,
its mean in torch's order of sums), and in bfloat16 each MLP's SiLU and the product after it in one C pass
(``silu_mul``: the SiLU from a table torch computed for every bfloat16 number, the product rounded as torch rounds
it). The logits are the model's own to the bit:
the runner checks that on two probe steps (a prompt chunk, then a decode) before it uses the path, and runs the
model's own forward otherwise, and for any step before which a hook was added, a ``forward`` replaced or a module
swapped on its copy of the model, or another function registered under kvpaging's attention name
(``DirectForward.still_exact``).

Only for a model whose every module is of the class transformers' Llama code defines (LlamaForCausalLM and its
parts: SmolLM2, Llama and the many checkpoints of that architecture), with no hook on any module and no ``forward``
replaced but the engine's own fast layers', on the CPU, without tensor parallelism, and only where the engine's
fast layers are on (``cpu_fast_layers=False`` runs the model's own layers and forward, what ``generate()`` runs).
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import torch
from transformers.activations import SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpaging.kernels.cpu import add_rms_norm_unchecked, available, rotary_pair_unchecked, silu_mul_unchecked, silu_table
from kvpaging.kernels.cpu.layers import has_fast_path, is_c_rms_norm
from kvpaging.worker.attention import ATTN_NAME, AttentionMetadata, paged_attention_forward
from kvpaging.worker.self_check import step_output

logger = logging.getLogger("kvpaging")

__all__ = ["DirectForward", "direct_forward_if_exact", "direct_forward_refusal", "agrees_with_own_forward"]

# the classes a module of the model may have, by name within transformers' Llama code (and torch's)
_LLAMA_CLASSES = {"LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm",
                  "LlamaRotaryEmbedding"}
_LLAMA_MODULE = "transformers.models.llama.modeling_llama"
_TORCH_CLASSES = (torch.nn.Linear, torch.nn.Embedding, torch.nn.ModuleList)
_ROTARY_DTYPES = (torch.float32, torch.bfloat16)
PROBE_TOKENS = 25  # the probe steps' sequence: a 24-token chunk, then a decode


class DirectForward:
    """``model(input_ids=..., position_ids=..., logits_to_keep=..., kvpaging=meta).logits`` for a Llama-structured
    ``model``, computed as ``LlamaForCausalLM`` computes it, with no module call in between.

    It reads the modules it was made with; before every step :meth:`still_exact` looks at each of them for what would
    make the model's own forward pass differ from it, as the refusal does once (a hook, a ``forward`` replaced, a
    module swapped for another, another function registered under the attention's name), and the runner runs the
    model's own forward pass for that step if it finds one."""

    def __init__(self, model) -> None:
        self.model = model
        self.c_rotary = available()  # the C kernels are built here
        # where they are not (or the dtypes are not theirs): transformers' own, from the model's module
        self.apply_rotary_pos_emb = sys.modules[type(model).__module__].apply_rotary_pos_emb
        inner = model.model
        self.embed, self.rotary_emb, self.norm, self.lm_head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
        layers = inner.layers[: inner.config.num_hidden_layers]
        # each residual connection with the norm after it (the next layer's first norm; the model's last norm after the
        # last layer): one C call for the sum and the norm where that norm is the engine's C RMSNorm
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        self.first_norm = layers[0].input_layernorm if len(layers) else self.norm
        # torch's SiLU of every bfloat16 number, for silu_mul.c (made once a process, for a bfloat16 model)
        table = silu_table() if self.c_rotary and self.embed.weight.dtype == torch.bfloat16 else None
        self.layers = [(layer.self_attn, layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.self_attn.o_proj, _add_then_norm(layer.post_attention_layernorm), layer.mlp.gate_proj,
                        layer.mlp.up_proj, _act_then_mul(layer.mlp.act_fn, table), layer.mlp.down_proj,
                        _add_then_norm(next_norm))
                       for layer, next_norm in zip(layers, next_norms)]
        # every module with its place in its parent and its forward as they are now
        self.watch = [(parent, name, child, vars(child).get("forward"))
                      for parent in model.modules() for name, child in parent._modules.items()]

    def still_exact(self) -> bool:
        """Nothing the refusal looks at has changed since this was made."""
        if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
            return False
        model = self.model
        if not _attention_is_ours(model):
            return False
        if model._forward_hooks or model._forward_pre_hooks or "forward" in vars(model):
            return False
        for parent, name, child, forward in self.watch:
            if (parent._modules.get(name) is not child or child._forward_hooks or child._forward_pre_hooks
                    or vars(child).get("forward") is not forward):
                return False
        return True

    def __call__(self, meta: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
                 logits_to_keep) -> torch.Tensor:
        hidden = self.embed.forward(input_ids)
        cos, sin = self.rotary_emb.forward(hidden, positions)  # [1, tokens, dim]
        # over the heads of the projections' [1, tokens, heads, dim] views: in C (kernels/cpu/rotary.c, rounding where
        # torch rounds) where it can, else transformers' own function told where the heads are
        c_rotary = self.c_rotary and hidden.dtype is cos.dtype is sin.dtype and cos.dtype in _ROTARY_DTYPES
        cos_heads, sin_heads = cos.unsqueeze(2), sin.unsqueeze(2)
        tokens = input_ids.shape[1]
        x = self.first_norm.forward(hidden)
        for attn, q_proj, k_proj, v_proj, o_proj, add_post_norm, gate_proj, up_proj, act_mul, down_proj, add_next_norm \
                in self.layers:
            q = q_proj.forward(x).view(1, tokens, -1, attn.head_dim)
            k = k_proj.forward(x).view(1, tokens, -1, attn.head_dim)
            v = v_proj.forward(x).view(1, tokens, -1, attn.head_dim)
            if c_rotary:
                q, k = rotary_pair_unchecked(q, k, cos_heads, sin_heads)  # one C call where k's heads follow q's
            else:
                q, k = self.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
            out, _ = paged_attention_forward(attn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                                             scaling=attn.scaling, kvpaging=meta)
            hidden, x = add_post_norm(hidden, o_proj.forward(out.reshape(1, tokens, -1)))
            hidden, x = add_next_norm(hidden, down_proj.forward(act_mul(gate_proj.forward(x), up_proj.forward(x))))
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return self.lm_head.forward(x[:, keep])  # x: the model's last norm of the hidden states


def _add_then_norm(norm):
    """``(residual, y) -> (hidden, norm(hidden))`` with ``hidden = residual + y``, what a decoder layer computes at a
    residual connection and the norm after it: in one C call for the sum and the norm (``add_rms_norm``, the same
    bits) where ``norm`` is the engine's C RMSNorm and the tensors are its kind, else the sum, then ``norm``'s
    forward."""
    c_norm = is_c_rms_norm(norm)

    def add_then_norm(residual: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = norm.weight
        if (c_norm and residual.dtype is y.dtype is weight.dtype and residual.shape == y.shape
                and residual.is_contiguous() and y.is_contiguous()):
            return add_rms_norm_unchecked(residual, y, weight, norm.variance_epsilon)
        hidden = residual + y
        return hidden, norm.forward(hidden)

    return add_then_norm


def _act_then_mul(act_fn, table: torch.Tensor | None):
    """``(gate, up) -> act_fn(gate) * up``, a gated MLP's middle: in one C pass (``silu_mul``, the same bits) where
    ``act_fn`` is SiLU, the tensors bfloat16 and ``table`` torch's SiLU of every bfloat16 number (``silu_table``),
    else ``act_fn``'s forward, then the product."""
    c_silu = table is not None and type(act_fn) in (SiLUActivation, torch.nn.SiLU)

    def act_then_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if c_silu and gate.dtype is up.dtype is torch.bfloat16 and gate.stride(-1) == up.stride(-1) == 1:
            return silu_mul_unchecked(gate, up, table)
        return act_fn.forward(gate) * up

    return act_then_mul


def direct_forward_if_exact(runner, config) -> DirectForward | None:
    """A ``DirectForward`` of the runner's model where it is the model's own forward pass to the bit (the model's
    modules as ``direct_forward_refusal`` wants them, then the probe steps of ``agrees_with_own_forward``), else
    None; None too off the CPU, with tensor parallelism and with ``cpu_fast_layers=False`` (the model's own layers
    and forward). The runner's cache, block tables and fast layers are in place (the probe steps set its
    ``direct`` as they go, and leave it None)."""
    if config.cpu_fast_layers is False or runner.device.type != "cpu" or config.tensor_parallel_size != 1:
        return None
    model = runner.model
    refusal = direct_forward_refusal(model, {id(m) for m in model.modules() if has_fast_path(m)})
    if refusal is None and any(x is not None for x in (runner.state_slots, runner.layer_groups, runner.cache_indexes)):
        refusal = "its layers keep state, sliding windows or second caches"
    if refusal is None and -(-PROBE_TOKENS // runner.block_size) > runner.kv_caches[0][0].shape[0]:
        refusal = f"the pool is smaller than the probe's {PROBE_TOKENS} tokens"
    direct = DirectForward(model) if refusal is None else None
    try:
        if direct is not None and not agrees_with_own_forward(runner, direct):
            refusal = "its logits on the probe steps differ from the model's own forward's"
    except Exception as error:  # noqa: BLE001 - the model's own forward decides; the self-check names what failed
        refusal = f"a probe step raised {type(error).__name__}: {error}"
    if refusal is not None:
        logger.debug("the model's own forward pass runs: %s", refusal)
        return None
    logger.info("the forward pass calls the layers straight (no module calls): the model's own logits, to the bit")
    return direct


def _attention_is_ours(model) -> bool:
    """The model's layers would call kvpaging's attention function: its attention implementation is kvpaging's,
    and that name still finds that function in transformers' registry (a test, a view or a user may register
    another under it: the model's own forward then calls that one, and so must the step)."""
    name = model.config._attn_implementation
    try:
        return name == ATTN_NAME and ALL_ATTENTION_FUNCTIONS[name] is paged_attention_forward
    except KeyError:
        return False


def direct_forward_refusal(model, fast_forwards: set[int]) -> str | None:
    """Why ``DirectForward`` would not be ``model``'s own forward pass, or None where it would (the probe steps
    still to check it). ``fast_forwards``: ids of the modules whose ``forward`` the engine's fast layers replaced."""
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return "a global module hook is registered"
    if not _attention_is_ours(model):
        return "its attention implementation is not kvpaging's attention function"
    for name, module in model.named_modules():
        cls = type(module)
        ours = cls.__name__ in _LLAMA_CLASSES and cls.__module__ == _LLAMA_MODULE
        if not (ours or cls in _TORCH_CLASSES or (name.endswith(".act_fn") and cls.__module__ == "transformers.activations")):
            return f"{name or 'the model'} is a {cls.__qualname__}"
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{name or 'the model'} has a hook"
        if "forward" in vars(module) and id(module) not in fast_forwards:
            return f"{name or 'the model'} has a forward of its own"
    return None


def agrees_with_own_forward(runner, direct) -> bool:
    """Two probe steps through the runner's cache, each run with the model's own forward and with ``direct``: a
    24-token prompt chunk, then a decode after it. True when every logit is the same to the bit. The probe's blocks
    (the pool's first two) are zeros again afterwards, and its table rows are rewritten by their next owners."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.model.config.vocab_size, (PROBE_TOKENS,), generator=gen).tolist()
    blocks = list(range(-(-PROBE_TOKENS // runner.block_size)))
    seqs = [SimpleNamespace(seq_id="direct-forward-probe", token_ids=tokens, blocks=blocks)]
    table = [[(0, 0, blocks)]]  # sequence 0 in the runner's row 0
    chunk, decode = (step_output(step, seqs, table, runner.block_size)
                     for step in ([(0, 0, PROBE_TOKENS - 1)], [(0, PROBE_TOKENS - 1, 1)]))
    try:
        for out in (chunk, decode):
            runner.direct = None
            own = runner.execute(out, all_positions=True)
            runner.direct = direct
            if not torch.equal(own, runner.execute(out, all_positions=True)):
                return False
        return True
    finally:
        runner.direct = None
        with torch.inference_mode():
            for k_cache, v_cache in runner.kv_caches:
                k_cache[blocks] = 0
                v_cache[blocks] = 0

