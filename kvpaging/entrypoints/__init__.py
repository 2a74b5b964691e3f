"""How users reach the engine: ``llm`` (the offline ``LLM`` class; ``chat_utils`` its conversations), ``serve``
(the OpenAI-compatible server) and ``cli`` (the ``kvpaging`` command).
"""
