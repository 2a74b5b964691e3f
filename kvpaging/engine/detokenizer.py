"""Turning a completion's token ids into text as they arrive, and finding stop strings in it.

Decoding one token at a time and gluing the pieces together is wrong in two ways:

* a character may take several tokens: byte-level BPE (GPT-2, Llama 3, SmolLM2)
  splits "🎉" into four byte tokens, and each alone decodes to the replacement
  character "\\ufffd";
* some tokenizers decode a token differently depending on what comes before it
  (SentencePiece drops the space of a word that starts the text).

So each step decodes a small window of recent tokens twice, with and without
the new ones, and keeps the difference. The window starts where the previous
committed piece started (``prefix_offset``), so the new tokens are decoded in
context. When the new text ends in "\\ufffd", a character is still incomplete:
nothing is committed until the next token completes it. This is the scheme
vLLM and Hugging Face's ``TextStreamer`` use. At the end, the text is checked
against one decode of all the tokens, which is what the finished output holds.

Stop strings (``SamplingParams.stop``) are searched in the new text plus the
last ``len(stop) - 1`` characters before it, so a stop string that spans two
tokens is found. As in vLLM, the output text ends just before the stop string
(or just after it, with ``include_stop_str_in_output``); the token ids keep
every generated token. While a request runs, the text it shows holds back its
last ``len(longest stop) - 1`` characters, which might be the start of a stop
string and later be cut: streamed text never shrinks.
"""

from __future__ import annotations

__all__ = ["IncrementalDetokenizer"]

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """The text of one completion, kept up to date from its output token ids."""

    __slots__ = ("tokenizer", "skip_special_tokens", "stop", "include_stop", "hold_back", "text", "stop_reason",
                 "_prefix_offset", "_read_offset", "_searched")

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        # characters a running completion keeps back: the start of a stop string that may yet be cut
        self.hold_back = 0 if include_stop_str_in_output or not stop else max(len(s) for s in stop) - 1
        self.text = ""  # committed text (cut at the stop string once one is found)
        self.stop_reason: str | None = None  # the stop string that ended the completion
        self._prefix_offset = 0  # first token of the decode window
        self._read_offset = 0  # tokens up to here are in ``text``
        self._searched = 0  # characters of ``text`` already searched for stop strings

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, output_token_ids: list[int], search: bool = True) -> str | None:
        """Take the completion's tokens so far (all of them; only the new ones are decoded).

        Returns the stop string found in the text, or None. After a stop string
        is found, later calls change nothing.
        """
        if self.stop_reason is not None or len(output_token_ids) <= self._read_offset:
            return self.stop_reason
        window = output_token_ids[self._prefix_offset:]
        prefix_text = self._decode(output_token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return None  # a special token skipped, or a character not complete yet: wait for more tokens
        self.text += new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(output_token_ids)
        if self.stop:
            if not search:  # (min_tokens not reached) this text is never searched, as in vLLM
                self._searched = len(self.text)
                return None
            return self._find_stop()
        return None

    def _find_stop(self) -> str | None:
        """Cut the text at the earliest stop string that starts in the unsearched part."""
        longest = max(len(s) for s in self.stop)
        begin = max(0, self._searched - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, begin)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        self._searched = len(self.text)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stop_reason = s
        return s

    def finish(self, output_token_ids: list[int]) -> str:
        """The final text of a finished completion.

        Without a stop string, that is one decode of all its tokens (the streamed
        text is always a prefix of it for the tokenizers we know; if some tokenizer
        disagreed, the full decode wins). With one, the text cut at the stop string.
        """
        if self.stop_reason is None:
            self.update(output_token_ids)
        if self.stop_reason is None:
            self.text = self._decode(output_token_ids)
            self._prefix_offset = self._read_offset = len(output_token_ids)
            self._searched = len(self.text)
        return self.text

    def visible_text(self) -> str:
        """The text a running completion shows: all but what might still be cut at a stop string."""
        if self.hold_back and self.stop_reason is None:
            return self.text[: max(0, len(self.text) - self.hold_back)]
        return self.text
