"""The whole engine on the Triton backend gives the torch backend's tokens.

On a CUDA machine the model (and so the KV cache) goes to the GPU and the kernels are
compiled; on a CPU they run under the interpreter (``conftest.py``). A model left on
the CPU of a CUDA machine would make every step fail: the Triton kernels refuse CPU
tensors when the interpreter is off.
"""

import pytest
import torch

from kvpaging import LLM, SamplingParams
from kvpaging.models import tiny

pytestmark = pytest.mark.interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_TOKENS = 4


def run(backend: str, prompts, **kw):
    model = tiny("qwen3", seed=0, num_hidden_layers=2).to(DEVICE)
    llm = LLM(model, num_blocks=32, block_size=16, max_model_len=256, attention_backend=backend, **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    assert llm.engine.block_manager.stats().num_used_blocks == 0
    tokens = [o.outputs[0].token_ids for o in outs]
    # every request served in full: an engine whose steps failed would hand back fewer tokens
    assert [len(t) for t in tokens] == [MAX_TOKENS] * len(prompts), f"{backend}: {tokens}"
    return tokens, llm


def test_triton_backend_matches_torch_backend():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 4096, (20,), generator=g).tolist()
    # mixed lengths, a shared prefix (prefix-cache hit), and a chunked prefill (budget 24)
    prompts = [shared + [5, 6, 7], torch.randint(3, 4096, (9,), generator=g).tolist(), shared + [9]]
    expected, _ = run("torch", prompts, max_num_batched_tokens=24)
    got, llm = run("triton", prompts, max_num_batched_tokens=24)
    assert llm.engine.runner.backend_name == "triton"
    assert llm.engine.runner.device.type == DEVICE
    assert got == expected


def test_triton_sliding_window_equals_generate():
    """Mistral with a 6-token window over 20-token prompts, in chunks of 8 (a chunk's first queries see keys
    of the chunk before it): the Triton kernels' windowed masks give transformers' own tokens."""
    from engine_helpers import Reference

    ref = Reference("mistral", sliding_window=6)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (20, 9)]
    llm = LLM(ref.engine_model().to(DEVICE), num_blocks=32, block_size=4, max_model_len=64,
              attention_backend="triton", max_num_batched_tokens=8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref.assert_greedy(prompt, out.outputs[0].token_ids, MAX_TOKENS, what="triton, window 6")
