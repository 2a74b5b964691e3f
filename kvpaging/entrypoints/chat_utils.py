"""``LLM.chat``'s conversations: checked, and each turned into its prompt through the tokenizer's chat template (vLLM
keeps the same in ``vllm/entrypoints/chat_utils.py``). nano-vllm's ``LLM`` has no ``chat``.
"""

from __future__ import annotations

__all__ = ["chat_prompt", "conversations"]


def conversations(messages) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them, as a list of conversations."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of messages or of conversations, got {messages!r}")
    found = [messages] if isinstance(messages[0], dict) else list(messages)
    for conversation in found:
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError(f"a conversation must be a non-empty list of messages, got {conversation!r}")
        for message in conversation:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"a message must be a dict with 'role' and 'content', got {message!r}")
    return [list(c) for c in found]


def chat_prompt(tokenizer, conversation: list[dict], chat_template: str | None, add_generation_prompt: bool,
                continue_final_message: bool, kwargs: dict) -> dict:
    """One conversation as the prompt the model was trained on: the tokenizer's chat template (or ``chat_template``)
    applied, then tokenized without adding special tokens again (the template wrote them)."""
    if tokenizer is None:
        raise ValueError("LLM.chat needs a tokenizer with a chat template, and this model has none")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: pass chat_template=..., or use LLM.generate")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
    text = tokenizer.apply_chat_template(
        conversation, chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, **kwargs,
    )
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}
