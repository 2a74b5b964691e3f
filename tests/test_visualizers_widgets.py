"""The views as widgets, without a browser: drive their controls through traitlets, read the figures back.

ipywidgets and plotly's FigureWidget keep their whole state in Python, so a
test can press "Step", move the slider or the page selector, and check that
the figure's data changed the way the pure functions say it should. Live
views are checked for what makes them cheap: the engine's observer only
queues records, and one frame shows the newest step, however many arrived.
"""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
from kvpaging.visualizers import (
    BlockTableView,
    BubbleTimeline,
    ContiguousMemoryView,
    Dashboard,
    LiveFeed,
    MemoryMapView,
    ThroughputPanel,
    TraceReplay,
    block_table_frame,
    load_trace,
    memory_map_frame,
)
from kvpaging.visualizers.bench import synthetic_trace
from kvpaging.visualizers.examples import BLOCK_SIZE, hand_trace

from kvpaging import LLM, SamplingParams, simulate_contiguous
from kvpaging.models import tiny

pytest.importorskip("anywidget", reason="plotly's FigureWidget needs anywidget (pip install -e '.[notebook]')")


def make_llm(**kwargs):
    options = dict(num_blocks=24, block_size=4, max_model_len=64)
    options.update(kwargs)
    return LLM(tiny("qwen3", num_hidden_layers=2), **options)


PREFIX = list(range(10, 22))
PROMPTS = [PREFIX + [30, 31], PREFIX + [40, 41, 42], list(range(50, 59))]
PARAMS = [
    SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0),
    SamplingParams(max_tokens=6, n=2, ignore_eos=True, temperature=0.0),
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0),
]


def z_of(view, trace=0):
    return np.array(view.figure.data[trace].z, dtype=float)


# -- single views, replayed --------------------------------------------------------------------------------
def test_block_table_view_step_and_slider_change_the_figure():
    view = BlockTableView(hand_trace(), block_size=BLOCK_SIZE)
    controls = view.controls
    assert controls.slider.max == 4 and view.position == 2  # opens on the busiest step (step 3: four sequences)
    controls.slider.value = 0
    before = z_of(view)
    assert before.shape == (1, 2)  # step 1: one sequence, two blocks
    controls.step_button.click()
    assert view.position == 1 and controls.slider.value == 1
    after = z_of(view)
    expected = block_table_frame(view.replay, 1)
    np.testing.assert_array_equal(after, expected.z)
    assert list(view.figure.layout.yaxis.ticktext) == expected.row_labels
    assert view.figure.layout.title.text == expected.title
    controls.back_button.click()
    assert view.position == 0
    controls.slider.value = 3
    assert "copy-on-write: block 4 -&gt; 6" in controls.label.value or "step 4" in controls.label.value
    assert "copy-on-write" in view.figure.layout.title.text


def test_play_is_linked_to_the_slider_and_grows_with_it():
    view = MemoryMapView(hand_trace()[:2], block_size=BLOCK_SIZE)
    controls = view.controls
    assert controls.play.max == controls.slider.max == 1
    view.replay.extend(hand_trace()[2:])
    view.refresh()
    assert controls.play.max == controls.slider.max == 4
    assert view.position == 4  # it was on the newest step, so it follows


def test_memory_map_view_redraws_on_slider():
    view = MemoryMapView(hand_trace(), block_size=BLOCK_SIZE)
    view.controls.slider.value = 0
    z0 = z_of(view)
    view.controls.slider.value = 3
    z3 = z_of(view)
    assert not np.array_equal(z0, z3, equal_nan=True)
    np.testing.assert_array_equal(z3, memory_map_frame(view.replay, 3).z)
    partial = view.figure.data[1]
    assert len(partial.x) == 2  # blocks 4 and 6 are partly filled after step 4
    assert "internal fragmentation 20.0%" in view.figure.layout.title.text


def test_block_table_page_selector():
    records = synthetic_trace(num_blocks=2048, num_seqs=60, num_steps=3)
    view = BlockTableView(records, block_size=16, rows_per_page=25)
    view.figure  # noqa: B018 - build it
    assert view.page_selector.max == 3
    first = list(view.figure.layout.yaxis.ticktext)
    view.page_selector.value = 3
    last = list(view.figure.layout.yaxis.ticktext)
    assert first[0].startswith("seq 0 ") and last[0].startswith("seq 50 ") and len(last) == 10
    view.page = 0
    assert list(view.figure.layout.yaxis.ticktext) == first


def test_contiguous_view_marks_the_refusal():
    events = [
        [("reserve", "a", 30), ("reserve", "b", 20), ("reserve", "c", 30), ("reserve", "f", 20)],
        [("release", "b")],
        [("reserve", "d", 10), ("release", "f")],
        [("reserve", "e", 25)],
    ]
    view = ContiguousMemoryView(simulate_contiguous(100, events))
    assert view.position == 3
    assert "refused e (25 slots) although 30 are free" in view.figure.layout.title.text
    assert list(view.figure.data[5].x) == [3]
    view.controls.slider.value = 1
    assert len(view.figure.data[5].x) == 0 and len(view.figure.data[0].x) == 3
    assert "first refusal by fragmentation at t=3" in view.summary(3)


def test_bubble_timeline_simulation_reveals_iterations():
    view = BubbleTimeline.simulate([50, 120, 240, 1024], num_slots=4)
    assert view.num_positions() == 1024
    view.controls.slider.value = 99
    z = z_of(view)
    assert not np.isnan(z[:, :100]).any() and np.isnan(z[:, 100:]).all()
    titles = [a.text for a in view.figure.layout.annotations]
    assert titles[0].startswith("static batching: ") and "(350 / 400 slot-iterations)" in titles[0]  # 50 + 3 x 100
    view.controls.slider.value = 1023
    titles = [a.text for a in view.figure.layout.annotations]
    assert "35.0% utilised (1,434 / 4,096 slot-iterations)" in titles[0]


def test_throughput_panel_grows_with_the_slider():
    view = ThroughputPanel(hand_trace(), block_size=BLOCK_SIZE)
    view.controls.slider.value = 1
    assert list(view.figure.data[0].x) == [1, 2]
    view.controls.step_button.click()
    assert list(view.figure.data[1].y) == [6, 2, 5]  # prefill tokens of steps 1..3
    ttft = dict(zip(view.figure.data[4].x, view.figure.data[4].y))
    assert ttft == pytest.approx({"a": 500.0, "b": 500.0, "c": 500.0})  # ms: first token as the first step ended
    view.controls.slider.value = 0
    assert list(view.figure.data[4].x) == ["a"]  # b and c are not scheduled yet


def test_static_html_has_frames_a_play_button_and_a_slider(tmp_path):
    view = BlockTableView(hand_trace(), block_size=BLOCK_SIZE)
    fig = view.static_figure()
    assert len(fig.frames) == 5
    assert [s.label for s in fig.layout.sliders[0].steps] == [f"step {i}" for i in range(1, 6)]
    assert [b.label for b in fig.layout.updatemenus[0].buttons] == ["▶ Play", "▶▶ 4× faster", "❚❚ Pause"]
    small = view.to_html(tmp_path / "cdn.html", self_contained=False)
    script_sources = re.compile(r"<script[^>]*\bsrc=")
    assert script_sources.search(small) and len(small) < 500_000  # plotly.js from the CDN
    full = view.to_html(tmp_path / "full.html")
    assert not script_sources.search(full) and len(full) > 3_000_000  # plotly.js inside: works offline
    assert (tmp_path / "full.html").read_text(encoding="utf-8") == full
    sampled = BubbleTimeline.simulate([50, 120, 240, 1024], 4).static_figure(max_frames=30)
    assert len(sampled.frames) == 30 and sampled.frames[-1].name == "1023"


def test_summaries_are_plain_text():
    view = MemoryMapView(hand_trace(), block_size=BLOCK_SIZE)
    text = view.summary(3)
    assert "used 5 (62%)" in text and "internal fragmentation 20.0%" in text
    assert "#c#S+.+." in text  # blocks 0..7 after step 4
    assert repr(view) == view.summary()
    table = BlockTableView(hand_trace(), block_size=BLOCK_SIZE).summary(1)
    assert "seq 1 · b · 6 tok" in table and "[0^×2 2]" in table


# -- live ------------------------------------------------------------------------------------------------------
def test_observer_only_queues_and_one_frame_shows_the_newest_step(one_thread):
    llm = make_llm()
    view = MemoryMapView()
    feed = view.attach(llm, fps=1000, background=False)
    fig = view.figure
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    steps = llm.engine.num_steps
    assert len(feed.queue) == steps and len(view.replay) == 0  # the observer did nothing else
    assert feed.num_frames == 0
    assert feed.tick(force=True)
    assert feed.num_frames == 1 and len(feed.queue) == 0  # one frame for all of them
    assert len(view.replay) == steps and view.position == steps - 1
    assert view.controls.slider.max == steps - 1 and view.controls.slider.value == steps - 1
    assert f"step {steps}" in fig.layout.title.text
    assert not feed.tick(force=True)  # nothing new: nothing drawn
    view.detach()
    assert feed.observe not in llm.engine.observers.observers


def test_live_feed_throttles_to_fps():
    replay = TraceReplay(block_size=BLOCK_SIZE)
    view = MemoryMapView(replay)
    feed = LiveFeed(replay, [view], fps=2)
    records = hand_trace()
    feed.observe(records[0])
    assert feed.tick()
    feed.observe(records[1])
    assert not feed.tick()  # too soon after the last frame
    time.sleep(0.55)
    assert feed.tick() and len(replay) == 2
    with pytest.raises(ValueError, match="fps"):
        LiveFeed(replay, [view], fps=0)


def test_live_view_off_the_newest_step_stays_put():
    replay = TraceReplay(hand_trace()[:3], block_size=BLOCK_SIZE)
    view = BlockTableView(replay)
    view.controls.slider.value = 0
    feed = LiveFeed(replay, [view], fps=1000)
    for r in hand_trace()[3:]:
        feed.observe(r)
    feed.tick(force=True)
    assert view.position == 0 and view.controls.slider.max == 4  # the learner is looking back: leave them there


def test_background_painter_follows_an_engine(one_thread):
    llm = make_llm()
    dash = Dashboard(llm, fps=50)
    dash.widget  # noqa: B018 - build the figures, as display() would
    dash.attach()
    try:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        deadline = time.time() + 10
        while len(dash.replay) < llm.engine.num_steps and time.time() < deadline:
            time.sleep(0.05)
    finally:
        dash.detach()
    steps = llm.engine.num_steps
    assert len(dash.replay) == steps and dash.position == steps - 1
    assert dash.controls.slider.value == steps - 1
    assert f"step {steps}" in dash.memory_map.figure.layout.title.text


def test_attached_dashboard_reserves_each_requests_worst_case(one_thread):
    """A dashboard following an engine whose requests someone else adds (a server, generate()) gives the
    contiguous baseline each request's prompt + max_tokens, not max_model_len."""
    llm = make_llm()
    dash = Dashboard(llm)
    dash.attach(background=False)
    try:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        dash.detach()
    worst = sorted(len(p) + sp.max_tokens for p, sp in zip(PROMPTS, PARAMS))
    assert sorted(dash._reserve.values()) == worst
    dash.contiguous.sync()
    asked = {a[2] for s in dash.contiguous.steps for a in s.actions if a[0] == "reserve"}
    assert asked == set(worst) and llm.engine.config.max_model_len not in asked
    assert dash._note_reserves not in llm.engine.observers.observers  # detached


def test_dashboard_run_matches_generate_and_drives_every_view(one_thread):
    expected = make_llm().generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = make_llm()
    dash = Dashboard(llm)
    outs = dash.run(PROMPTS, PARAMS, display=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in expected]
    n = len(dash.replay)
    assert n == llm.engine.num_steps
    # the run ends on an empty step; the dashboard opens on the busiest one instead
    running = [len(r.block_tables) for r in dash.replay.records]
    assert running[-1] == 0 and running[dash.position] == max(running) > 0
    assert all(v.position == dash.position for v in dash.views)
    dash.widget  # noqa: B018
    before = {name: z_of(getattr(dash, name)) for name in ("block_table", "memory_map")}
    dash.controls.slider.value = 2
    assert all(v.position == 2 for v in dash.views)
    for name, z in before.items():
        assert not np.array_equal(z, z_of(getattr(dash, name)), equal_nan=True), name
    dash.controls.step_button.click()
    assert all(v.position == 3 for v in dash.views)
    assert "Contiguous allocator at step 4" in dash.contiguous.figure.layout.title.text
    # the contiguous baseline reserved prompt + max_tokens for each request
    reserved = {r.request_id: r.num_slots for r in dash.contiguous.steps[0].snapshot.runs}
    assert reserved == {"r0": 14 + 8, "r1": 15 + 6, "r2": 9 + 12}
    # latencies switch to the exact RequestMetrics at the end
    dash.show(n - 1)
    assert "latencies from arrival" in dash.throughput.figure.layout.title.text
    text = dash.summary()
    for name in ("BlockTableView", "MemoryMapView", "BubbleTimeline", "ContiguousMemoryView", "ThroughputPanel"):
        assert name in text


def test_dashboard_from_saved_trace_replays_the_same_pictures(tmp_path, one_thread):
    llm = make_llm()
    live = Dashboard(llm)
    live.run(PROMPTS, PARAMS, display=False)
    path = tmp_path / "run.json"
    live.save_trace(path)
    replayed = Dashboard.from_trace(load_trace(path))
    assert len(replayed.replay) == len(live.replay)
    for position in (0, 3, len(live.replay) - 1):
        live.show(position)
        replayed.show(position)
        assert replayed.memory_map.summary() == live.memory_map.summary()
        assert replayed.block_table.summary() == live.block_table.summary()
    html = replayed.to_html(tmp_path / "dash.html", self_contained=False, max_frames=10)
    assert html.count("plotly-graph-div") >= 5 and '<script charset="utf-8" src="https://cdn.plot.ly' in html
    live.save_chrome_trace(tmp_path / "run.trace.json")
    assert re.search(r'"traceEvents"', (tmp_path / "run.trace.json").read_text())


def test_dashboard_run_needs_an_engine():
    with pytest.raises(ValueError, match="needs an engine"):
        Dashboard.from_trace(hand_trace(), block_size=BLOCK_SIZE).run([[1, 2, 3]])


def test_one_view_redraw_of_a_big_pool_is_quick():
    records = synthetic_trace(num_blocks=4096, num_seqs=256, num_steps=4)
    view = MemoryMapView(records, block_size=16)
    view.figure  # noqa: B018
    start = time.perf_counter()
    view.controls.slider.value = 1
    assert time.perf_counter() - start < 0.5


def test_each_move_redraws_each_view_once(monkeypatch):
    dash = Dashboard.from_trace(hand_trace(), block_size=BLOCK_SIZE)
    dash.widget  # noqa: B018
    calls = []
    for view in dash.views:
        original = view._apply
        monkeypatch.setattr(view, "_apply", lambda p, v=view, f=original: (calls.append((type(v).__name__, p)), f(p)))
    dash.controls.slider.value = 1  # as the browser does
    dash.controls.step_button.click()
    dash.show(0)  # as a notebook cell does
    names = [type(v).__name__ for v in dash.views]
    assert calls == [(n, p) for p in (1, 2, 0) for n in names]


def test_bubbles_of_real_static_and_continuous_runs(one_thread):
    """The engine's own schedulers: static batching leaves bubbles that continuous batching fills."""
    prompts = [[5 + i, 6 + i, 7 + i] for i in range(6)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in (3, 12, 4, 12, 2, 12)]
    traces = {}
    for scheduling in ("static", "continuous"):
        llm = make_llm(num_blocks=64, max_num_seqs=2, scheduling=scheduling)
        llm.engine.keep_trace = True
        llm.engine.trace = []
        llm.generate(prompts, params, use_tqdm=False)
        traces[scheduling] = llm.engine.trace
    view = BubbleTimeline.from_traces(traces, block_size=4)
    static, continuous = view.timelines
    assert static.num_slots == continuous.num_slots == 2
    assert static.busy == continuous.busy  # the same tokens were computed ...
    assert continuous.num_iterations < static.num_iterations  # ... in fewer steps
    assert continuous.utilisation > static.utilisation
    titles = [a.text for a in view.figure.layout.annotations]
    assert titles[0].startswith("static: ") and titles[1].startswith("continuous: ")


def test_redraws_send_every_trace_a_value_never_a_placeholder(monkeypatch):
    """Each redraw reaches the browser as Plotly.update messages; a value left as plotly.py's Undefined
    placeholder arrives there as a wrong value (lesson 03's white holes were drawn green). Every view, every
    position: each property sent carries one real value per trace, and the holes keep their white."""
    import plotly.basewidget
    from plotly.basedatatypes import Undefined

    sent = []
    original = plotly.basewidget.BaseFigureWidget._send_update_msg

    def spy(self, restyle_data, relayout_data, trace_indexes=None, source_view_id=None):
        sent.append((restyle_data, trace_indexes))
        return original(self, restyle_data, relayout_data, trace_indexes, source_view_id)

    monkeypatch.setattr(plotly.basewidget.BaseFigureWidget, "_send_update_msg", spy)
    events = [[("reserve", "a", 30), ("reserve", "b", 20), ("reserve", "c", 30)], [("release", "b")],
              [("reserve", "d", 40)], [("use", "a", 12)]]
    contiguous = ContiguousMemoryView(simulate_contiguous(100, events))
    views = [contiguous, BlockTableView(hand_trace(), block_size=BLOCK_SIZE),
             MemoryMapView(hand_trace(), block_size=BLOCK_SIZE), ThroughputPanel(hand_trace()),
             BubbleTimeline.simulate([3, 5, 9], 2)]
    for view in views:
        view.figure  # noqa: B018 - the first draw is an update too
        for position in range(view.num_positions()):
            view.show(position)
    assert sent
    for restyle, indexes in sent:
        for key, values in restyle.items():
            assert isinstance(values, list) and len(values) == len(indexes), key
            assert all(v is not Undefined for v in values), (key, indexes)
    holes = contiguous.figure.data[2]
    assert holes.name == "hole (free)" and holes.marker.color == "#ffffff"


# -- static figures: axes over every frame, the opening step, play speed, plotly's notebook output ---------------
def frame_reach(fig, frame) -> list[tuple[str, float, float]]:
    """(axis, low, high) of the numeric data each trace of ``frame`` shows, read plainly from the arrays."""
    reach = []
    for index, data in zip(frame.traces, frame.data):
        base = fig.data[index]
        xa, ya = (base.xaxis or "x"), (base.yaxis or "y")
        if data.type == "scatter" and data.y is not None and len(data.y):
            xs = [v for v in data.x if v is not None]
            ys = [v for v in data.y if v is not None]
            if xs and not isinstance(xs[0], str):
                reach.append((xa, min(xs), max(xs)))
            if ys:
                reach.append((ya, min(ys), max(ys)))
        elif data.type == "bar" and data.y is not None and len(data.y) and base.orientation != "h":
            tops = np.asarray([v for v in data.y if v is not None], dtype=float)
            if data.error_y is not None and data.error_y.array is not None:
                tops = tops + np.asarray(data.error_y.array, dtype=float)[: len(tops)]
            if tops.size:
                reach.append((ya, 0.0, float(tops.max())))
    return reach


def test_static_axes_hold_every_frame_and_late_categories_have_their_place():
    records = hand_trace()
    view = ThroughputPanel(records)
    view.show(0)  # open on the first step: its axes would otherwise be the first step's
    fig = view.static_figure()
    assert [s.label for s in fig.layout.sliders[0].steps][fig.layout.sliders[0].active] == "step 1"
    for frame in fig.frames:
        for axis, low, high in frame_reach(fig, frame):
            lo, hi = sorted(fig.layout[axis[0] + "axis" + axis[1:]].range)
            assert lo <= low and high <= hi, (frame.name, axis, low, high, (lo, hi))
    ttft_axis = fig.layout.xaxis3
    assert list(ttft_axis.categoryarray) == ["a", "b", "c"] and ttft_axis.categoryorder == "array"
    assert list(fig.data[4].x) == ["a"]  # the first frame shows one request, on an axis that has room for three


def test_static_figure_opens_on_the_views_step_and_shares_the_time_axis_of_its_panels():
    view = BlockTableView(hand_trace(), block_size=BLOCK_SIZE)
    view.show(3)
    fig = view.static_figure()
    assert fig.layout.sliders[0].active == 3 and fig.layout.title.text == block_table_frame(view.replay, 3).title
    bubbles = BubbleTimeline.simulate([50, 120, 240, 1024, 30, 60], 4)  # continuous batching finishes first
    fig = bubbles.static_figure(max_frames=10)
    assert fig.layout.xaxis2.matches == "x" and fig.layout.xaxis.range == fig.layout.xaxis2.range
    assert fig.layout.xaxis.range[1] >= max(t.num_iterations for t in bubbles.timelines) - 1


def test_a_whole_run_plays_in_about_25_seconds_with_a_faster_button_and_a_speed_control():
    from kvpaging.visualizers.base import PLAY_SECONDS

    for lengths in ([5, 9], [50, 120, 240, 1024]):
        view = BubbleTimeline.simulate(lengths, 2)
        fig = view.static_figure(max_frames=30)
        play, faster = (b.args[1]["frame"]["duration"] for b in fig.layout.updatemenus[0].buttons[:2])
        seconds = play * (len(fig.frames) - 1) / 1000
        assert 0.5 * PLAY_SECONDS <= seconds <= 1.5 * PLAY_SECONDS or play == 1000, (lengths, play)
        assert faster * 4 <= play + 4
        controls = view.controls
        run = controls.play.interval * (view.num_positions() - 1) / 1000
        assert run <= 1.5 * PLAY_SECONDS or controls.play.interval == 60, (lengths, controls.play.interval)
        base = controls.play.interval
        controls.speed.value = 4.0
        assert controls.play.interval == max(int(base / 4), 20)
        controls.speed.value = 0.5
        assert controls.play.interval == 2 * base


def test_figure_bundle_is_plotlys_notebook_output_with_its_frames():
    from kvpaging.visualizers import figure_bundle

    view = ContiguousMemoryView(simulate_contiguous(100, [[("reserve", "a", 30)], [("reserve", "b", 80)]]))
    fig = view.static_figure()
    bundle = figure_bundle(fig, text=view.summary())
    spec = bundle["application/vnd.plotly.v1+json"]
    assert set(bundle) - {"image/png"} == {"application/vnd.plotly.v1+json", "text/plain"}
    assert len(spec["frames"]) == len(fig.frames) == 2 and spec["layout"]["sliders"]
    assert "<script" not in json.dumps(spec) and bundle["text/plain"].startswith("ContiguousMemoryView")


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # the IHDR chunk


def test_every_figure_carries_a_static_image_of_its_last_frame(monkeypatch):
    """GitHub and nbviewer draw no plotly: asked for (KVPAGING_STATIC_IMAGES=1, as make save-lessons sets it), the
    bundle carries a PNG from plotly's own export (kaleido, with the Chromium make test installs), of an animation's
    last frame, at the figure's size; and none by default or when asked not to."""
    import base64
    import importlib.util

    import plotly.graph_objects as go

    from kvpaging.visualizers import figure_bundle
    from kvpaging.visualizers.static import static_png

    pytest.importorskip("kaleido")
    probe = go.Figure(go.Scatter(x=[0, 1], y=[0, 1]))
    monkeypatch.delenv("KVPAGING_STATIC_IMAGES", raising=False)
    assert "image/png" not in figure_bundle(probe), "off by default: JupyterLab would show the picture, not plotly"
    monkeypatch.setenv("KVPAGING_STATIC_IMAGES", "1")
    if static_png(probe) is None:
        pytest.skip("kaleido finds no Chrome or Chromium here")

    def animation(last_y):
        return go.Figure(go.Bar(x=[1, 2, 3], y=[1, 1, 1]), frames=[go.Frame(data=[go.Bar(x=[1, 2, 3], y=[1, 1, 1])]),
                                                                 go.Frame(data=[go.Bar(x=[1, 2, 3], y=last_y)])],
                         layout=dict(width=500, height=300, yaxis=dict(range=[0, 4])))

    one, other = (base64.b64decode(figure_bundle(animation(y))["image/png"]) for y in ([1, 2, 3], [3, 2, 1]))
    assert _png_size(one) == (500, 300)
    if importlib.util.find_spec("PIL") is not None:
        assert one[25] == 3, "kept small: an indexed-colour PNG (compact_png)"
    assert one != other, "the image shows the last frame"
    assert static_png(animation([1, 2, 3])) == one
    monkeypatch.setenv("KVPAGING_STATIC_IMAGES", "0")
    assert "image/png" not in figure_bundle(animation([1, 2, 3]))


def test_presentation_makes_every_text_larger_and_the_title_keeps_its_room():
    from kvpaging.visualizers import presentation

    def sizes(view):
        fig = view.static_figure(max_frames=3)
        return fig.layout.title.font.size, fig.layout.font.size, fig.data[0].textfont.size, fig.layout.margin.t

    normal = sizes(BlockTableView(hand_trace(), block_size=BLOCK_SIZE))
    presentation(scale=1.5)
    try:
        large = sizes(BlockTableView(hand_trace(), block_size=BLOCK_SIZE))
    finally:
        presentation(False)
    assert all(big >= 1.4 * small for big, small in zip(large[:3], normal[:3])), (normal, large)
    assert large[3] > normal[3] + 15  # the top margin holds the larger title lines
    assert sizes(BlockTableView(hand_trace(), block_size=BLOCK_SIZE)) == normal
