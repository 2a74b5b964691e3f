"""``LLM``: the offline-inference front door, shaped like vLLM's.

    from kvpaging import LLM, SamplingParams
    from kvpaging.models import tiny

    llm = LLM(tiny("qwen3"), num_blocks=256)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8, temperature=0.0))
    outs[0].outputs[0].token_ids

    llm = LLM("smollm2")                   # the shipped trained chat model: text in, text out
    llm.chat([{"role": "user", "content": "What is the capital of France?"}])[0].outputs[0].text
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvpaging.config import EngineConfig
from kvpaging.entrypoints.chat_utils import chat_prompt, conversations
from kvpaging.engine.llm_engine import LLMEngine
from kvpaging.engine.outputs import RequestOutput
from kvpaging.models import load_model, load_tokenizer
from kvpaging.sampling_params import SamplingParams

logger = logging.getLogger("kvpaging")

__all__ = ["LLM"]


class LLM:
    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        scheduling: str = "continuous",
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        trust_remote_code: bool = False,
        cpu_fast_layers: bool | None = None,
        tensor_parallel_size: int = 1,
        self_check: bool = True,
        max_logprobs: int = 20,
    ) -> None:
        """Load ``model`` (a model object, a local folder, a hub id, or "smollm2") and start an engine on it.

        The settings are ``EngineConfig``'s (kvpaging/config.py), checked before the
        model is loaded. A model object passed in is never changed: the engine runs
        a private copy that shares its weights (converted, with ``dtype``/``device``).
        """
        # every setting is checked before anything is loaded (EngineConfig, kvpaging/config.py)
        config = EngineConfig(
            block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, scheduling=scheduling, attention_backend=attention_backend,
            kv_cache_dtype=kv_cache_dtype, enforce_eager=enforce_eager, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_memory_bytes,
            cpu_fast_layers=cpu_fast_layers, tensor_parallel_size=tensor_parallel_size, self_check=self_check,
            max_logprobs=max_logprobs,
        )
        # a model object stays the user's: with dtype or device, the engine gets a converted copy
        model = load_model(model, dtype=_torch_dtype(dtype), device=device, trust_remote_code=trust_remote_code)
        if tokenizer is None:
            tokenizer = load_tokenizer(model, trust_remote_code=trust_remote_code)
        self.engine = LLMEngine(model, tokenizer, config=config)

    def shutdown(self) -> None:
        """Stop the engine's worker processes (``tensor_parallel_size > 1``); a no-op otherwise.
        Dropping the ``LLM``, or leaving the interpreter, does the same."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block that no running sequence uses; returns how many were forgotten."""
        return self.engine.reset_prefix_cache()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The tokenizer (vLLM's name), or None for a model served on token ids only."""
        return self.engine.tokenizer

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them, as vLLM's ``LLM.chat`` does.

        A conversation is a list of ``{"role": ..., "content": ...}`` messages. The
        tokenizer's chat template turns each into the prompt text the model was
        trained on (``<|im_start|>user ...<|im_end|>`` for SmolLM2), ending with the
        assistant's turn opened (``add_generation_prompt``); that text is tokenized
        without adding special tokens again, since the template already wrote them.
        """
        prompts = [  # (kvpaging/entrypoints/chat_utils.py)
            chat_prompt(self.engine.tokenizer, conversation, chat_template, add_generation_prompt,
                        continue_final_message, chat_template_kwargs or {})
            for conversation in conversations(messages)
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion and return their outputs in the order given.

        Every prompt is checked before any is queued: a bad one leaves the engine untouched.
        The engine must be idle (no request added by hand still unfinished). If requests
        failed in the model's forward pass, ``RequestFailedError`` is raised once the
        batch is done, with every output attached (see ``LLMEngine.run_batch``).
        """
        if not use_tqdm:
            return self.engine.run_batch(prompts, sampling_params, prefix="gen-")
        from kvpaging.progress import progress_bar

        bar = None

        def start_bar(request_ids: list[str]) -> None:  # once the batch is checked and queued
            nonlocal bar
            bar = progress_bar(total=len(request_ids), desc="Processed prompts", unit="req")

        try:
            return self.engine.run_batch(prompts, sampling_params, prefix="gen-", on_added=start_bar,
                                         on_finish=lambda _output: bar.update(1))
        finally:
            if bar is not None:
                bar.close()


def _torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a torch dtype: a name ("bfloat16") is looked up, "auto" and None keep the model's."""
    if isinstance(dtype, str):
        dtype = None if dtype == "auto" else getattr(torch, dtype, dtype)
    if not isinstance(dtype, (torch.dtype, type(None))):
        raise ValueError(f"dtype must be a torch dtype, its name or 'auto', got {dtype!r}")
    return dtype
