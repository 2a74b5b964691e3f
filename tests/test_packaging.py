"""One distribution, one import namespace: kvpaging, kvpaging.kernels, kvpaging.visualizers.

The folders kernels/ and visualizers/ must never be installed as top-level
modules (a PyPI package named `kernels` exists and would be shadowed).
"""

import ast
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



def test_transformers_imports_from_the_repository_root():
    """Python run from the repository's root (``python -c``, a REPL, a notebook kept there) also finds kernels/ as a
    top-level ``kernels``: the name of Hugging Face's package, which transformers probes for by importing it while
    it is itself half imported. A model's module must still import there, before kvpaging and after it."""
    code = ("import transformers.models.llama.modeling_llama\n"
            "import kvpaging.kernels as k\n"
            "print(k.quantize_fp8.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["kvpaging.kernels.fp8"]

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
    assert any(n.startswith("kvpaging/models/model_configs/") and n.endswith(".json") for n in names)
    c_files = {f"kvpaging/kernels/cpu/{p.name}" for p in (REPO / "kernels" / "cpu").glob("*.[ch]")}
    assert len(c_files) >= 9 and c_files <= set(names), sorted(c_files - set(names))  # compiled on first use
    # every module of the source tree is in the wheel (a subpackage missing from pyproject's list would not be)
    sources = {f"kvpaging/{p.relative_to(REPO / 'kvpaging').as_posix()}" for p in (REPO / "kvpaging").rglob("*.py")}
    assert sources <= set(names), sorted(sources - set(names))
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


def _module_names() -> dict[str, Path]:
    modules = {}
    for package, folder in SUBPACKAGES.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = [package, *path.relative_to(REPO / folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """Every package module a file imports, at its top or inside a function (``if TYPE_CHECKING:`` aside)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found.update(n for n in names if n in modules)
            module = node.module
            while module and module not in modules:
                module = module.rpartition(".")[0]
            if module:
                found.add(module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    return found


def test_no_import_circle():
    """The stages import one way: no module reaches itself again through its imports, lazy ones included (a
    lazy import that closes a circle is one a maintainer cannot move to the top). A module's own parent
    packages do not count: importing ``kvpaging.core.scheduler`` runs ``kvpaging/__init__.py`` first either way."""
    modules = _module_names()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):  # drop `if TYPE_CHECKING:` blocks
            if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
                node.body = []
        graph[name] = {m for m in _imports(tree, modules) if m != name and not name.startswith(m + ".")}
    # depth-first search for a back edge, reporting the circle it closes
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert len(graph) > 60  # the walk saw the whole package


def test_each_part_of_the_package_is_imported_when_first_used():
    """``import kvpaging`` imports none of its parts: the memory core needs neither torch nor transformers, the
    kernels no transformers (whose model code takes seconds to import), and every public name and subpackage is
    there when it is looked up."""
    code = "\n".join([
        "import sys, kvpaging",
        "from kvpaging import BlockManager, BlockPool",
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'the memory core imported more'",
        "import kvpaging.kernels",
        "assert 'transformers' not in sys.modules, 'the kernels imported transformers'",
        "from kvpaging import *",
        "missing = [name for name in kvpaging.__all__ if name not in globals()]",
        "assert not missing, missing",
        "import kvpaging.entrypoints.llm",
        "assert LLM is kvpaging.LLM is kvpaging.entrypoints.llm.LLM",
        "assert callable(kvpaging.models.tiny) and callable(kvpaging.teach.pick_model)",
        "try:",
        "    kvpaging.no_such_name",
        "except AttributeError as error:",
        "    assert 'no_such_name' in str(error)",
        "else:",
        "    raise AssertionError('an unknown name was found')",
    ])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
