"""CUDA graphs for decode: the padded batch-size ladder (anywhere) and graph replay == eager (on a GPU only)."""

import pytest
import torch

from kvpaging import LLM, SamplingParams
from kvpaging.worker.cuda_graphs import batch_size_ladder
from kvpaging.models import tiny


def test_ladder_covers_every_batch_size_up_to_the_cap():
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(8) == [1, 2, 4, 8]
    assert batch_size_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    ladder = batch_size_ladder(256)
    assert ladder[:5] == [1, 2, 4, 8, 16] and ladder[-1] == 256
    assert all(b - a <= 16 for a, b in zip(ladder, ladder[1:]))


def test_enforce_eager_false_is_accepted_on_cpu_and_changes_nothing():
    m = tiny("qwen3", num_hidden_layers=2)
    llm = LLM(m, num_blocks=32, max_model_len=128, enforce_eager=False)
    assert llm.engine.runner.graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replay_gives_the_eager_tokens():
    prompts = [list(range(3, 3 + n)) for n in (1, 5, 17, 40, 9, 3, 30)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = []
    for eager in (True, False):
        m = tiny("qwen3", seed=0, num_hidden_layers=2).to("cuda")
        llm = LLM(m, num_blocks=64, max_model_len=128, max_num_seqs=16, enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.engine.block_manager.stats().num_used_blocks == 0
    assert results[0] == results[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_torch_backend_runs_eagerly_on_cuda():
    """Its store_kv checks for padding slots on the host, which a graph capture cannot do."""
    m = tiny("qwen3", seed=0, num_hidden_layers=2).to("cuda")
    llm = LLM(m, num_blocks=64, max_model_len=128, attention_backend="torch", enforce_eager=False)
    assert llm.engine.runner.graphs is None
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
