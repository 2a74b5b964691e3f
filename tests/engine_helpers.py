"""Shared pieces of the engine tests: tiny models, prompts, a trusted reference, pool checks.

The reference is transformers' own ``model.generate()`` (greedy, batch 1, no
padding), run on a second model built from the same seed, so the expected
tokens never come from kvpaging's code. ``tiny(arch, seed=0)`` gives identical
weights every time it is called, so "the same model" can be built twice.
"""

from __future__ import annotations

import torch

from kvpaging import LLM, SamplingParams
from kvpaging.models import tiny
from kvpaging.teach.setup_check import greedy_agreement
from kvpaging.core.invariants import check_block_manager, check_scheduler

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
NUM_LAYERS = 2  # enough to test layer indexing; keeps every forward cheap on a 2-core CPU
FIRST_ORDINARY_TOKEN = 3  # ids 0, 1, 2 are pad, bos and eos in every tiny model
TIE_TOLERANCE = 1e-4  # two logits closer than this (float32) may be ordered either way


def make_model(arch: str = "qwen3", **overrides):
    return tiny(arch, seed=0, num_hidden_layers=NUM_LAYERS, **overrides)


def random_prompt(length: int, seed: int, vocab_size: int = 4096) -> list[int]:
    """A prompt of ordinary tokens (no pad / bos / eos), the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ORDINARY_TOKEN, vocab_size, (length,), generator=g).tolist()


class Reference:
    """Greedy continuations from transformers' generate(), computed once and cached.

    Greedy decoding without an end token is prefix-stable (the first k tokens of a
    longer run are the k-token run), so one run per prompt serves every length.
    """

    def __init__(self, arch: str = "qwen3", **overrides) -> None:
        self.arch = arch
        self.overrides = overrides
        self.model = make_model(arch, **overrides)
        # No end token at all on the reference model: generate() must produce exactly the
        # tokens asked for, and may pick the EOS token as greedily as the engine does with
        # ignore_eos=True. (min_new_tokens alone would *ban* EOS, which is not ignoring it;
        # and an eos_token_id=None passed to generate() is replaced by the model's default.)
        self.model.config.eos_token_id = None
        self.model.generation_config.eos_token_id = None
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def engine_model(self):
        """A second model from the same seed and settings, for the engine to serve."""
        return make_model(self.arch, **self.overrides)

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        key = tuple(prompt)
        known = self._cache.get(key, [])
        if len(known) < num_tokens:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=num_tokens,
                    min_new_tokens=num_tokens,
                    pad_token_id=0,
                )
            known = out[0, len(prompt):].tolist()
            assert len(known) == num_tokens, f"generate() gave {len(known)} tokens, asked for {num_tokens}"
            self._cache[key] = known
        return known[:num_tokens]

    def last_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits after ``token_ids``, from one plain full forward pass (no cache at all)."""
        with torch.no_grad():
            return self.model(torch.tensor([token_ids])).logits[0, -1].float()

    def assert_greedy(self, prompt: list[int], got: list[int], num_tokens: int | None = None, what: str = "") -> None:
        """``got`` must equal the reference continuation, except for a divergence at a genuine tie.

        At the first position where the two differ, the reference logits for the
        common prefix are recomputed with one full forward pass. The divergence is
        allowed only if both tokens' logits lie within TIE_TOLERANCE of the best
        there; the rest is then not compared (the sequences legitimately went
        separate ways).
        """
        num_tokens = len(got) if num_tokens is None else num_tokens
        assert len(got) == num_tokens, f"{what}: got {len(got)} tokens, expected {num_tokens}"
        expected = self.greedy(prompt, num_tokens)
        verdict = greedy_agreement(self.model, prompt, got, expected, tolerance=TIE_TOLERANCE)
        assert verdict.agrees, (
            f"{what}: token {verdict.position} is {got[verdict.position]}, transformers' generate() gives "
            f"{expected[verdict.position]} (up to {verdict.gap:.3g} below the best logit, not a tie)\n engine:    {got}\n "
            f"reference: {expected}"
        )
        if not verdict.identical:
            TIES.append((self.arch, what, verdict.position, verdict.gap))


TIES: list[tuple] = []  # divergences accepted as ties, for anyone curious how often they happen


def greedy_params(num_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, **kwargs)


def forked_and_alone(llm, prompt: list[int], n: int, seed: int, max_tokens: int) -> tuple[list, list]:
    """One request's ``n`` completions at temperature 1, seeded, and the same ``n`` drawn as separate requests,
    each with its completion's own seed (``completion_seed``): equal when forking shares the prompt right."""
    from kvpaging.engine.row_sampling import completion_seed

    def params(**kwargs) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)

    together = [c.token_ids for c in llm.generate([prompt], params(n=n, seed=seed), use_tqdm=False)[0].outputs]
    alone = [llm.generate([prompt], params(seed=completion_seed(seed, i)), use_tqdm=False)[0].outputs[0].token_ids
             for i in range(n)]
    return together, alone


def build_llm(model, **kwargs) -> LLM:
    """An LLM with a small explicit pool (the default max_model_len, 4096, would need a big one)."""
    settings = {"block_size": 4, "num_blocks": 64, "max_model_len": 64}
    settings.update(kwargs)
    return LLM(model, **settings)


def assert_pool_clean(engine) -> None:
    """Nothing left running, every block free, and the block manager's books balance."""
    engine = getattr(engine, "engine", engine)
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    stats = engine.block_manager.stats()
    assert stats.num_used_blocks == 0, f"{stats.num_used_blocks} blocks still in use"
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_sequences == 0
    check_block_manager(engine.block_manager)
    check_scheduler(engine.scheduler)


def assert_consistent(engine) -> None:
    """Between two steps, the scheduler's and the block manager's books agree.

    A running sequence holds slots for exactly the tokens whose KV is computed, and
    its newest token (sampled, or a prompt token still to come) is not computed yet.
    """
    check_block_manager(engine.block_manager)
    check_scheduler(engine.scheduler)
    for seq in engine.scheduler.running:
        assert engine.block_manager.get_num_tokens(seq.seq_id) == seq.num_computed_tokens, (
            f"sequence {seq.seq_id}: {engine.block_manager.get_num_tokens(seq.seq_id)} slots "
            f"for {seq.num_computed_tokens} computed tokens"
        )
        assert seq.num_computed_tokens < len(seq.token_ids)


def run_engine(engine, max_steps: int = 10_000, check: bool = False) -> dict:
    """Step until idle; return the last output of every request that finished, by request id.

    With ``check``, the books are checked after every step.
    """
    finished = {}
    for _ in range(max_steps):
        if check:
            assert_consistent(engine)
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, f"{out.request_id} reported finished twice"
                finished[out.request_id] = out
    raise AssertionError(f"engine still busy after {max_steps} steps")
