"""ThroughputPanel: tokens per step, KV usage over time, TTFT and inter-token latency per request.

Four small plots that answer "is the engine busy, and who pays for it?":

- **tokens per step**, prefill (prompt chunks) stacked on decode: a full
  batch of decodes is a flat line, a new prompt is a spike;
- **KV cache usage** (blocks in use / all blocks), with the steps that had to
  *preempt* a sequence marked in red: the pool was full;
- **TTFT** per request: time to first token;
- **inter-token latency** per request: median gap between its tokens, the bar
  reaching up to the 90th percentile.

Latencies come from ``RequestOutput.metrics`` when given, or from the step
records. Both measure TTFT from the request's arrival, as vLLM reports it,
except for traces from engines that did not record arrivals: there it runs
from the step that first scheduled the request; the title says which.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpaging.visualizers.base import SMALL, TraceView
from kvpaging.visualizers.replay import TraceReplay

__all__ = ["ThroughputPanel", "throughput_series", "RequestLatency", "LatencyTracker", "request_latencies"]


def throughput_series(replay: TraceReplay, upto: int | None = None) -> dict[str, np.ndarray]:
    """Per-step arrays for steps ``0..upto`` (pure: slices of the replay's columns)."""
    end = len(replay) if upto is None else upto + 1
    col = lambda name: replay.column(name)[:end]  # noqa: E731
    step = col("step")
    used = col("num_used_blocks")
    total = used + col("num_free_blocks")
    preempted = col("num_preempted")
    return {
        "step": step,
        "prefill_tokens": col("prefill_tokens"),
        "decode_tokens": col("decode_tokens"),
        "kv_usage": np.divide(used, total, out=np.zeros(len(used)), where=total > 0),
        "num_running": col("num_running"),
        "num_waiting": col("num_waiting"),
        "wall_time": col("wall_time"),
        "preempt_steps": step[preempted > 0],
        "preempt_counts": preempted[preempted > 0],
    }


@dataclass(frozen=True)
class RequestLatency:
    request_id: str
    ttft: float | None  # seconds
    itl_median: float | None
    itl_p90: float | None
    num_tokens: int
    from_arrival: bool  # True: measured from arrival (RequestMetrics); False: from first scheduling


class LatencyTracker:
    """When each request got its tokens, read from step records one at a time.

    Records from newer engines list the sequences that got a token
    (``sampled``) and when each request arrived (``arrivals``); then both are
    exact. Otherwise they are worked out: a decode entry always yields a token;
    a prefill entry yields one only if it was the prompt's last chunk, which
    shows one step later (the sequence's next entry is a decode, or it finished
    in that very step), so a prefill's token stays pending until then. Without
    arrival times, TTFT is measured from the step that first scheduled the request.
    """

    def __init__(self) -> None:
        self.arrivals: dict[str, float] = {}
        self.first_scheduled: dict[str, float] = {}
        self.first_position: dict[str, int] = {}
        self._sampled_recorded = False  # seen a record that lists its sampled sequences
        self.token_times: dict[str, list[tuple[int, float]]] = {}  # request -> [(position, time)] of completion 0
        self._pending: dict[int, tuple[int, float]] = {}  # seq id -> (position, time) of a prefill that may sample
        self.num_records = 0

    def append(self, record) -> None:
        position = self.num_records
        self.num_records += 1
        end = record.start_time + record.wall_time
        finished = set(record.finished)
        self.arrivals.update(getattr(record, "arrivals", None) or {})
        sampled = getattr(record, "sampled", ())
        self._sampled_recorded = self._sampled_recorded or bool(sampled)
        sampled = set(sampled)
        for e in record.scheduled:
            self.first_scheduled.setdefault(e.request_id, record.start_time)
            self.first_position.setdefault(e.request_id, position)
            times = self.token_times.setdefault(e.request_id, [])
            pending = self._pending.pop(e.seq_id, None)
            if e.index != 0:
                continue
            if self._sampled_recorded:
                if e.seq_id in sampled:
                    times.append((position, end))
            elif e.is_prefill:
                if e.seq_id in finished:
                    times.append((position, end))
                else:
                    self._pending[e.seq_id] = (position, end)
            else:
                if pending is not None:
                    times.append(pending)
                times.append((position, end))

    def latencies(self, upto: int | None = None) -> list[RequestLatency]:
        result = []
        for rid, times in self.token_times.items():
            if upto is not None and self.first_position[rid] > upto:
                continue  # not scheduled yet at that step
            t = [time for pos, time in times if upto is None or pos <= upto]
            from_arrival = rid in self.arrivals
            start = self.arrivals[rid] if from_arrival else self.first_scheduled[rid]
            ttft = t[0] - start if t else None
            gaps = np.diff(t) if len(t) > 1 else np.zeros(0)
            result.append(RequestLatency(
                rid, ttft,
                float(np.median(gaps)) if gaps.size else None,
                float(np.percentile(gaps, 90)) if gaps.size else None,
                len(t), from_arrival,
            ))
        return result


def request_latencies(records, metrics: dict | None = None) -> list[RequestLatency]:
    """TTFT and inter-token latency per request: from ``metrics`` (request id -> RequestMetrics) when
    given, else from the step records (see :class:`LatencyTracker`)."""
    if metrics:
        out = []
        for rid, m in metrics.items():
            gaps = np.asarray(m.inter_token_latencies)
            out.append(RequestLatency(
                rid, m.time_to_first_token,
                float(np.median(gaps)) if gaps.size else None,
                float(np.percentile(gaps, 90)) if gaps.size else None,
                len(m.token_times), True,
            ))
        return out
    tracker = LatencyTracker()
    for r in records:
        tracker.append(r)
    return tracker.latencies()


def _ms(values) -> np.ndarray:
    return np.array([np.nan if v is None else v * 1e3 for v in values], dtype=np.float64)


class ThroughputPanel(TraceView):
    """Throughput and latency plots of a trace; ``metrics`` (request id -> RequestMetrics) is optional."""

    height = 520

    def __init__(self, trace=None, *, block_size: int | None = None, metrics: dict | None = None,
                 controls: bool = True, interval_ms: int | None = None, width: int | None = None) -> None:
        super().__init__(trace, block_size=block_size, controls=controls, interval_ms=interval_ms, width=width)
        self.metrics = dict(metrics) if metrics else {}
        self.tracker = LatencyTracker()
        self.sync()

    def default_position(self) -> int:
        """The last step: the panel draws the whole run up to its position."""
        return max(len(self.replay) - 1, 0)

    def sync(self) -> None:
        for record in self.replay.records[self.tracker.num_records:]:
            self.tracker.append(record)

    def set_metrics(self, metrics: dict) -> None:
        """Use exact per-request metrics (e.g. after a run finished) instead of trace-derived ones."""
        self.metrics = dict(metrics)
        self.redraw()

    def latencies(self, position: int) -> list[RequestLatency]:
        if self.metrics and position >= len(self.replay) - 1:
            return request_latencies((), self.metrics)
        return self.tracker.latencies(position)

    def base_figure(self):
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        fig = make_subplots(rows=2, cols=2, vertical_spacing=0.2, horizontal_spacing=0.1, subplot_titles=(
            "tokens per step", "KV cache usage", "time to first token per request", "inter-token latency per request"))
        fig.add_trace(go.Bar(x=[], y=[], name="decode tokens", marker_color="#1f77b4"), row=1, col=1)
        fig.add_trace(go.Bar(x=[], y=[], name="prefill tokens", marker_color="#ff7f0e"), row=1, col=1)
        fig.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name="KV usage", marker={"size": 4},
                                 line={"color": "#2ca02c"},
                                 hovertemplate="step %{x}: %{y:.0%}<extra></extra>"), row=1, col=2)
        fig.add_trace(go.Scatter(x=[], y=[], mode="markers", name="preemption",
                                 marker={"symbol": "x", "size": 10, "color": "#d62728"},
                                 hovertemplate="step %{x}: %{text} preempted<extra></extra>"), row=1, col=2)
        fig.add_trace(go.Bar(x=[], y=[], name="TTFT", marker_color="#9467bd",
                             hovertemplate="%{x}: %{y:.1f} ms<extra>TTFT</extra>"), row=2, col=1)
        fig.add_trace(go.Bar(x=[], y=[], name="inter-token (median, bar to p90)", marker_color="#17becf",
                             error_y={"type": "data", "symmetric": False, "array": [], "arrayminus": []},
                             hovertemplate="%{x}: %{y:.2f} ms<extra>median gap</extra>"), row=2, col=2)
        fig.update_layout(barmode="stack", height=self.height, margin={"l": 50, "r": 10, "b": 40},
                          title={"text": "Throughput and latency"},
                          legend={"orientation": "h", "y": -0.15}, plot_bgcolor="#fafafa")
        fig.update_yaxes(title_text="tokens", row=1, col=1)
        fig.update_yaxes(title_text="blocks in use", tickformat=".0%", range=[0, 1.05], row=1, col=2)
        fig.update_yaxes(title_text="ms", row=2, col=1)
        fig.update_yaxes(title_text="ms", row=2, col=2)
        fig.update_xaxes(title_text="step", row=1, col=1)
        fig.update_xaxes(title_text="step", row=1, col=2)
        return fig

    def frame(self, position: int) -> tuple[list[dict], dict]:
        s = throughput_series(self.replay, position)
        lat = sorted(self.latencies(position), key=lambda r: self.replay.request_order.get(r.request_id, 0))
        names = [r.request_id for r in lat]
        ttft = _ms(r.ttft for r in lat)
        med = _ms(r.itl_median for r in lat)
        p90 = _ms(r.itl_p90 for r in lat)
        usage = s["kv_usage"]
        pre_y = usage[np.isin(s["step"], s["preempt_steps"])]
        traces = [
            {"x": s["step"], "y": s["decode_tokens"]},
            {"x": s["step"], "y": s["prefill_tokens"]},
            {"x": s["step"], "y": usage},
            {"x": s["preempt_steps"], "y": pre_y, "text": s["preempt_counts"].astype(str)},
            {"x": names, "y": ttft},
            {"x": names, "y": med, "error_y": {"array": np.nan_to_num(p90 - med), "arrayminus": np.zeros(len(med))}},
        ]
        source = "from arrival" if lat and lat[0].from_arrival else "from first scheduled step"
        tokens = int(s["prefill_tokens"].sum() + s["decode_tokens"].sum())
        seconds = float(s["wall_time"].sum())
        title = (f"Throughput and latency up to step {int(s['step'][-1])}" + SMALL + f"{tokens} tokens computed in "
                 f"{seconds * 1e3:.0f} ms of steps · {len(s['preempt_steps'])} steps preempted · "
                 f"latencies {source}</span>")
        return traces, {"title": {"text": title}}

    def summary(self, position: int | None = None) -> str:
        if not len(self.replay):
            return "ThroughputPanel: no steps yet"
        position = self.position if position is None else position
        s = throughput_series(self.replay, position)
        lat = self.latencies(position)
        steps = len(s["step"])
        tokens = s["prefill_tokens"] + s["decode_tokens"]
        lines = [
            f"ThroughputPanel · step {int(s['step'][-1])} ({position + 1} of {len(self.replay)})",
            f"  tokens per step: mean {tokens.mean():.1f}, max {int(tokens.max())} "
            f"(prefill {int(s['prefill_tokens'].sum())}, decode {int(s['decode_tokens'].sum())} over {steps} steps)",
            f"  KV usage: now {s['kv_usage'][-1]:.0%}, peak {s['kv_usage'].max():.0%}; "
            f"preemptions at steps {s['preempt_steps'].tolist() or 'none'}",
        ]
        for r in lat[:20]:
            ttft = "-" if r.ttft is None else f"{r.ttft * 1e3:.1f} ms"
            itl = "-" if r.itl_median is None else f"{r.itl_median * 1e3:.2f} ms (p90 {r.itl_p90 * 1e3:.2f})"
            lines.append(f"  {r.request_id:<12} TTFT {ttft:>10}  inter-token {itl}  tokens {r.num_tokens}")
        if len(lat) > 20:
            lines.append(f"  ... {len(lat) - 20} more requests")
        return "\n".join(lines)
