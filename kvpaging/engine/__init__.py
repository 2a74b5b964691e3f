"""The engine loop and everything around a request's life: ``llm_engine`` (add, step, abort), ``input_processor``
(prompts and parameters checked and tokenized), ``row_sampling`` (seeded generators, a bad row failing alone),
``outputs`` and ``detokenizer`` (what the user gets back), ``step_record`` (what each step did, for the
views), ``async_llm`` (the asyncio front the server uses) and ``structured_outputs`` (grammar-constrained
decoding).
"""
