"""The worker: the model, its paged KV cache and one forward per step.

``model_runner`` (owns the cache tensors, prepares a step's inputs, runs the model), ``attention`` (the
function transformers calls through ``AttentionInterface``; ``unpaged_attention`` its calls outside a step),
``sampler``, ``cuda_graphs``, ``kv_layout`` (the model's key/value shapes, measured), ``self_check`` (the
load-time check that the paged path gives the model's own logits) and ``kv_accuracy`` (what an FP8 cache
costs, teacher-forced).
"""
