"""Structured outputs: text that must follow a JSON schema, a regular expression, a grammar or a list of choices.

At every step a request with ``SamplingParams(structured_outputs=...)`` may only choose tokens
that keep its text a prefix of something the grammar accepts. A *matcher* per completion
follows the grammar token by token; before sampling, it says which tokens are allowed
(a bitmask over the vocabulary, one bit per token), and every other token's logit becomes
-inf; after sampling, the chosen token is fed to it. When the grammar is complete, only the
end-of-sequence token is allowed, so the completion ends there.

The matching is done by llguidance (``pip install llguidance``; a Rust library, no other
dependencies, a CPU wheel for every platform): it works the mask out lazily from the grammar
and the tokenizer's byte strings, so a new JSON schema needs no compile step. xgrammar (vLLM's default)
needs the grammar compiled per schema and pulls in torch-version-sensitive extensions;
outlines-core builds a full index per regex up front. vLLM supports llguidance as its
``guidance`` backend, so the grammars mean the same there.

The mask is applied first, before ``allowed_token_ids``, penalties and the rest, as vLLM
applies its grammar bitmask before the sampler; logprobs stay the raw model's.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import numpy as np

__all__ = ["StructuredOutputsParams", "GrammarCompiler", "advance_grammars"]


@dataclass(frozen=True, eq=False)  # compared by identity: the compiler remembers each one's grammar
class StructuredOutputsParams:
    """What a request's text must follow (vLLM's ``StructuredOutputsParams``): exactly one of

    json: a JSON schema (a dict, or its JSON text);
    regex: a regular expression (Rust ``regex`` syntax, as llguidance reads it);
    choice: a list of strings, one of which is the whole text;
    grammar: a Lark grammar (llguidance's dialect);
    json_object: True for any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object is not False:
            if self.json_object is not True:
                raise ValueError(f"json_object must be True or False, got {self.json_object!r}")
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar or json_object, "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"json must be a JSON schema (a dict or its text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")

    def to_grammar(self) -> str:
        """llguidance's grammar for it (not yet checked against a tokenizer: ``GrammarCompiler.check`` does)."""
        from llguidance import LLMatcher

        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as error:
                    raise ValueError(f"json is not valid JSON: {error}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            return LLMatcher.grammar_from_json_schema(schema)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # each choice a Lark string literal (JSON's escaping is Lark's)
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


class GrammarCompiler:
    """The engine's link to llguidance: its view of the tokenizer (made once, ~0.5 s), grammar checks,
    and a matcher per completion."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer = None
        # each params' checked grammar: intake checks every request of a batch, then queues them
        self._compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            try:
                import llguidance.hf
            except ImportError:
                raise ValueError("structured outputs need llguidance: pip install llguidance") from None
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size)
            except ValueError as error:
                raise ValueError(f"structured outputs need a fast (Rust) tokenizer: {error}") from None
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The request's grammar, checked against this tokenizer: a ValueError names what is wrong."""
        from llguidance import LLMatcher

        grammar = self._compiled.get(params)
        if grammar is None:
            grammar = params.to_grammar()
            problem = LLMatcher.validate_grammar(grammar, self.tokenizer)
            if problem:
                raise ValueError(f"structured_outputs: {problem}")
            self._compiled[params] = grammar
        return grammar

    def matcher(self, grammar: str):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        return matcher


def allowed_tokens(matcher, vocab_size: int) -> np.ndarray:
    """The matcher's bitmask (little-endian 32-bit words, one bit per token) as one bool per token."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed = np.zeros(vocab_size, dtype=bool)
    n = min(vocab_size, bits.size)
    allowed[:n] = bits[:n].astype(bool)
    return allowed


def advance_grammars(samples: list, token_ids: list[int], failed: dict | None) -> dict | None:
    """Feed each structured completion's new token to its matcher; a token it refuses fails that request."""
    for k, seq in enumerate(samples):
        matcher = seq.matcher
        if matcher is None or (failed and k in failed) or matcher.is_stopped():
            continue  # (a finished grammar allows only EOS, which needs no feeding)
        if not matcher.consume_token(token_ids[k]):
            failed = dict(failed or {})
            failed[k] = ValueError(f"structured_outputs: token {token_ids[k]} breaks the grammar: "
                                   f"{matcher.get_error()}")
    return failed
