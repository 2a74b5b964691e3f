"""Progress bars (kvpaging.progress): in a notebook the saved output is the finished bar."""

import pytest

from kvpaging import LLM, SamplingParams, progress
from kvpaging.models import tiny


class FakeHandle:
    """Stands in for IPython's DisplayHandle: keeps what the notebook would show now."""

    def __init__(self, obj):
        self.shown = [(repr(obj), obj._repr_html_())]

    def update(self, obj):
        self.shown.append((repr(obj), obj._repr_html_()))


@pytest.fixture
def notebook(monkeypatch):
    import IPython.display

    handles = []

    def display(obj, display_id=False):
        assert display_id, "a bar must be displayed with a handle, to be redrawn in place"
        handles.append(FakeHandle(obj))
        return handles[-1]

    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", display)
    return handles


def test_generate_leaves_a_finished_bar(notebook):
    llm = LLM(tiny("qwen3", num_hidden_layers=1), block_size=16, num_blocks=32, max_model_len=128)
    llm.generate([[3, 4, 5], [6, 7], [8]], SamplingParams(max_tokens=2, ignore_eos=True))
    (handle,) = notebook
    text, html = handle.shown[-1]
    assert text.startswith("Processed prompts: 100% 3/3 [") and "req/s]" in text, text
    assert '<progress value="3" max="3"' in html
    assert handle.shown[0][0].startswith("Processed prompts:   0% 0/3")


def test_track_counts_every_item_and_redraws_rarely(notebook, monkeypatch):
    monkeypatch.setattr(progress, "_REDRAW_S", 3600.0)
    assert list(progress.track(range(500), desc="work", unit="x")) == list(range(500))
    (handle,) = notebook
    assert len(handle.shown) == 2  # drawn when opened and when closed, not 500 times
    assert handle.shown[-1][0].startswith("work: 100% 500/500 [")


def test_bar_closes_on_error_and_escapes_html(notebook):
    with pytest.raises(KeyError):
        for _ in progress.track([1, 2, 3], desc="<b>risky</b>"):
            raise KeyError("boom")
    text, html = notebook[0].shown[-1]
    assert text.startswith("<b>risky</b>:   0% 0/3")  # closed, at the item that failed
    assert "&lt;b&gt;risky&lt;/b&gt;" in html and "<b>" not in html


def test_outside_a_notebook_it_is_tqdm():
    from tqdm import tqdm

    bar = progress.progress_bar(3, desc="x")
    try:
        assert isinstance(bar, tqdm)
    finally:
        bar.close()
    assert progress.in_notebook() is False
