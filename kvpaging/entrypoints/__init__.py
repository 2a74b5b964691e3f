"""How users reach the engine: ``llm`` (the offline ``LLM`` class), ``serve`` (the OpenAI-compatible
server) and ``cli`` (the ``kvpaging`` command).
"""
