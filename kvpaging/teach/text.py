"""Real text and real chat prompts for the lessons, with nothing to download.

* ``real_text()``: English prose written by people, from the Python documentation
  that every Python installation carries (the language reference's topics in
  ``pydoc_data.topics``, what ``help("assignment")`` prints). Used where a lesson
  measures a model on text it did not write itself (teacher-forced FP8 accuracy).
* ``QUESTIONS``: short, ordinary questions for the trained chat model, whose
  answers end at different, natural lengths.
* ``chat_ids()``: a conversation as the token ids the model was trained on
  (its chat template), ready for ``LLM.generate`` or ``engine.add_request``.
"""

from __future__ import annotations

__all__ = ["real_text", "QUESTIONS", "SYSTEM_PROMPT", "chat_ids", "chat_text"]

# Ordinary questions: some answered in a sentence, some in a paragraph.
QUESTIONS = (
    "What is the capital of France?",
    "Explain why the sky is blue.",
    "What is 12 times 12?",
    "Write a haiku about autumn.",
    "List three uses of a paperclip.",
    "Who wrote Romeo and Juliet?",
    "Describe how a bicycle works.",
    "What is the boiling point of water in Celsius?",
    "Give me a tip for sleeping better.",
    "What is photosynthesis?",
    "Name the planets of the solar system.",
    "Translate 'good morning' into Spanish.",
    "Why do cats purr?",
    "Write one sentence about the ocean.",
    "What is a prime number?",
    "Suggest a name for a pet turtle.",
)

# A real, fairly long system prompt, as a deployed assistant would have: shared by every chat.
SYSTEM_PROMPT = (
    "You are Ada, the helpful assistant of the city library. You answer questions from visitors "
    "politely and briefly. You know the opening hours: Monday to Friday from nine in the morning "
    "to eight in the evening, Saturday from ten to four, closed on Sunday. Visitors can borrow up "
    "to ten books for three weeks, renew them twice online, and use the reading room, the computers "
    "and the printers on the second floor. Children's books are on the ground floor. If you do not "
    "know the answer, say so and suggest asking the staff at the front desk."
)


def real_text(min_chars: int = 20_000) -> str:
    """At least ``min_chars`` characters of English prose from Python's own documentation, always the same."""
    from pydoc_data.topics import topics

    parts, total = [], 0
    for name in sorted(topics):
        text = topics[name]
        parts.append(text)
        total += len(text)
        if total >= min_chars:
            break
    return "\n\n".join(parts)


def chat_text(tokenizer, question: str, system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def chat_ids(tokenizer, question: str, system: str | None = None) -> list[int]:
    """The token ids of a one-question chat (the chat template already holds the special tokens)."""
    return tokenizer(chat_text(tokenizer, question, system), add_special_tokens=False)["input_ids"]
