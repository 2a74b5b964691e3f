"""No typed figures: every number the lessons and their solutions state in prose is computed in that
notebook's own run (issue 14).

A number in a markdown cell must appear in one of the notebook's code cells (a parameter the learner can
change: "a prompt of 63 tokens") or in its saved outputs (a result). Otherwise it was typed by hand and goes
stale the day the engine changes: "peak 51 blocks" in a solution whose run says 64. The few numbers that are
neither, facts from outside the run (a model card, a spec sheet), are listed below, each with its reason.

Not scanned: headings, code spans and link targets (names, not figures), whole numbers up to 10 (counts in
sentences: "two engines", "step 1"), references to other lessons ("lesson 04", "in 11"), model names ("Qwen3-0.6B"), and the Exercises
section, whose numbers are the questions' inputs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

LESSONS = Path(__file__).resolve().parents[1] / "lessons"
NOTEBOOKS = sorted(LESSONS.glob("*.ipynb")) + sorted((LESSONS / "solutions").glob("*.ipynb"))

# Numbers stated in prose that no run computes, per notebook, with where they come from.
GIVEN = {
    "00_setup.ipynb": {
        "30": "SmolLM2-135M-Instruct's layer count (model card)",
    },
    "01_decode_is_memory_bound.ipynb": {
        "0.5": "FLOP per byte of a decode in fp32: half the bf16 figure the recap derives",
    },
    "04_paged_kv_cache.ipynb": {
        "1.5": "one of the predict box's choices (1.5x, 3x, 10x?)",
    },
    "06_continuous_batching.ipynb": {
        "50": "the article's static-batching example, predicted before section 1 runs it",
        "120": "the article's static-batching example",
        "240": "the article's static-batching example",
    },
    "12_build_your_engine.ipynb": {
        "448": "e4m3's largest number (torch.finfo(torch.float8_e4m3fn).max), the clamp lesson 09 computes",
    },
    "09_fp8_kv_cache.ipynb": {
        "63": "kvpaging.teach.fp8.measure_pool_capacity's request: 63 prompt tokens and one generated fill 4 blocks",
    },
}

_NUMBER = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(?![\d_])")
_LESSON_REF = re.compile(r"(?:lessons?|sections?|in|notebook)\s+$", re.I)


def _text(output: dict) -> str:
    for value in (output.get("text"), output.get("data", {}).get("text/markdown"),
                  output.get("data", {}).get("text/plain"), output.get("data", {}).get("text/html")):
        if value:
            return "".join(value) if isinstance(value, list) else value
    return ""


def _normal(number: str) -> str:
    return number.replace(",", "")


def typed_figures(nb: dict, runs_count: bool = True) -> list[tuple[int, str, str]]:
    """(cell index, number, context) for every number in the prose that the notebook's code and outputs
    do not contain (with ``runs_count=False``: every number in the prose, computed or not)."""
    corpus = []
    for cell in nb["cells"] if runs_count else ():
        if cell["cell_type"] == "code":
            corpus.append("".join(cell["source"]))
            corpus.extend(_text(o) for o in cell.get("outputs", []))
    known = {_normal(m) for text in corpus for m in _NUMBER.findall(text)}
    found = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        prose = "".join(cell["source"])
        prose = prose.split("## Exercises")[0]  # the exercises' numbers are their questions' inputs
        prose = "\n".join(line for line in prose.splitlines() if not line.lstrip().startswith("#"))
        prose = re.sub(r"`[^`]*`", "", prose)
        prose = re.sub(r"\]\([^)]*\)", "]", prose)
        for m in _NUMBER.finditer(prose):
            value = _normal(m.group(1))
            if value in known or ("." not in value and float(value) <= 10):
                continue
            if _LESSON_REF.search(prose[max(0, m.start() - 12) : m.start()]):
                continue
            if prose[m.start() - 1 : m.start()] == "-" and prose[m.start() - 2 : m.start() - 1].isalnum():
                continue  # part of a model's name: Qwen3-0.6B, Llama-3.1-8B
            found.append((index, value, " ".join(prose[max(0, m.start() - 50) : m.end() + 30].split())))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(LESSONS)))
def test_no_typed_figures(path):
    nb = json.loads(path.read_text())
    given = GIVEN.get(path.name, {}) if path.parent == LESSONS else {}
    typed = [f for f in typed_figures(nb) if f[1] not in given]
    assert not typed, (
        f"{path.relative_to(LESSONS)}: numbers in prose that the notebook's run does not compute "
        f"(compute and show them, or list them in GIVEN with their source): {typed}"
    )
    # and the list of given facts does not rot: each is still quoted (whether or not a run happens to print it too)
    quoted = {value for _, value, _ in typed_figures(nb, runs_count=False)}
    assert set(given) <= quoted, f"GIVEN lists numbers {sorted(set(given) - quoted)} that {path.name} no longer quotes"


def _nb(prose: str, code: str = "x = 1", output: str = "") -> dict:
    outputs = [{"output_type": "stream", "name": "stdout", "text": [output]}] if output else []
    return {"cells": [{"cell_type": "code", "source": [code], "outputs": outputs},
                      {"cell_type": "markdown", "source": [prose]}]}


def test_scanner_catches_a_typed_figure():
    assert typed_figures(_nb("the peak is 51 blocks", output="peak 64 blocks")) == [
        (1, "51", "the peak is 51 blocks")]
    assert typed_figures(_nb("the peak is 64 blocks", output="peak 64 blocks")) == []
    assert typed_figures(_nb("a prompt of 63 tokens", code="PROMPT_LEN = 63")) == []
    assert typed_figures(_nb("1,024 tokens at 3.5x", output="1024 tokens, 3.5x")) == []
    assert [v for _, v, _ in typed_figures(_nb("844 tok/s and 1.8x"))] == ["844", "1.8"]
    assert typed_figures(_nb("## Step 42\nsee lesson 11 on Qwen3-0.6B; `n=64`, [x](y/12.html)\n## Exercises\n1. try 512")) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(LESSONS)))
def test_no_unfinished_progress_bars(path):
    """A saved notebook shows finished progress bars (kvpaging.progress), never a widget frozen at 0%."""
    nb = json.loads(path.read_text())
    frozen = [(i, _text(o)[:80]) for i, cell in enumerate(nb["cells"]) for o in cell.get("outputs", [])
              if re.search(r"\b0%\|", _text(o))]
    assert not frozen, f"{path.relative_to(LESSONS)}: progress bars saved unfinished: {frozen}"
