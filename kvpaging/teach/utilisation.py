"""Lesson 01: "utilisation" counts busy time, not work done.

nvidia-smi's "GPU-Util" is the share of its sampling period during which at least
one kernel was running on the GPU. It says nothing about how much of the chip
that kernel used. A decode step is a string of kernels launched back to back,
each of them waiting on memory most of the time: GPU-Util reads high while the
tensor cores do a small fraction of what they could. The figure that is close to
its limit during decode is the memory bandwidth. (The article this package
follows says memory-bound decode shows *low* utilisation; what is low is the
share of peak FLOPs, not GPU-Util.)

A CPU makes the same mistake visible with ``top``: a thread that waits for a
cache line counts as running. :func:`measure_busy` times decode steps on the
engine and reports what the machine's own counter says (the process's CPU time
against the wall time on a CPU, nvidia-smi's GPU-Util on a GPU), so that the
lesson can put it beside the bandwidth and FLOPs those steps achieved.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kvpaging.teach.roofline import synchronize

__all__ = ["BusyReport", "measure_busy", "parse_gpu_util"]


@dataclass(frozen=True)
class BusyReport:
    device: str
    batch: int
    decode_steps: int
    step_s: float  # wall seconds per decode step, averaged over the timed steps
    mean_context: int  # tokens each sequence holds half way through the timed steps
    busy: float | None  # the share of the time the device's own counter called busy (None: no counter here)
    busy_source: str  # how ``busy`` was read


def parse_gpu_util(text: str) -> list[float]:
    """GPU-Util samples (0-1) from ``nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits`` output."""
    samples = []
    for line in text.splitlines():
        first = line.split(",")[0].strip()
        if first.isdigit():
            samples.append(int(first) / 100)
    return samples


class _GpuUtilSampler:
    """nvidia-smi's GPU-Util, read every ``every_s`` seconds in a background thread while the steps run."""

    def __init__(self, device: torch.device, every_s: float):
        self.device, self.every_s = device, every_s
        self.samples: list[float] = []
        self.source = "nvidia-smi GPU-Util, mean of samples"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> float | None:
        try:
            return torch.cuda.utilization(self.device) / 100  # through NVML, when pynvml is installed
        except Exception:  # noqa: BLE001 - no NVML binding: ask the command-line tool
            pass
        if shutil.which("nvidia-smi") is None:
            return None
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        run = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=utilization.gpu",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
        samples = parse_gpu_util(run.stdout)
        return samples[0] if samples else None

    def _run(self) -> None:
        while not self._stop.is_set():
            value = self._read()
            if value is None:
                return
            self.samples.append(value)
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def measure_busy(llm, prompt_len: int = 64, batch: int = 1, decode_steps: int = 24, seed: int = 0,
                 sample_every_s: float = 0.02) -> BusyReport:
    """Run ``decode_steps`` decode steps of ``batch`` random prompts and read the device's busy counter meanwhile.

    The prompts are computed first (one prefill step, not timed). The decode steps
    then run back to back, as in serving: the clock and the counter cover them
    all, with one synchronisation at the end. On a CPU, ``busy`` is the process's
    CPU time over the wall time times the number of torch threads; on a GPU, the
    mean of nvidia-smi's GPU-Util sampled every ``sample_every_s`` seconds.
    Whatever is left of the requests is run to its end before returning.
    """
    from kvpaging.sampling_params import SamplingParams

    if decode_steps < 1:
        raise ValueError(f"decode_steps must be at least 1, got {decode_steps!r}")
    engine = llm.engine
    device = next(engine.model.parameters()).device
    vocab = engine.model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=generator).tolist()
        engine.add_request(f"busy-{seed}-{i}", prompt, params)
    engine.step()  # the prefill (and the first token)
    synchronize(device)
    on_gpu = device.type == "cuda"
    with _GpuUtilSampler(device, sample_every_s) if on_gpu else nullcontext() as sampler:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(decode_steps):
            engine.step()
        synchronize(device)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    while engine.has_unfinished_requests():
        engine.step()
    if on_gpu:
        busy = sum(sampler.samples) / len(sampler.samples) if sampler.samples else None
        source = sampler.source if sampler.samples else "no GPU-Util counter readable here"
    else:
        threads = torch.get_num_threads()
        busy = min(1.0, cpu / (wall * threads))
        source = f"process CPU time / wall time, {threads} thread{'s' if threads > 1 else ''}"
    return BusyReport(str(device), batch, decode_steps, wall / decode_steps, prompt_len + decode_steps // 2, busy,
                      source)
