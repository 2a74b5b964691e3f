"""The whole engine on the Triton backend (under the interpreter on a CPU) gives the torch backend's tokens."""

import pytest
import torch

from kvpaging import LLM, SamplingParams
from kvpaging.models import tiny

pytestmark = pytest.mark.interpreter


def run(backend: str, prompts, **kw):
    llm = LLM(tiny("qwen3", seed=0, num_hidden_layers=2), num_blocks=32, block_size=16, max_model_len=256,
              attention_backend=backend, **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.engine.block_manager.stats().num_used_blocks == 0
    return [o.outputs[0].token_ids for o in outs], llm


def test_triton_backend_matches_torch_backend():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 4096, (20,), generator=g).tolist()
    # mixed lengths, a shared prefix (prefix-cache hit), and a chunked prefill (budget 24)
    prompts = [shared + [5, 6, 7], torch.randint(3, 4096, (9,), generator=g).tolist(), shared + [9]]
    expected, _ = run("torch", prompts, max_num_batched_tokens=24)
    got, llm = run("triton", prompts, max_num_batched_tokens=24)
    assert llm.engine.runner.backend_name == "triton"
    assert got == expected
