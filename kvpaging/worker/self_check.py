"""The load-time self-check: a model is served exactly, or refused before its first request.

kvpaging runs the user's own transformers model and swaps only its attention
for the paged one (``kvpaging/worker/attention.py``). That works when the model's
attention goes through transformers' ``AttentionInterface``, gets the engine's
step metadata, computes nothing the kernels leave out, and keeps all of its
state in the keys and values of one attention call per layer. Most causal LMs
do; some do not, and a model that does not would not crash: it would write
wrong tokens, silently. So before serving, the engine checks.

``run_self_check`` sends two short random prompts (21 and 13 tokens) through the
engine's own path the way the scheduler would (both first chunks packed in one
step; then one's decode packed with the other's next chunk, both reading the
cache; and, where the engine uses CUDA graphs, a step of decodes replayed through
them), and compares the logits at every position with those of the model's own
forward pass over the same tokens. During those steps an ``AttentionProbe``
watches every attention call, so the usual causes are named exactly:

- ``attention_interface``: no layer (or not every layer) called our function;
- ``no_metadata``: it was called outside an engine step;
- ``attention_arguments``: an argument the kernels would get wrong or ignore (a
  sliding window other than the config's, sinks not one per query head, a
  non-causal mask, dropout, an argument they do not know);
- ``double_call``: two attention calls with one layer index in one step;
- ``kv_shape``: keys or values that do not fit the cache sized from the config;
- ``crash``, ``cuda_graphs``, ``logits``: what is left, with the numbers.

The check uses the first blocks of the KV pool directly (not the block
manager, whose books it leaves untouched) and zeroes them afterwards. It costs
three forward passes over 34 tokens (0.4 s for the trained model on a 2-core CPU:
``benchmarks/self_check.py``); ``LLMEngine.self_check`` records what it found and its seconds.
``self_check=False`` skips it, for people who have checked their model already.

A model checked once is not checked again while nothing the check depends on
has changed (``CheckedModels``): the same model object, with the same config,
the same weight tensors not written in place since, the same module classes,
forward functions and hooks, under the same engine settings (scheduling aside). A notebook that builds a new
``LLM`` on one model in every cell pays for one check, not one per cell.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, fields, replace
from itertools import chain
from types import SimpleNamespace

import numpy as np
import torch

from kvpaging.core.scheduler_output import ScheduledSeq, SchedulerOutput
from kvpaging.errors import TensorParallelError, UnsupportedModelError
from kvpaging.models import private_copy
from kvpaging.worker.attention import ATTN_NAME, register_attention
from kvpaging.worker.kv_layout import MEASURING, NO_KV, LayerKV, cache_indexes, layer_windows
from kvpaging.worker.state_layers import no_kv_layers

__all__ = ["check_model_supported", "SelfCheckResult", "AttentionProbe", "run_self_check", "TOLERANCES", "CheckedModels", "CHECKED",
           "supported_layout", "check_or_recall", "not_routed_error"]

# Arguments transformers passes to attention that change nothing the kernels compute, whatever their value:
# positions and cache flags (the metadata says where every token goes), our own metadata.
IGNORED_ARGUMENTS = frozenset({ATTN_NAME, "position_ids", "cache_position", "use_cache", "past_key_values",
                               "past_key_value", "output_attentions", "position_embeddings"})

# How far the paged logits may stray from the model's own: the root-mean-square difference over every
# position and vocabulary entry, as a share of the spread (standard deviation) of the model's own logits. The
# two paths add the same products in a different order and round keys and values to the cache's dtype: on the
# trained model and tiny random-weight ones that costs about 1e-5 in float32, 0.004 in float16, 0.03-0.04 in
# bfloat16 and 0.1-0.2 with an FP8 cache. A model whose attention misses the cache is off by 0.4 or more.
TOLERANCES = {torch.float32: 1e-3, torch.float16: 0.02, torch.bfloat16: 0.08, torch.float8_e4m3fn: 0.25}

# the two prompts' lengths: 21 tokens cross a 16-token block boundary inside a chunk read over cached tokens
LENGTHS = (21, 13)


def check_model_supported(model) -> None:
    """Refuse models whose config declares what kvpaging cannot serve, saying which feature is the problem.

    What the config does not say (attention outside ``AttentionInterface``, arguments the kernels
    ignore, keys of another shape) the load-time self-check finds (``kvpaging/worker/self_check.py``).
    """
    config = model.config
    name = type(model).__name__

    def refuse(message: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{name} {message}", "architecture")

    if getattr(config, "is_encoder_decoder", False):
        raise refuse("is an encoder-decoder model; kvpaging serves decoder-only causal LMs")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config and getattr(config, "num_attention_heads", None) is None:
        raise refuse(f"is a composite model ({type(config).__name__}, its language model's settings in a sub-config "
                     f"{type(text).__name__}); kvpaging serves text-only causal LMs: load the language model "
                     "alone (AutoModelForCausalLM.from_config(config.get_text_config()) and its weights)")
    state_layers = no_kv_layers(model)  # layers with a recurrent or convolution state, or feed-forward only
    for field in ("num_hidden_layers", "num_attention_heads"):
        value = getattr(config, field, None)
        if field == "num_attention_heads" and value is None and state_layers:
            continue  # a state-space model (Mamba): no attention, a state per sequence in every layer
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise refuse(f"has no attention layers kvpaging can size a KV cache for: its config's {field} is "
                         f"{value!r}, and no layer keeps a state through transformers' cache API (get_conv_state, "
                         "get_recurrent_state), which is how kvpaging serves recurrent and state-space layers")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = sorted({str(t) for i, t in enumerate(layer_types)
                        if t not in ("full_attention", "sliding_attention") and i not in state_layers})
        if other:
            raise refuse(f"has {other} layers; kvpaging serves full-attention and sliding-window layers, and "
                         "layers that keep a recurrent or convolution state through transformers' cache API")
    windows = layer_windows(config)
    if any(windows) and not all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in windows if w):
        raise refuse(f"has sliding windows {sorted(set(map(repr, windows)))}; kvpaging serves windows of a positive "
                     "number of tokens")
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise refuse("has no language-model head; pass a causal LM (AutoModelForCausalLM)")


@dataclass(frozen=True)
class SelfCheckResult:
    """What the self-check compared, and how close the paged path came to the model's own forward pass."""

    error: float  # root-mean-square of paged - own logits over every position, as a share of their spread
    worst_position_error: float  # the same over the worst position's logits alone
    tolerance: float  # the most it may be (TOLERANCES, by the model's dtype or the FP8 cache)
    positions: int  # logit rows compared (every token of every step)
    steps: int  # engine steps run (the CUDA-graph replay included)
    cuda_graphs: bool  # whether the decode step was also replayed through the captured graphs
    seconds: float  # wall time of the whole check, reference forward passes included
    reused: bool = False  # this engine took the result of an earlier check of the same model and settings


# --------------------------------------------------------------------------- refusals with their causes

def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _layer_name(module) -> str:
    return f"{type(module).__name__} (layer_idx={getattr(module, 'layer_idx', None)!r})"


def measure_kv_layout(model, num_layers: int, refuse: bool = True) -> list[LayerKV] | None:
    """Each layer's keys and values as the model gives them to attention, from one unpaged forward pass of a
    private copy over 4 tokens (the user's model is not touched). None when the pass fails or some layer neither
    called kvpaging's attention nor keeps a state kvpaging serves: the load-time self-check then names the cause.
    A pass in which no layer called it raises ``UnsupportedModelError`` (cause ``attention_interface``) at once,
    unless ``refuse`` is False (``self_check=False``: the user serves it at their own risk)."""
    register_attention()
    copy = private_copy(model).eval()
    copy.set_attn_implementation(ATTN_NAME)
    vocab = copy.get_output_embeddings().weight.shape[0]
    device = next(copy.parameters()).device
    ids = (torch.arange(4, device=device) % vocab).unsqueeze(0)
    found: dict[int, list[LayerKV]] = {}  # layer -> its calls' shapes
    token = MEASURING.set(found)
    try:
        with torch.inference_mode():
            copy(input_ids=ids, use_cache=False, logits_to_keep=1)
    except Exception:  # noqa: BLE001 - the self-check runs the model again and says what went wrong
        return None
    finally:
        MEASURING.reset(token)
    missing = set(range(num_layers)) - set(found)
    if not missing <= no_kv_layers(model):  # a layer that neither attends through us nor keeps a state we serve
        if refuse and not found:  # the pass ran, no layer called our attention: it does its own (Bloom, GPT-1)
            raise not_routed_error(type(model).__name__, sorted(missing), num_layers)
        return None  # some did: the self-check's probe names what the others do (a second call, say)
    first = [found[i][0] if i in found else NO_KV for i in range(num_layers)]
    return first + [kv for i in sorted(found) for kv in found[i][1:]]  # a layer's further calls: caches of their own


class AttentionProbe:
    """Watches every attention call of the self-check's steps (``AttentionMetadata.probe``).

    Raises ``UnsupportedModelError`` at the first call the kernels would get
    wrong; ``finish_step`` then checks that every layer called exactly once.
    """

    def __init__(self, model_name: str, kv_layout: list, windows: list | None = None) -> None:
        self.model_name = model_name
        self.num_layers = num_layers = sum(1 for kv in kv_layout if kv.of_layer < 0)  # (the rest: further calls)
        self.windows = list(windows) if windows is not None else [0] * num_layers  # the config's, per layer
        self.kv_layout = kv_layout  # each call's LayerKV: what its cache was sized for (kvpaging/worker/kv_layout.py)
        self.caches = cache_indexes(kv_layout, num_layers) or [[i] for i in range(num_layers)]  # per layer, per call
        self.calls = [0] * num_layers
        self.num_tokens = 0

    def start_step(self, num_tokens: int) -> None:
        self.calls = [0] * self.num_layers
        self.num_tokens = num_tokens

    def record(self, module, query, key, value, dropout, kwargs) -> None:
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise UnsupportedModelError(
                f"{_layer_name(module)} has no layer index in 0..{self.num_layers - 1}; the paged cache keeps "
                "one key/value store per layer, found by module.layer_idx", "attention_arguments")
        self.calls[layer] += 1
        caches = self.caches[layer]
        if self.calls[layer] > len(caches):
            raise UnsupportedModelError(
                f"{_layer_name(module)} called attention {self.calls[layer]} times in one forward pass, but "
                f"{len(caches)} time(s) in the pass that sized the paged cache, which holds keys and values for "
                "each of those calls only: the next call's would overwrite another's", "double_call")
        self._check_shapes(module, self.kv_layout[caches[self.calls[layer] - 1]], query, key, value)
        self._check_window(module, layer, kwargs.get("sliding_window"))
        if dropout:
            raise UnsupportedModelError(
                f"{_layer_name(module)} asks for attention dropout={dropout!r} in eval mode, which the paged "
                "kernels do not apply", "attention_arguments")
        for name, arg in kwargs.items():
            if name == "is_causal":
                if arg is None or arg is True:
                    continue
            elif name in IGNORED_ARGUMENTS or name == "sliding_window" or arg is None or arg is False:
                continue
            elif name == "softcap" and isinstance(arg, (int, float)) and not isinstance(arg, bool) and arg >= 0:
                continue  # the kernels soft-cap the scores (Gemma 2)
            elif name == "s_aux" and isinstance(arg, torch.Tensor) and tuple(arg.shape) == (query.shape[1],):
                continue  # the kernels add each head's sink logit to its softmax (gpt-oss)
            raise UnsupportedModelError(
                f"{_layer_name(module)} passes attention the argument {name}={_describe(arg)}, which kvpaging's "
                f"paged kernels do not implement ({_ARGUMENT_HINTS.get(name, 'they would ignore it')}), so its "
                "tokens would be wrong", "attention_arguments")

    def _check_window(self, module, layer: int, window) -> None:
        """The kernels window a layer by its ``sliding_window`` argument, the model's own mask by its config:
        the two must be the same number, or the paged and the model's attention would see different keys."""
        expected = self.windows[layer] if layer < len(self.windows) else 0
        if window is None or window is False:
            window = 0
        if isinstance(window, bool) or not isinstance(window, int) or window < 0 or window != expected:
            raise UnsupportedModelError(
                f"{_layer_name(module)} passes attention sliding_window={_describe(window)}, but its config declares "
                f"{f'a window of {expected} tokens' if expected else 'full attention'} for layer {layer}: kvpaging's "
                "kernels window a layer by that argument and the model's own masks by the config, so they would "
                "attend to different keys", "attention_arguments")

    def _check_shapes(self, module, layer, query, key, value) -> None:
        heads = layer.num_kv_heads
        n = self.num_tokens
        bad = None
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            bad = "query, key and value must be [batch, heads, tokens, head_dim]"
        elif query.shape[0] != 1 or key.shape[0] != 1 or query.shape[2] != n or key.shape[2] != n:
            bad = f"the engine packs a step's {n} tokens as one batch row"
        elif (key.shape[1], key.shape[3], value.shape[1], value.shape[3]) != (
                heads, layer.key_width, heads, layer.value_width):
            bad = (f"the cache was sized for {heads} KV heads with keys {layer.key_width} and values "
                   f"{layer.value_width} wide in this layer (as a first forward pass gave them, or the config "
                   "describes them): the layer's shapes change from call to call")
        elif query.shape[3] != layer.key_width or query.shape[1] % heads:
            bad = f"the query heads must be a multiple of the {heads} KV heads, with the keys' width {layer.key_width}"
        if bad is not None:
            raise UnsupportedModelError(
                f"{_layer_name(module)} gives attention query {tuple(query.shape)}, key {tuple(key.shape)} and "
                f"value {tuple(value.shape)}, which do not fit the paged cache: {bad}", "kv_shape")

    def finish_step(self) -> None:
        # layers that keep keys and values but called attention fewer times than the sizing pass saw: none at all
        # (their attention went elsewhere), or some (the number of calls depends on the input)
        fewer = [i for i, c in enumerate(self.calls) if c < len(self.caches[i]) and self.kv_layout[i].num_kv_heads]
        missing = [i for i in fewer if not self.calls[i]]
        if missing:
            raise not_routed_error(self.model_name, missing, self.num_layers)
        if fewer:
            raise UnsupportedModelError(
                f"{self.model_name}: layers {fewer} called attention fewer times in a step than in the pass that sized "
                "the paged cache: the number of calls depends on the input", "double_call")


_ARGUMENT_HINTS = {
    "s_aux": "attention sinks, which they take as one logit per query head",
    "sinks": "attention sinks: a learned extra logit in every softmax",
    "softcap": "soft-capping of the attention scores",
    "sliding_window": "sliding-window attention: each token sees only the last few",
    "is_causal": "a non-causal mask: every token sees the whole sequence",
}


# --------------------------------------------------------------------------- the check

def _plan(lengths: tuple[int, ...], decode_step: bool) -> list[list[tuple[int, int, int]]]:
    """The steps, each a list of ``(sequence, start, num_tokens)``, as the scheduler could have made them.

    Step 1: both sequences' first chunks, packed side by side (sequence 0 first, so its tokens are
    computed as if alone). Step 2: sequence 1's decode packed with sequence 0's next chunk, both
    reading the cache. With ``decode_step`` (the engine will capture CUDA graphs, which serve steps
    of decodes only) both keep their last token for a third step of decodes.
    """
    tail = 1 if decode_step else 0
    a = lengths[0]
    split = max(1, (a - 1) // 2)
    pieces = [[split, a - split - tail, tail]]
    if len(lengths) > 1:
        b = lengths[1]
        pieces.append([b - 1 - tail, 1, tail])
    steps = []
    for i in range(3):
        step = []
        for k, sizes in enumerate(pieces):
            start = sum(sizes[:i])
            if sizes[i] > 0:
                step.append((k, start, sizes[i]))
        if step:
            steps.append(sorted(step, key=lambda e: e[2] != 1))  # decodes first, as the runner packs them
    return steps


def _own_logits(model, tokens: list[torch.Tensor], device) -> list[torch.Tensor]:
    """The model's own forward pass over each sequence, in one batch (right-padded: a causal model's logits at a
    position see only the tokens up to it, so the padding after them changes nothing)."""
    ref = model
    if model.training or getattr(model.config, "_attn_implementation", None) == ATTN_NAME:
        ref = private_copy(model).eval()  # a copy, so the user's model keeps its mode and its attention
        if getattr(ref.config, "_attn_implementation", None) == ATTN_NAME:  # someone handed us a model set to ours
            ref.set_attn_implementation("sdpa")
    batch = torch.zeros(len(tokens), max(len(t) for t in tokens), dtype=torch.int64)
    for row, t in enumerate(tokens):
        batch[row, : len(t)] = t
    with torch.inference_mode():
        logits = ref(input_ids=batch.to(device), use_cache=False).logits.float()
    return [logits[row, : len(t)] for row, t in enumerate(tokens)]


def run_self_check(runner, model, config, vocab_size: int, capture_graphs: bool = False) -> SelfCheckResult:
    """Check ``runner`` (a ModelRunner) against ``model``'s own forward pass; raise UnsupportedModelError if it is off.

    ``capture_graphs``: the runner's CUDA graphs are still to be captured (``runner.capture_graphs``): they are,
    after the eager steps, and the decode step is then replayed through them and checked too.
    """
    t0 = time.perf_counter()
    name = type(model).__name__
    bs = config.block_size
    # a table per layer group (sliding layers among full ones): each group's blocks are blocks of its own
    num_groups = runner.layer_groups.num_groups if getattr(runner, "layer_groups", None) else 1
    capacity = config.num_blocks // num_groups
    # the pool holds max_model_len tokens, or (a model with a window on every layer) at least one step's worth
    lengths = [min(n, config.max_model_len, capacity * bs) for n in LENGTHS]
    if sum(-(-n // bs) for n in lengths) > capacity:
        lengths = lengths[:1]  # so one sequence always fits
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]

    try:
        own = _own_logits(model, tokens, runner.device)
    except (torch.OutOfMemoryError, KeyboardInterrupt):
        raise
    except Exception as error:
        raise UnsupportedModelError(
            f"{name}'s own forward pass failed on a {lengths[0]}-token prompt, so kvpaging cannot check it: "
            f"{type(error).__name__}: {error}", "crash") from error

    blocks, first = [], 0  # each sequence's blocks: the pool's first ones, in turn
    for n in lengths:
        blocks.append(list(range(first, first + -(-n // bs))))
        first += len(blocks[-1])
    # each sequence's whole table, in the runner's rows; layer group g's tables: the same, ``g * first`` blocks on
    table = [[(row, 0, [b + g * first for b in ids]) for row, ids in enumerate(blocks)] for g in range(num_groups)]
    seqs = [SimpleNamespace(seq_id=("self-check", k), token_ids=t.tolist(), blocks=blocks[k])
            for k, t in enumerate(tokens)]
    probe = AttentionProbe(name, runner.kv_layout, layer_windows(runner.model.config))
    graphs = capture_graphs and runner.uses_graphs
    steps = _plan(tuple(lengths), decode_step=graphs)
    errors: list[tuple[float, int, int, int, str]] = []  # (mean squared error, step, sequence, position, kind)
    scale = float(torch.cat(own).std()) or 1.0

    def compare(logits: torch.Tensor, step: list, step_no: int, replay: bool = False) -> None:
        # sequence 0's first chunk comes first in step 1: its tokens see only one another
        rows = [(k, p, "graph replay" if replay else "first chunk" if step_no == 1 and k == 0 else
                 "packed or over the cache") for k, start, n in step for p in range(start, start + n)]
        if logits.shape[0] != len(rows) or not torch.isfinite(logits).all():
            raise UnsupportedModelError(
                f"{name}'s paged forward pass gave {tuple(logits.shape)} logits, with non-finite values or not "
                f"one row per token ({len(rows)}), in the self-check's step {step_no}", "logits")
        diff = (logits - torch.stack([own[k][p] for k, p, _ in rows])).pow(2).mean(dim=1) / scale ** 2
        errors.extend((d, step_no, k, p, kind) for (k, p, kind), d in zip(rows, diff.tolist()))

    runner.probe = probe
    replayed = False
    try:
        for i, step in enumerate(steps, 1):
            probe.start_step(sum(n for _, _, n in step))
            logits = _execute(runner, step_output(step, seqs, table, bs), True, i, step, lengths)
            probe.finish_step()  # the structural causes first: they name the problem better than the numbers
            compare(logits, step, i)
        runner.probe = None
        if graphs:
            try:
                runner.capture_graphs()
            except (torch.OutOfMemoryError, KeyboardInterrupt):
                raise
            except Exception as error:
                raise UnsupportedModelError(
                    f"capturing {name}'s decode step in CUDA graphs failed ({type(error).__name__}: {error}); "
                    "pass enforce_eager=True to serve it without graphs", "cuda_graphs") from error
            last = steps[-1]
            if runner.graphs is not None and all(n == 1 for _, _, n in last):
                step_no = len(steps) + 1
                compare(_execute(runner, step_output(last, seqs, table, bs), False, step_no, last, lengths),
                        last, step_no, replay=True)
                replayed = True
    finally:
        runner.probe = None
        used = torch.arange(first * num_groups)
        with torch.inference_mode():
            for k_cache, v_cache in runner.kv_caches:  # leave the pool as it was: zeros
                k_cache[used.to(k_cache.device)] = 0
                v_cache[used.to(v_cache.device)] = 0

    dtype = torch.float8_e4m3fn if runner.kv_cache_dtype == torch.float8_e4m3fn else runner.dtype
    tol = TOLERANCES.get(dtype, 0.08)
    error = _rms(errors)
    if error > tol:
        raise _logits_error(name, error, errors, tol, dtype, scale)
    return SelfCheckResult(error=error, worst_position_error=max(errors)[0] ** 0.5, tolerance=tol,
                           positions=len(errors), steps=len(steps) + replayed, cuda_graphs=replayed,
                           seconds=time.perf_counter() - t0)


def _rms(errors) -> float:
    return (sum(e[0] for e in errors) / len(errors)) ** 0.5 if errors else 0.0


def step_output(step, seqs, table, bs):
    """A ``SchedulerOutput`` for probe ``step`` (``(sequence, start, tokens)`` triples) over ``seqs`` with the whole
    ``table`` as its table updates (the self-check's, and the direct forward's probe, kvpaging/worker/direct_forward.py)."""
    out = SchedulerOutput(step=0, table_updates=table, block_size=bs)
    decodes = [(k, start) for k, start, n in step if n == 1]
    out.decodes = [seqs[k] for k, _ in decodes]
    out.decode_rows = np.array([k for k, _ in decodes], dtype=np.int64)
    out.decode_positions = np.array([p for _, p in decodes], dtype=np.int64)
    out.decode_token_ids = [seqs[k].token_ids[p] for k, p in decodes]
    out.chunks = [ScheduledSeq(seqs[k], start, n, start + n == len(seqs[k].token_ids), True, k)
                  for k, start, n in step if n > 1]
    return out


def _execute(runner, out, all_positions: bool, step_no: int, step, lengths) -> torch.Tensor:
    try:
        return runner.execute(out, all_positions=all_positions).float()
    except (UnsupportedModelError, TensorParallelError, torch.OutOfMemoryError, KeyboardInterrupt):
        raise
    except Exception as error:
        what = ", ".join(f"sequence {k} tokens {s}..{s + n - 1} of {lengths[k]}" for k, s, n in step)
        hint = ""
        if runner.probe is not None and not any(runner.probe.calls):
            hint = (" No layer had called kvpaging's attention yet: the model does its own attention, or reads the "
                    "attention mask, which the engine passes as a 1x1x1x1 placeholder (the paged kernels need none).")
        raise UnsupportedModelError(
            f"{type(runner.model).__name__}'s paged forward pass raised {type(error).__name__} in the self-check's "
            f"step {step_no} ({what}): {error}.{hint}", "crash") from error


def _logits_error(name, error, errors, tol, dtype, scale) -> UnsupportedModelError:
    by_kind = {kind: _rms([e for e in errors if e[4] == kind])
               for kind in ("first chunk", "packed or over the cache", "graph replay")}
    if by_kind["graph replay"] > tol:
        cause = ("the decode step replayed through CUDA graphs differs from the eager steps: the model's forward "
                 "pass is not safe to capture; pass enforce_eager=True")
    elif by_kind["first chunk"] > tol:  # wrong where no cache is read: the attention itself
        cause = ("the attention math differs even in the first chunk, alone in its step and reading no cache: the "
                 "model's attention computes something the paged kernels do not (position biases such as ALiBi "
                 "added to the scores, a custom or non-causal mask, attention sinks, soft-capping)")
    else:
        cause = ("the first chunk, alone in its step, matches, but tokens that read earlier steps back from the cache "
                 "or share a packed step with another sequence do not: the model keeps state outside attention's "
                 "keys and values or mixes tokens outside attention (recurrent or convolution layers, a cache of its "
                 "own), or derives positions from something other than position_ids")
    worst, step_no, k, p, kind = max(errors)
    return UnsupportedModelError(
        f"{name} gives different logits through kvpaging's paged attention than through its own forward pass: "
        f"their root-mean-square difference is {error:.3g} of the logits' spread ({scale:.3g}), beyond the "
        f"tolerance {tol} for {dtype} (the first chunk {by_kind['first chunk']:.3g}, the packed steps over the "
        f"cache {by_kind['packed or over the cache']:.3g}; worst at sequence {k} position {p}, {kind} in step {step_no}: "
        f"{worst ** 0.5:.3g}). Likely cause: {cause}.", "logits")


# --------------------------------------------------------------------------- checked once, not at every LLM()

# Engine settings the check's outcome does not depend on: it runs the model runner directly, with its own plan.
_SCHEDULING_ONLY = frozenset({"max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "scheduling",
                              "seed", "max_logprobs"})


def model_fingerprint(model) -> tuple | None:
    """What the check's outcome (and the key/value layout) depends on in ``model``: its config, the identity
    and in-place write count (``Tensor._version``) of every weight and buffer, and the class and forward
    function and hooks of every module. None when the config cannot be written out (then nothing is remembered)."""
    try:
        config = model.config.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001 - an unusual config: check every time
        return None
    weights = tuple((id(t), t._version) for t in chain(model.parameters(), model.buffers()))
    modules = tuple((id(m), id(type(m).forward), id(m.__dict__.get("forward")), tuple(m._forward_hooks),
                     tuple(m._forward_pre_hooks)) for m in model.modules())
    return config, weights, modules


class CheckedModels:
    """The models this process has checked, with their key/value layout and each setting's result.

    Held weakly: a model the user drops is forgotten with it. A fingerprint that changed (a weight written in
    place, a config edited, a module swapped) forgets everything remembered about that model.
    """

    def __init__(self) -> None:
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [fingerprint, layout, results]

    def _entry(self, model, fingerprint):
        entry = self._models.get(model) if fingerprint is not None else None
        return entry if entry is not None and entry[0] == fingerprint else None

    def layout(self, model, fingerprint):
        entry = self._entry(model, fingerprint)
        return None if entry is None else entry[1]

    def result(self, model, fingerprint, config) -> SelfCheckResult | None:
        entry = self._entry(model, fingerprint)
        found = None if entry is None else entry[2].get(_settings_key(config))
        return None if found is None else replace(found, reused=True)

    def remember(self, model, fingerprint, layout, config=None, result: SelfCheckResult | None = None) -> None:
        if fingerprint is None:
            return
        entry = self._entry(model, fingerprint)
        if entry is None:
            entry = self._models[model] = [fingerprint, layout, {}]
        if result is not None and not result.reused:
            entry[2][_settings_key(config)] = result


def _settings_key(config) -> tuple:
    return tuple((f.name, getattr(config, f.name)) for f in fields(config) if f.name not in _SCHEDULING_ONLY)


CHECKED = CheckedModels()


def supported_layout(model, config) -> tuple[tuple | None, list[LayerKV] | None]:
    """For an engine about to serve ``model``: refuse what its config says kvpaging cannot serve, before anything is
    sized for it (``check_model_supported``); then its fingerprint and each layer's keys and values as the model
    gives them to attention, which the pool is sized by (found once per model: ``CHECKED``)."""
    check_model_supported(model)
    fingerprint = model_fingerprint(model)
    layout = CHECKED.layout(model, fingerprint) or measure_kv_layout(model, model.config.num_hidden_layers,
                                                                     refuse=config.self_check)
    return fingerprint, layout


def check_or_recall(runner, model, fingerprint, layout, config, vocab_size: int) -> SelfCheckResult | None:
    """The engine's self-check result: remembered from an earlier engine on the same, unchanged model with the same
    settings, or run now on ``runner`` (None with ``self_check=False``). Captures CUDA graphs either way."""
    result = CHECKED.result(model, fingerprint, config) if config.self_check else None
    if result is not None:  # checked before, and nothing it depends on has changed since
        if config.tensor_parallel_size == 1 and runner.uses_graphs:
            runner.capture_graphs()
    elif config.self_check:
        try:
            result = run_self_check(runner, model, config, vocab_size, capture_graphs=config.tensor_parallel_size == 1)
        except BaseException:
            runner.shutdown()  # a tensor-parallel runner's workers go too
            raise
    if layout is not None:
        CHECKED.remember(model, fingerprint, layout, config, result)
    return result


def not_routed_error(model_name: str, missing: list[int], num_layers: int) -> UnsupportedModelError:
    """No layer, or not every layer, called kvpaging's attention in a forward pass."""
    if len(missing) == num_layers:
        return UnsupportedModelError(
            f"{model_name}'s attention does not go through transformers' AttentionInterface: no layer called "
            "kvpaging's attention function in a forward pass, so set_attn_implementation('kvpaging') left it with "
            "attention of its own, which would run without the paged KV cache. kvpaging serves models whose "
            "attention transformers dispatches by config._attn_implementation.", "attention_interface")
    return UnsupportedModelError(
        f"{model_name}: layers {missing} of {num_layers} never called kvpaging's attention function in a forward "
        "pass. The paged cache gives every layer one self-attention call per step; those layers do something else "
        "(cross-attention to another input, a recurrent or convolution layer, or attention of their own that "
        "AttentionInterface does not dispatch), which kvpaging does not serve.", "attention_interface")
