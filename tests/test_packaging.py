"""One distribution, one import namespace: kvpaging, kvpaging.kernels, kvpaging.visualizers.

The folders kernels/ and visualizers/ must never be installed as top-level
modules (a PyPI package named `kernels` exists and would be shadowed).
"""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = {"kvpaging": "kvpaging", "kvpaging.kernels": "kernels", "kvpaging.visualizers": "visualizers"}


def test_editable_install_maps_the_folders(tmp_path):
    # run outside the repo: `python -m pytest` puts the repo root on sys.path, which would hide the question
    code = (
        "import importlib, importlib.util\n"
        "for name in ('kvpaging', 'kvpaging.kernels', 'kvpaging.visualizers'):\n"
        "    print(importlib.import_module(name).__file__)\n"
        "spec = importlib.util.find_spec('visualizers'); print(spec.origin if spec else None)\n"
        "spec = importlib.util.find_spec('kernels'); print(spec.origin if spec else None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    lines = out.stdout.split()
    assert [Path(p).resolve() for p in lines[:3]] == [REPO / f / "__init__.py" for f in SUBPACKAGES.values()]
    assert lines[3] == "None"  # no top-level `visualizers`
    assert lines[4] == "None" or Path(lines[4]).resolve().parent != REPO / "kernels"  # ours is not top-level `kernels`


def test_built_wheel_imports_all_three(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "-q"],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("kvpaging-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        zf.extractall(tmp_path / "site")
    tops = {n.split("/")[0] for n in names}
    assert "kernels" not in tops and "visualizers" not in tops, tops
    assert "kvpaging/kernels/__init__.py" in names
    assert "kvpaging/visualizers/__init__.py" in names
    assert any(n.startswith("kvpaging/model_configs/") and n.endswith(".json") for n in names)
    assert {"kvpaging/kernels/cpu/decode_attention.c", "kvpaging/kernels/cpu/rms_norm.c"} <= set(names)  # compiled on first use
    code = (
        "import kvpaging, kvpaging.kernels, kvpaging.visualizers, sys;"
        "print(kvpaging.__file__); print(kvpaging.kernels.__file__); print(kvpaging.visualizers.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site")},
        capture_output=True, text=True, check=True,
    ).stdout.split()
    site = (tmp_path / "site").resolve()
    assert [Path(p).resolve().parent.relative_to(site).as_posix() for p in out] == [
        "kvpaging", "kvpaging/kernels", "kvpaging/visualizers",
    ]
