"""glibc's malloc told to keep freed memory (``kvpaging/worker/host_memory.py``): large temporaries made and freed
again stop costing page faults, and a user's own malloc settings are left alone; the interpreter's frame chunks kept,
so calls at a chunk's end stop costing a fresh mapping each. Each case runs in a fresh process, since the settings are
the process's."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from kvpaging.kernels import cpu

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the setting is glibc's")

# glibc raises its mmap threshold as large blocks are freed, and whether its heap then gives the memory back varies
# from run to run (this probe saw 163,200 faults or none, five runs on 2026-12-06): the probe holds glibc's starting
# threshold, 128 KiB, fixed, so "before" is the same every run (mallopt's M_MMAP_THRESHOLD, -3)
PROBE = """
import ctypes, resource, sys, torch
from kvpaging.worker.host_memory import keep_freed_memory

ctypes.CDLL(None).mallopt(-3, 128 << 10)

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):  # a forward pass's temporaries: several alive at once, written, then freed
        xs = [torch.ones(2 << 20) for _ in range(4)]  # 8 MiB of float32 each
        del xs
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults()
plain = faults()
done = keep_freed_memory()
faults()
kept = faults()
print(done, plain, kept)
"""


def probe(env_extra: dict[str, str]) -> tuple[bool, int, int]:
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    done, plain, kept = out.stdout.split()
    return done == "True", int(plain), int(kept)


def test_freed_temporaries_stop_faulting_once_malloc_keeps_freed_memory():
    done, plain, kept = probe({})
    assert done
    # before: the freed blocks went back to the kernel, and came again as fresh pages (2,048 faults each block);
    # after: the same pages again
    assert plain >= 20 * 2000, plain
    assert kept < plain / 20, (plain, kept)


def test_a_users_own_malloc_settings_are_left_alone():
    done, plain, kept = probe({"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert not done
    assert kept >= plain / 2, (plain, kept)  # nothing changed: still faulting


# Calls at every depth: at the depths where a call's frame starts a new chunk of the data stack, each call maps a fresh
# chunk (a page fault as its frame is written) and unmaps it on return, unless the chunks are kept.
CHUNKS_PROBE = """
import resource, sys, threading
from kvpaging.worker import host_memory

def leaf(a, b, c, d):
    return a

def at(depth):
    if depth:
        return at(depth - 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(2000):
        leaf(1, 2, 3, 4)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def worst():
    return max(at(depth) for depth in range(400))

worst()
plain = worst()
done = host_memory.keep_frame_chunks()
worst()
reused = host_memory.frame_chunks_reused()
kept = worst()
reused = host_memory.frame_chunks_reused() - reused

# then threads (each its own data stack), garbage and a recursion of 15,000 frames (chunks of every size) through it
def work():
    for _ in range(30):
        junk = [list(range(1000)) for _ in range(100)]
        del junk
        at(150), at(300)

threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
sys.setrecursionlimit(20000)
def deep(n):
    return 0 if n == 0 else 1 + deep(n - 1)
print(done, plain, kept, reused, deep(15000))
"""


@pytest.mark.skipif(not (3, 11) <= sys.version_info[:2] <= (3, 13), reason="CPython 3.11-3.13's frame chunks")
@pytest.mark.skipif(cpu.frame_chunk_keeper() is None, reason="frame_chunks.c does not build here")
def test_calls_at_a_chunks_end_stop_mapping_memory_once_frame_chunks_are_kept():
    out = subprocess.run([sys.executable, "-c", CHUNKS_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    done, plain, kept, reused, depth = out.stdout.split()
    assert done == "True"
    assert depth == "15000"
    # before: at the worst depth, every one of the 2,000 calls faulted in a fresh chunk; after: none did, and the kept
    # chunks served those calls instead
    assert int(plain) >= 2000, plain
    assert int(kept) < 50, (plain, kept)
    assert int(reused) >= 2000, reused
