"""Lesson 01's busy counter beside the work done (kvpaging.teach.utilisation), and lesson 00's tie-aware token check."""

from __future__ import annotations

import pytest
import torch

from kvpaging import LLM
from kvpaging.models import tiny
from kvpaging.teach.utilisation import measure_busy, parse_gpu_util


def test_parse_gpu_util_reads_nvidia_smi_csv():
    assert parse_gpu_util("97\n100\n") == [0.97, 1.0]
    assert parse_gpu_util("0, 5\n[N/A]\n") == [0.0]  # a second column ignored, an unreadable line skipped
    assert parse_gpu_util("") == []


def test_measure_busy_times_decode_steps_and_drains_the_engine(one_thread):
    llm = LLM(tiny("llama", num_hidden_layers=1), num_blocks=64, block_size=4, max_model_len=128)
    report = measure_busy(llm, prompt_len=12, batch=2, decode_steps=5)
    assert report.device == "cpu" and report.batch == 2 and report.decode_steps == 5
    assert report.mean_context == 12 + 5 // 2
    assert report.step_s > 0
    assert 0 < report.busy <= 1 and "CPU time" in report.busy_source
    assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.scheduler.bm.stats()
    assert stats.num_used_blocks == 0, "the timed requests must leave nothing behind"


def test_measure_busy_refuses_no_steps():
    llm = LLM(tiny("llama", num_hidden_layers=1), num_blocks=16, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="decode_steps must be at least 1, got 0"):
        measure_busy(llm, decode_steps=0)
    assert not llm.engine.has_unfinished_requests()


def test_greedy_agreement_accepts_only_ties(one_thread):
    from kvpaging.teach.setup_check import greedy_agreement, transformers_greedy

    model = tiny("llama", num_hidden_layers=1)
    prompt = list(range(5, 17))
    reference = transformers_greedy(model, prompt, 6)
    assert greedy_agreement(model, prompt, reference, reference).identical
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reference[:2]])).logits[0, -1]
    runner_up = torch.topk(logits, 2).indices[1].item()
    wrong = reference[:2] + [runner_up] + reference[3:]
    verdict = greedy_agreement(model, prompt, wrong, reference)
    assert verdict.position == 2 and verdict.tolerance == 1e-4
    gap = (torch.topk(logits.float(), 2).values[0] - torch.topk(logits.float(), 2).values[1]).item()
    assert verdict.gap == pytest.approx(gap)
    assert verdict.agrees == (gap < 1e-4) and "token 2" in str(verdict)
    # the third best: a tie only if it, too, lies within the tolerance of the best
    top3 = torch.topk(logits.float(), 3)
    third, behind = top3.indices[2].item(), (top3.values[0] - top3.values[2]).item()
    wrong3 = reference[:2] + [third] + reference[3:]
    assert not greedy_agreement(model, prompt, wrong3, reference, tolerance=behind / 2).agrees
    assert greedy_agreement(model, prompt, wrong3, reference, tolerance=behind * 2).agrees
    assert not greedy_agreement(model, prompt, reference[:2], reference, tolerance=1e9).agrees  # one ended early
