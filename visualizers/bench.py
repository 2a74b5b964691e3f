"""How long one frame of each view takes on a big pool: ``python -m kvpaging.visualizers.bench``.

The budget is 50 ms a frame, so that a live view can redraw a few times a
second without holding the engine back. The trace is synthetic (no model
runs): ``num_seqs`` sequences, half of them sharing a prefix, all decoding
together in a pool of ``num_blocks`` blocks, so the numbers measure drawing
only. Measured on the 2-core CPU development machine (4,096 blocks of 16
slots, 256 sequences, 40 steps; medians of 20 frames):

    pure function (arrays only)         whole widget redraw (arrays + FigureWidget update)
    memory_map_frame       0.2 ms       MemoryMapView      6 ms
    block_table_frame      0.4 ms       BlockTableView     2 ms   (one page of 24 sequences)
    bubble_frame           0.1 ms       BubbleTimeline     8 ms
    throughput_series     <0.1 ms       ThroughputPanel   12 ms
    contiguous_frame       0.3 ms       ContiguousMemoryView 7 ms

Replaying the trace (done once per record, also live) costs about 0.2 ms a
step. Rerun the module for this machine's figures. Sending the update to the
browser and drawing it there comes on top and depends on the browser.
"""

from __future__ import annotations

import statistics
import time

from kvpaging.engine.llm_engine import ScheduledEntry, StepRecord

__all__ = ["synthetic_trace", "time_frames", "time_widget_redraws", "main"]


def synthetic_trace(num_blocks: int = 4096, block_size: int = 16, num_seqs: int = 256, prompt_len: int = 100,
                    num_steps: int = 40, shared_prefix_blocks: int = 4) -> list[StepRecord]:
    """A consistent trace without a model: all sequences admitted at step 1, then one decode token per step.

    Odd sequences reuse the first sequence's leading ``shared_prefix_blocks``
    blocks (as prefix-cache hits would), so the pool has shared blocks too.
    """
    free = list(range(num_blocks))
    tables: dict[int, list[int]] = {}
    lengths: dict[int, int] = {}
    records = []
    t = 0.0
    for step in range(1, num_steps + 1):
        scheduled = []
        for sid in range(num_seqs):
            if step == 1:
                hits = shared_prefix_blocks if sid % 2 and sid > 0 else 0
                prefix = tables[0][:hits] if hits else []
                own = -(-(prompt_len - hits * block_size) // block_size)
                tables[sid] = prefix + [free.pop(0) for _ in range(own)]
                lengths[sid] = prompt_len
                scheduled.append(ScheduledEntry(f"req-{sid}", sid, 0, prompt_len - hits * block_size, True))
            else:
                if lengths[sid] % block_size == 0:
                    tables[sid].append(free.pop(0))
                lengths[sid] += 1
                scheduled.append(ScheduledEntry(f"req-{sid}", sid, 0, 1, False))
        used = {b for table in tables.values() for b in table}
        fill = {}
        for sid, table in tables.items():
            for i, b in enumerate(table):
                fill[b] = min(block_size, lengths[sid] - i * block_size)
        records.append(StepRecord(
            step=step, start_time=t, wall_time=0.01, scheduled=tuple(scheduled),
            num_batched_tokens=sum(e.num_tokens for e in scheduled), preempted=(), finished=(), blocks_copied=(),
            num_free_blocks=num_blocks - len(used), num_used_blocks=len(used), num_cached_blocks=0,
            num_tokens_stored=sum(fill.values()), num_waiting=0, num_running=num_seqs,
            block_tables={sid: tuple(table) for sid, table in tables.items()},
        ))
        t += 0.01
    return records


def time_frames(records: list[StepRecord] | None = None, block_size: int = 16, repeats: int = 20) -> dict[str, float]:
    """Median seconds per frame of each view's pure function, at the last step of ``records``."""
    from kvpaging.visualizers.batching import EngineSlots
    from kvpaging.visualizers.block_table import block_table_frame
    from kvpaging.visualizers.bubbles import bubble_frame
    from kvpaging.visualizers.contiguous_view import ContiguousTraceSim, contiguous_frame
    from kvpaging.visualizers.memory_map import memory_map_frame
    from kvpaging.visualizers.replay import TraceReplay
    from kvpaging.visualizers.throughput import throughput_series

    records = records if records is not None else synthetic_trace(block_size=block_size)
    replay = TraceReplay(records, block_size=block_size)
    last = len(replay) - 1
    slots = EngineSlots()
    for r in records:
        slots.append(r)
    timeline = slots.timeline()
    sim = ContiguousTraceSim(replay, reserve_tokens=256)
    sim.sync()
    work = {
        "memory_map_frame": lambda: memory_map_frame(replay, last),
        "block_table_frame": lambda: block_table_frame(replay, last),
        "bubble_frame": lambda: bubble_frame(timeline, last),
        "throughput_series": lambda: throughput_series(replay, last),
        "contiguous_frame": lambda: contiguous_frame(sim.steps, last),
    }
    result = {}
    for name, fn in work.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        result[name] = statistics.median(times)
    return result


def time_widget_redraws(records: list[StepRecord], block_size: int = 16, repeats: int = 20) -> dict[str, float]:
    """Median seconds for ``view.show(position)`` with the FigureWidget built (needs the notebook extras)."""
    from kvpaging.visualizers.block_table import BlockTableView
    from kvpaging.visualizers.bubbles import BubbleTimeline
    from kvpaging.visualizers.contiguous_view import ContiguousMemoryView
    from kvpaging.visualizers.memory_map import MemoryMapView
    from kvpaging.visualizers.throughput import ThroughputPanel

    views = {
        "MemoryMapView": MemoryMapView(records, block_size=block_size),
        "BlockTableView": BlockTableView(records, block_size=block_size),
        "BubbleTimeline": BubbleTimeline(records, block_size=block_size),
        "ThroughputPanel": ThroughputPanel(records, block_size=block_size),
        "ContiguousMemoryView": ContiguousMemoryView.from_trace(records, block_size=block_size, reserve_tokens=256),
    }
    result = {}
    for name, view in views.items():
        view.figure  # noqa: B018 - build the widget first; only redraws are timed
        times = []
        for i in range(repeats):
            start = time.perf_counter()
            view.show(i % len(records))
            times.append(time.perf_counter() - start)
        result[name] = statistics.median(times)
    return result


def main() -> None:
    records = synthetic_trace()
    start = time.perf_counter()
    from kvpaging.visualizers.replay import TraceReplay

    TraceReplay(records, block_size=16)
    replay_time = time.perf_counter() - start
    print(f"synthetic trace: 4096 blocks x 16 slots, 256 sequences, {len(records)} steps")
    print(f"  replaying the whole trace: {replay_time * 1e3:.1f} ms ({replay_time / len(records) * 1e3:.2f} ms a step)")
    for name, seconds in time_frames(records).items():
        print(f"  {name:<22} {seconds * 1e3:7.2f} ms a frame (pure function)")
    try:
        redraws = time_widget_redraws(records)
    except ImportError as error:
        print(f"  (widget redraws not timed: {error})")
        return
    for name, seconds in redraws.items():
        print(f"  {name:<22} {seconds * 1e3:7.2f} ms a redraw (widget)")


if __name__ == "__main__":
    main()
