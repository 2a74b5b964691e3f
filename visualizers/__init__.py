"""kvpaging.visualizers: watch the paged KV cache and the scheduler work, step by step.

Every view reads the engine's :class:`~kvpaging.engine.llm_engine.StepRecord` stream and
nothing else, so the same code draws a live engine, a trace in memory, or a
trace saved on another machine::

    from kvpaging import LLM, SamplingParams
    from kvpaging.models import tiny
    from kvpaging.visualizers import Dashboard

    llm = LLM(tiny("qwen3", num_hidden_layers=2), num_blocks=64, block_size=4, max_model_len=256)
    dash = Dashboard(llm)
    outputs = dash.run([[5, 6, 7, 8, 9], [5, 6, 7, 8, 10]], SamplingParams(max_tokens=16))

Views (each works alone, each is a widget, each has ``summary()`` for
terminals, ``to_html(path)`` for a static animation, and ``display_static()``
for the same animation as plotly's notebook output, which a saved notebook
shows with no kernel, untrusted and offline):

    BlockTableView        logical -> physical blocks per sequence; sharing, copy-on-write, prefix hits
    MemoryMapView         the physical pool as a grid: owner, shared, cached, free; tokens per block
    ContiguousMemoryView  the contiguous baseline: runs, holes, refusal despite enough free memory
    BubbleTimeline        batch slots x iterations: static batching's bubbles vs continuous batching
    ThroughputPanel       tokens per step, KV usage, preemptions, TTFT and inter-token latency
    Dashboard             all of them, with Play / Pause / Step and a slider, live or replayed

The drawing logic lives in pure functions (records in, arrays out), tested
without a browser: ``memory_map_frame``, ``block_table_frame``,
``contiguous_frame``, ``bubble_frame``, ``throughput_series``,
``simulate_static_batching`` / ``simulate_continuous_batching``.

Traces: ``save_trace`` / ``load_trace`` (JSON, exact round trip) and
``save_chrome_trace`` (open in https://ui.perfetto.dev). Small hand-written
traces with known answers, for lessons and tests: ``kvpaging.visualizers.examples``.

What a step record does not say, the replay (``replay.py``) and the latency
tracker (``throughput.py``) work out: the tokens in each block, reference
counts, which free blocks still hold cached KV, prefix-cache hits at
admission, the parent of a forked sequence, and which steps produced a token.
Where records carry ``seq_num_tokens``, ``forked``, ``sampled``, ``arrivals``
and ``finished_block_tables`` (newer engines), it takes them as given, so older
traces and newer ones both replay. The last one closes what used to be a gap: a
request admitted and finished within a single step is never among the running
tables, so without the tables of the sequences that finished in the step, the
blocks it leaves in the prefix cache could not be named.

Timing (``python -m kvpaging.visualizers.bench``): on the 2-core CPU
development machine, with a 4,096-block pool and 256 running sequences, the
pure functions take under a millisecond a frame and a whole widget redraw
2-12 ms, well under the 50 ms budget.
"""

from kvpaging.visualizers.base import LiveFeed, PlaybackControls, TraceView, View, presentation
from kvpaging.visualizers.batching import (
    ARTICLE_OUTPUT_LENGTHS,
    EngineSlots,
    SlotTimeline,
    article_example,
    simulate_batching,
    simulate_continuous_batching,
    simulate_static_batching,
    slot_timeline_from_trace,
)
from kvpaging.visualizers.block_table import BlockTableFrame, BlockTableView, block_table_frame
from kvpaging.visualizers.bubbles import BubbleFrame, BubbleTimeline, bubble_frame
from kvpaging.visualizers.contiguous_view import (
    ContiguousFrame,
    ContiguousMemoryView,
    ContiguousTraceSim,
    contiguous_frame,
    fragmentation_refusals,
)
from kvpaging.visualizers.dashboard import Dashboard
from kvpaging.visualizers.memory_map import MemoryMapFrame, MemoryMapView, memory_map_frame, pool_figures
from kvpaging.visualizers.replay import DerivedStep, PoolArrays, TraceReplay, infer_block_size, pool_arrays
from kvpaging.visualizers.throughput import LatencyTracker, RequestLatency, ThroughputPanel, request_latencies, throughput_series
from kvpaging.visualizers.static import display_figure, figure_bundle, fix_axis_ranges
from kvpaging.visualizers.trace_io import Trace, load_trace, save_chrome_trace, save_trace, to_chrome_trace

__all__ = [
    "ARTICLE_OUTPUT_LENGTHS",
    "BlockTableFrame",
    "BlockTableView",
    "BubbleFrame",
    "BubbleTimeline",
    "ContiguousFrame",
    "ContiguousMemoryView",
    "ContiguousTraceSim",
    "Dashboard",
    "DerivedStep",
    "EngineSlots",
    "LatencyTracker",
    "LiveFeed",
    "MemoryMapFrame",
    "MemoryMapView",
    "PlaybackControls",
    "PoolArrays",
    "RequestLatency",
    "SlotTimeline",
    "ThroughputPanel",
    "Trace",
    "TraceReplay",
    "TraceView",
    "View",
    "article_example",
    "block_table_frame",
    "bubble_frame",
    "contiguous_frame",
    "display_figure",
    "figure_bundle",
    "fix_axis_ranges",
    "fragmentation_refusals",
    "infer_block_size",
    "load_trace",
    "memory_map_frame",
    "pool_arrays",
    "pool_figures",
    "presentation",
    "request_latencies",
    "save_chrome_trace",
    "save_trace",
    "simulate_batching",
    "simulate_continuous_batching",
    "simulate_static_batching",
    "slot_timeline_from_trace",
    "throughput_series",
    "to_chrome_trace",
]
