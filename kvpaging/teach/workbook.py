"""The learner's workbook: a piece written in one lesson, kept for a later one.

Lesson 04's build-it asks for a block allocator; lesson 12 builds an engine on one. Once the learner's allocator
passes lesson 04's check, :func:`keep` writes its source to a file of the workbook folder (``$KVPAGING_WORKBOOK``,
by default ``~/.kvpaging/workbook``; one file per piece, named after it, for the learner to open and read), and
lesson 12's ``use("allocator", ...)`` takes it from there when the lesson's own cell is left a stub.

Only a piece that passed its check is kept, and only if its file, run on its own, gives a piece that passes the same
check again: a class that leans on names defined elsewhere in the notebook (an import in another cell, a helper
function) is not kept, and :func:`keep` says which name was missing.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import os
from pathlib import Path
from typing import Callable

__all__ = ["workbook_dir", "source_of", "keep", "kept"]


def workbook_dir() -> Path:
    """Where kept pieces live: ``$KVPAGING_WORKBOOK``, or ``~/.kvpaging/workbook``."""
    return Path(os.environ.get("KVPAGING_WORKBOOK") or Path.home() / ".kvpaging" / "workbook")


def source_of(obj) -> str:
    """The source of a function or class, also one defined in a notebook cell (where ``inspect.getsource`` finds a
    function's but not a class's before Python 3.13: the class statement is looked up in the cell its methods
    came from)."""
    if not inspect.isclass(obj):
        return inspect.getsource(obj)
    for member in vars(obj).values():
        function = getattr(member, "fget", None) or getattr(member, "__func__", None) or member
        code = getattr(function, "__code__", None)
        if code is None:
            continue
        text = "".join(linecache.getlines(code.co_filename))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.name == obj.__name__ \
                    and node.lineno <= code.co_firstlineno <= node.end_lineno:
                return ast.get_source_segment(text, node, padded=True) + "\n"
    raise OSError(f"the source of class {obj.__name__} was not found (it has no methods written in Python)")


def keep(name: str, piece, check: Callable) -> Path | None:
    """Keep ``piece`` under ``name`` if its lesson's ``check`` (one of :mod:`kvpaging.teach.build`'s, called with the
    piece) finds it ``ok`` (written and passing), and again for the piece read back from the kept file alone;
    returns the file, or None (and says why) when it is not kept."""
    if not check(piece).ok:
        return None  # a stub, or not right yet: nothing to keep (the check has said why)
    try:
        source = source_of(piece)
        ok = check(_load(source, piece.__name__)).ok
    except Exception as error:  # noqa: BLE001 - whatever the file alone lacks, say it
        ok, why = False, f"{type(error).__name__}: {error}"
    else:
        why = "it no longer passes the check"
    if not ok:
        print(f"not kept for later lessons: {piece.__name__} read back from its source alone fails ({why}); "
              "put the imports and helpers it needs inside it")
        return None
    path = workbook_dir() / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {name}: kept by kvpaging.teach.workbook.keep once it passed its lesson's check\n{source}")
    print(f"kept for later lessons: {path}")
    return path


def kept(name: str):
    """The piece kept under ``name`` (the last object its file defines), or None if none was kept."""
    path = workbook_dir() / f"{name}.py"
    if not path.exists():
        return None
    source = path.read_text()
    definitions = [node.name for node in ast.parse(source).body
                   if isinstance(node, (ast.ClassDef, ast.FunctionDef))]
    return _load(source, definitions[-1], str(path)) if definitions else None


def _load(source: str, obj_name: str, filename: str = "<kept piece>"):
    namespace: dict = {"__name__": "kvpaging_workbook"}
    exec(compile(source, filename, "exec"), namespace)  # the learner's own code, run as they wrote it
    return namespace[obj_name]
