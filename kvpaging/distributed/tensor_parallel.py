"""Tensor parallelism: one model split across ``tensor_parallel_size`` processes, its KV cache split by heads.

With N ranks, rank r holds (H query heads, K KV heads, I MLP features, V vocabulary entries):

* attention: query heads ``[r*H/N, (r+1)*H/N)`` and KV heads ``[r*K/N, (r+1)*K/N)``, that is the
  matching rows of ``q_proj``, ``k_proj``, ``v_proj`` (column-parallel) and the matching columns of
  ``o_proj`` (row-parallel). With grouped-query attention a query head's KV head lands on its rank.
* the KV cache: the same ``num_blocks`` blocks as every other rank, each holding only its K/N heads,
  tensors of ``[num_blocks, block_size, K/N, head_dim]``. So for the same bytes per rank (per GPU),
  a rank holds N times the blocks, N times the tokens, that one device holding every head would.
* the MLP: I/N features, rows of ``gate_proj`` and ``up_proj``, columns of ``down_proj``.
* the embedding and the LM head: V/N rows of each (a tied pair stays one tensor on every rank).
* everything else (norms, rotary tables, Qwen3's per-head ``q_norm``/``k_norm``): a full copy.

A row-parallel layer (``o_proj``, ``down_proj``) gives every rank a partial sum of the output; an
all-reduce adds them, so each rank goes on with the whole hidden state. The embedding does the same
(a rank looks up the ids in its vocabulary range, zeros elsewhere). That is 2 all-reduces per layer
plus 1, each of ``num_tokens x hidden_size`` elements. The LM head's logits, V/N columns per rank,
are gathered to rank 0.

Rank 0 is the caller's own process. It alone runs the scheduler, the block manager and the sampler:
one copy of the block tables serves every rank, because block b holds the same token slots on every
rank (only for different heads). Each step, rank 0 broadcasts the step's inputs (a fixed-size header
of sizes, over gloo even on GPUs, then one int64 payload on the device: token ids, positions, slots,
block tables, lengths, copy-on-write pairs);
then every rank runs the same forward pass over its shard. Prefix-cache hits and copy-on-write need
nothing more: they are block-table decisions, and every rank applies the same ones.

Which layers split which way comes from transformers' own tensor-parallel plan (``config.base_model_tp_plan``
and the model class's ``_tp_plan``). transformers applies that plan inside ``from_pretrained(tp_plan="auto")``:
it loads a checkpoint from disk, expects a torchrun-style launch (one process per rank, started by the user,
with the default process group) and makes the weights DTensors. The engine serves model objects that may have
no checkpoint (random weights, a user's fine-tuned model in memory), from a process it did not launch, and
keeps its forward pass in plain tensors; so it reads the plan and cuts plain tensors itself, with forward hooks
for the collectives. The user's model is only read: every rank's tensors are new ones.

Processes: the workers (ranks 1..N-1) are ``torch.multiprocessing`` processes (started by its fork
server, see ``_worker_context``), daemons, one per GPU on CUDA (NCCL) or CPU processes over gloo. Each
receives its shard with its start arguments (torch moves the tensors through shared memory). On a CPU
every rank runs as many torch threads as the caller's process has when the ``LLM`` is made: for N ranks
on C cores, call ``torch.set_num_threads(C // N)`` first, or the ranks fight over the cores. Each
engine makes its own process group objects (no global ``init_process_group``), so several
tensor-parallel engines can live in one process. As with any spawn-style start, a worker imports
the caller's main script again (not a notebook): a script that makes a tensor-parallel ``LLM``
does so under ``if __name__ == "__main__":``, or each worker would try to make one too.

Faults: a worker that raises writes its traceback into the group's store and exits; a dead worker
breaks its peers' sockets, so rank 0's next collective fails within milliseconds and the engine raises
``TensorParallelError`` naming the rank, its exit code and its error. Collectives inside a step time
out after ``STEP_TIMEOUT`` (a worker alive but stuck). Any failure on rank 0 during a step also ends the
group (its workers would be left mid-layer): the workers are stopped and further steps are refused.
``LLM.shutdown()``, garbage collection and interpreter exit (``weakref.finalize``) stop the workers;
a worker whose rank 0 disappears (killed outright) exits by itself within a second.
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
import sys
import threading
import time
import traceback
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from kvpaging.config import EngineConfig
from kvpaging.core.scheduler_output import SchedulerOutput
from kvpaging.distributed.plan import shard_styles
from kvpaging.errors import TensorParallelError
from kvpaging.worker.fp8_scales import calibrate_fp8_scales
from kvpaging.worker.model_runner import ModelRunner, StepInputs

logger = logging.getLogger("kvpaging")

__all__ = ["TensorParallelRunner", "shard_model"]

STEP_TIMEOUT = datetime.timedelta(seconds=120)  # any one collective inside a step (one layer's work)
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waits for the next step as long as the user likes
START_TIMEOUT_S = 300.0  # spawning, importing torch and building the shard, per engine
STOP_TIMEOUT_S = 5.0  # a worker asked to stop gets this long before it is terminated

_STEP, _STOP = 1, 2  # the header's first entry
# header: op, num_tokens, num_seqs, table width, len(prefill_cu_seqlens_q), num_logits, num_decodes,
# num copy pairs, all_positions
_HEADER_LEN = 9


# ------------------------------------------------------------------------------------- the shards

def shard_model(model, rank: int, tp: int, styles: dict[str, str], device=None, shared: bool = False):
    """A copy of ``model`` holding rank ``rank``'s share of every weight, on ``device`` (default: the
    model's); with ``shared``, in shared memory, ready to be sent to a worker without another copy.

    Every tensor of the copy is new (the user's model is only read, and shipping the copy to a
    worker through shared memory cannot move the user's tensors). Column-parallel weights, the
    embedding and the LM head keep rows ``[rank*n/tp, (rank+1)*n/tp)``; row-parallel weights keep
    those columns, and their bias lives on rank 0 only (the all-reduce adds it once).
    """
    parts: dict[int, tuple[torch.Tensor, bool]] = {}  # the user's tensor's id -> (its part, is a parameter)
    for module_name, module in model.named_modules():
        style = styles.get(module_name)
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for leaf, tensor in tensors:
            if id(tensor) in parts:  # a tied weight: the embedding and the LM head split the same way
                continue
            part = tensor.detach()
            if style in ("colwise", "vocab", "lm_head"):
                part = part.chunk(tp, dim=0)[rank]
            elif style == "rowwise":
                part = part.chunk(tp, dim=1)[rank] if leaf == "weight" else (part if rank == 0 else torch.zeros_like(part))
            parts[id(tensor)] = (part, isinstance(tensor, nn.Parameter))
    # The parts are copied into one buffer per dtype, so that a shard travels to its worker as a few
    # shared-memory segments rather than one per tensor (a file descriptor each: the fork server
    # passes at most 256 with one process).
    device = torch.device(device) if device is not None else next(model.parameters()).device
    sizes: dict[torch.dtype, int] = {}
    offsets = {}
    for key, (part, _) in parts.items():
        start = sizes.get(part.dtype, 0)
        offsets[key] = start
        sizes[part.dtype] = start + -(-part.numel() // 64) * 64  # each view starts 64 elements along: aligned
    buffers = {dtype: torch.empty(size, dtype=dtype, device=device) for dtype, size in sizes.items()}
    if shared:
        buffers = {dtype: buffer.share_memory_() for dtype, buffer in buffers.items()}
    memo: dict[int, torch.Tensor] = {}
    for key, (part, is_parameter) in parts.items():
        view = buffers[part.dtype][offsets[key]:offsets[key] + part.numel()].view(part.shape)
        view.copy_(part)
        memo[key] = nn.Parameter(view, requires_grad=False) if is_parameter else view
    shard = copy.deepcopy(model, memo)
    for module in shard.modules():  # their sizes, as the shard's repr shows them
        if type(module) is nn.Linear:
            module.out_features, module.in_features = module.weight.shape
        elif type(module) is nn.Embedding:
            module.num_embeddings = module.weight.shape[0]
    return shard.eval()


class VocabShardEmbedding(nn.Module):
    """Rows ``[start, start + n)`` of the embedding table: ids in that range are looked up, the others
    give zeros, and an all-reduce adds up the ranks' rows, so every rank gets every token's embedding."""

    def __init__(self, embedding: nn.Embedding, start: int, group) -> None:
        super().__init__()
        self.embedding = embedding
        self.start = start
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.embedding.num_embeddings)
        out = self.embedding(local.masked_fill(outside, 0)).masked_fill_(outside.unsqueeze(-1), 0)
        _all_reduce(self.group, out)
        return out


def install_collectives(model, styles: dict[str, str], group, rank: int, tp: int) -> None:
    """Add the collectives to a rank's shard: an all-reduce after each row-parallel layer, the
    vocabulary-split embedding, and the LM head's gather to rank 0 (rank 0 gets the whole vocabulary)."""
    for module_name, style in styles.items():
        module = model.get_submodule(module_name)
        if style == "rowwise":
            module.register_forward_hook(lambda m, args, out: _all_reduce(group, out))
        elif style == "lm_head":
            module.register_forward_hook(lambda m, args, out: _gather_to_rank0(group, rank, tp, out))
        elif style == "vocab":
            parent_name, _, leaf = module_name.rpartition(".")
            start = rank * module.num_embeddings
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf,
                    VocabShardEmbedding(module, start, group))


def _all_reduce(group, tensor: torch.Tensor) -> None:
    group.allreduce([tensor]).wait()


def _gather_to_rank0(group, rank: int, tp: int, tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.contiguous()
    if rank == 0:
        parts = [torch.empty_like(tensor) for _ in range(tp)]
        group.gather(parts, tensor, 0).wait()
        return torch.cat(parts, dim=-1)
    group.gather([], tensor, 0).wait()
    return tensor  # a worker's logits are not used


def _make_groups(device: torch.device, store, rank: int, size: int):
    """This engine's own process groups, ``(control, data)``; no global state is touched.

    ``control`` carries the step headers (and the stop): gloo, on the CPU. A worker waits there
    between steps for as long as the user likes, and on a GPU a pending NCCL broadcast would be a
    kernel spinning on the device all that time. ``data`` carries the step's input tensors and the
    model's collectives: NCCL on CUDA; on a CPU it is the same gloo group.
    """
    control = dist.ProcessGroupGloo(dist.PrefixStore("kvpaging-tp-control", store), rank, size, STEP_TIMEOUT)
    if device.type != "cuda":
        return control, control
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = STEP_TIMEOUT
    return control, dist.ProcessGroupNCCL(dist.PrefixStore("kvpaging-tp-data", store), rank, size, options)


def _gather_ints(group, rank: int, tp: int, value: int, device) -> list[int]:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    parts = [torch.empty_like(t) for _ in range(tp)] if rank == 0 else []
    group.gather(parts, t, 0).wait()
    return [int(p.item()) for p in parts]


# ------------------------------------------------------------------------------------- rank 0

class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: holds rank 0's shard and KV cache, drives the workers that hold the rest.

    ``execute`` broadcasts the step's inputs, then runs the forward pass as every rank does; the
    LM head's gather gives rank 0 the logits over the whole vocabulary, so the engine samples as
    it does with one process. ``rank_kv_cache_bytes`` lists each rank's KV cache bytes, measured on
    its own cache tensors. ``worker_processes`` are the workers (ranks 1..N-1).
    """

    def __init__(self, model, config: EngineConfig) -> None:
        tp = config.tensor_parallel_size  # EngineConfig.resolve has checked the plan for this model
        styles = shard_styles(model)
        device = next(model.parameters()).device
        self.tp = tp
        self._broken: TensorParallelError | None = None
        store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        self._store = store
        ctx = _worker_context()
        threads = torch.get_num_threads()  # every rank runs as many threads as the caller's process
        cores = os.cpu_count() or 1
        if device.type == "cpu" and tp * threads > cores:
            logger.warning("tensor_parallel_size=%d ranks x %d torch threads each > %d CPU cores: the ranks will wait "
                           "on one another at every all-reduce; call torch.set_num_threads(%d) before making the LLM",
                           tp, threads, cores, max(1, cores // tp))
        self.worker_processes: list = []
        self._group_box: list = []  # the control group, once made (the finalizer reads it from here)
        self._finalizer = weakref.finalize(self, _stop_workers, self.worker_processes, self._group_box)
        try:
            for rank in range(1, tp):
                worker_device = torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device
                shard = shard_model(model, rank, tp, styles, device="cpu", shared=True)
                process = ctx.Process(target=_worker_main, name=f"kvpaging-tp-rank{rank}", daemon=True,
                                      args=(rank, tp, store.port, shard, styles, config, str(worker_device),
                                            threads, os.getpid()))
                process.start()  # pickles the shard into shared memory for the worker
                del shard
                self.worker_processes.append(process)
            super().__init__(shard_model(model, 0, tp, styles), config)  # rank 0's shard and KV cache
            self._wait_until_ready()
            control, group = _make_groups(self.device, store, 0, tp)
            self._group_box.append(control)
            install_collectives(self.model, styles, group, 0, tp)
            self.rank_kv_cache_bytes = _gather_ints(group, 0, tp, self.kv_cache_bytes, self.device)
            _calibrate_fp8(self, tp)
        except BaseException:
            self._finalizer()
            raise
        self._control, self._group = control, group

    # -- one step ------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput, all_positions: bool = False) -> torch.Tensor:
        inputs = self.prepare_inputs(out)
        self._check_workers()
        try:
            self._broadcast_step(inputs, out.blocks_to_copy, all_positions)
            return self.run(inputs, out.blocks_to_copy, all_positions)
        except Exception as error:  # the ranks are out of step now: none of them can go on
            raise self._fail(error) from error
        except BaseException as interrupt:  # Ctrl-C: the same, and the caller still gets the interrupt
            self._fail(interrupt)
            raise

    def _broadcast_step(self, inputs: StepInputs, pairs: list[tuple[int, int]], all_positions: bool) -> None:
        tables = inputs.block_tables
        parts = [inputs.input_ids.view(-1), inputs.positions.view(-1), inputs.slot_mapping, tables.reshape(-1),
                 inputs.seq_lens, inputs.prefill_cu_seqlens_q, inputs.logits_indices]
        if pairs:
            parts.append(torch.tensor(pairs, dtype=torch.int64, device=self.device).view(-1))
        header = torch.tensor([_STEP, inputs.input_ids.shape[1], tables.shape[0], tables.shape[1],
                               inputs.prefill_cu_seqlens_q.shape[0], inputs.logits_indices.shape[0],
                               inputs.num_decodes, len(pairs), int(all_positions)], dtype=torch.int64)
        payload = torch.cat([p.to(torch.int64) for p in parts])
        self._control.broadcast(header, 0).wait()
        self._group.broadcast(payload, 0).wait()

    # -- faults and shutdown --------------------------------------------------------------------
    def _check_workers(self) -> None:
        if self._broken is not None:
            raise TensorParallelError(f"this tensor-parallel engine has failed ({self._broken}); make a new LLM")
        if not self._finalizer.alive:
            raise TensorParallelError("this tensor-parallel engine has been shut down; make a new LLM")
        if any(process.exitcode is not None for process in self.worker_processes):
            raise self._fail(None)

    def _fail(self, error: BaseException | None) -> TensorParallelError:
        """Stop every worker and say why the group ended: the dead or failing workers first."""
        if error is None or isinstance(error, RuntimeError):  # a collective failed: a worker may be exiting
            deadline = time.monotonic() + 2.0  # (one that raised writes its traceback first)
            while time.monotonic() < deadline and all(p.exitcode is None for p in self.worker_processes):
                time.sleep(0.01)
        reasons = []
        for rank, process in enumerate(self.worker_processes, 1):
            if process.exitcode is None:
                continue
            reason = f"worker rank {rank} (pid {process.pid}) " + _exit_description(process.exitcode)
            text = self._worker_error(rank)
            if text:
                reason += f", after: {text.strip().splitlines()[-1]}"
            reasons.append(reason)
        if not reasons:
            reasons.append(f"rank 0 failed during a step ({type(error).__name__}: {error})")
        self._broken = TensorParallelError("; ".join(reasons))
        self._group_box.clear()  # the group is out of step: the workers are terminated, not asked
        self._finalizer()
        logger.error("tensor-parallel group ended: %s", self._broken)
        return TensorParallelError(f"tensor parallelism failed: {self._broken}; this engine cannot run any more "
                                   "(make a new LLM)")

    def _worker_error(self, rank: int) -> str:
        try:
            key = f"error/{rank}"
            return self._store.get(key).decode() if self._store.check([key]) else ""
        except Exception:  # noqa: BLE001 - the message is a courtesy
            return ""

    def _wait_until_ready(self) -> None:
        keys = [f"ready/{rank}" for rank in range(1, self.tp)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._store.check(keys):
            for rank, process in enumerate(self.worker_processes, 1):
                if process.exitcode is not None:
                    text = self._worker_error(rank)
                    raise TensorParallelError(
                        f"tensor-parallel worker rank {rank} {_exit_description(process.exitcode)} while starting"
                        + (f":\n{text}" if text else
                           " (its traceback is on stderr; if this is a script, make the LLM under "
                           "if __name__ == '__main__': every worker imports the main script again)"))
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers not ready after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.01)

    def shutdown(self) -> None:
        self._finalizer()


def _exit_description(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _stop_workers(processes: list, group_box: list) -> None:
    """Ask the workers to stop (when the group is in step), then terminate and finally kill any that
    are still there."""
    if group_box and all(p.exitcode is None for p in processes):
        group = group_box.pop()
        try:
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
            header[0] = _STOP
            group.broadcast(header, 0).wait(datetime.timedelta(seconds=STOP_TIMEOUT_S))
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for process in processes:
                process.join(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - they are terminated below
            pass
    for process in processes:
        if process.exitcode is None:
            process.terminate()
            process.join(1.0)
        if process.exitcode is None:
            process.kill()
            process.join()


# ------------------------------------------------------------------------------------- the workers

def _calibrate_fp8(runner: ModelRunner, tp: int) -> None:
    """An FP8 cache's per-head scales, every rank at once: the calibration passes run the model through the
    all-reduces like any step, and each rank keeps the scales of its own KV heads. The random calibration
    ids span the whole vocabulary (a rank's LM head holds 1/tp of it), so they are those of one process."""
    if runner.kv_cache_dtype == torch.float8_e4m3fn:
        vocab = runner.model.get_output_embeddings().weight.shape[0] * tp
        runner.kv_scales = calibrate_fp8_scales(runner, vocab_size=vocab)


def _worker_context():
    """Workers start from torch.multiprocessing's fork server, which imports torch, transformers and
    kvpaging once per user process, then forks a fresh worker for each rank from that clean,
    single-threaded state. It has what "spawn" is chosen for (no copy of the caller's threads, CUDA
    state or memory) without paying the imports again for every worker of every engine: on a loaded
    2-core machine those imports take some 10 s, starting a fork takes well under one."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["kvpaging.distributed.tensor_parallel", "transformers.modeling_utils"])
    return ctx


def _worker_main(rank: int, tp: int, port: int, shard, styles: dict[str, str], config: EngineConfig,
                 device_name: str, threads: int, rank0_pid: int) -> None:
    """A worker's life: build its runner over its shard, join the group, then run the steps rank 0 sends."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it then stops the workers
    threading.Thread(target=_exit_without_rank0, args=(rank0_pid,), daemon=True).start()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    try:
        torch.set_num_threads(threads)
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            shard.to(device)
        runner = ModelRunner(shard, config)
        del shard
        store.set(f"ready/{rank}", "1")
        control, group = _make_groups(device, store, rank, tp)
        install_collectives(runner.model, styles, group, rank, tp)
        _gather_ints(group, rank, tp, runner.kv_cache_bytes, device)
        _calibrate_fp8(runner, tp)
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)  # on the CPU: the control group is gloo
        while True:
            control.broadcast(header, 0, IDLE_TIMEOUT).wait()
            op, num_tokens, num_seqs, width, num_cu, num_logits, num_decodes, num_pairs, all_positions = header.tolist()
            if op == _STOP:
                break
            if op != _STEP:
                raise ValueError(f"rank {rank} received an unknown operation {op} from rank 0")
            sizes = [num_tokens, num_tokens, num_tokens, num_seqs * width, num_seqs, num_cu, num_logits, 2 * num_pairs]
            payload = torch.empty(sum(sizes), dtype=torch.int64, device=device)
            group.broadcast(payload, 0).wait()
            ids, positions, slots, tables, seq_lens, cu, logits_indices, pairs = payload.split(sizes)
            inputs = StepInputs(
                input_ids=ids.view(1, -1), positions=positions.view(1, -1), slot_mapping=slots,
                block_tables=tables.view(num_seqs, width).to(torch.int32), seq_lens=seq_lens.to(torch.int32),
                prefill_cu_seqlens_q=cu.to(torch.int32), logits_indices=logits_indices, num_decodes=num_decodes)
            runner.run(inputs, [tuple(p) for p in pairs.view(-1, 2).tolist()], bool(all_positions))
    except BaseException:  # noqa: BLE001 - tell rank 0 why, then leave at once (closing the sockets)
        text = traceback.format_exc()
        print(f"kvpaging tensor-parallel worker rank {rank} failed:\n{text}", flush=True, file=sys.stderr)
        # rank 0 reads the traceback from the store; if rank 0 is gone, the store's client would retry
        # for seconds, so the report gets a second at most
        report = threading.Thread(target=store.set, args=(f"error/{rank}", text), daemon=True)
        report.start()
        report.join(1.0)
        os._exit(1)


def _exit_without_rank0(rank0_pid: int) -> None:
    """Leave within a second once rank 0's process is gone (killed outright, it could not stop this worker)."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(rank0_pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            os._exit(1)
