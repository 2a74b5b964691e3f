"""The learner's workbook (kvpaging.teach.workbook): lesson 04's allocator, once it passes, kept for lesson 12.

The learner's classes are made the way a notebook makes them: their source is a "cell" registered in linecache
under a name of its own (as IPython does) and run with exec, so ``inspect.getsource`` cannot find the class.
"""

from __future__ import annotations

import inspect
import linecache
import textwrap

import pytest

from kvpaging.teach import workbook
from kvpaging.teach.build import check_block_allocator, check_fp8_quantizer, check_paged_attention, check_step_planner
from kvpaging.teach.mini_engine import ReferenceAllocator, use

# A learner's allocator, different from the reference in its names and its order of blocks (a deque, popped left).
GOOD = textwrap.dedent('''
    class MyAllocator:
        def __init__(self, num_blocks, block_size):
            from collections import deque
            self.bs = block_size
            self.free_ids = deque(range(num_blocks))
            self.blocks, self.sizes = {}, {}

        @property
        def num_free_blocks(self):
            return len(self.free_ids)

        def table(self, seq_id):
            return list(self.blocks[seq_id])

        def allocate(self, seq_id, num_tokens):
            need = (num_tokens + self.bs - 1) // self.bs
            if need > len(self.free_ids):
                return False
            self.blocks[seq_id] = [self.free_ids.popleft() for _ in range(need)]
            self.sizes[seq_id] = num_tokens
            return True

        def append(self, seq_id):
            if self.sizes[seq_id] % self.bs == 0:
                if not self.free_ids:
                    return False
                self.blocks[seq_id].append(self.free_ids.popleft())
            self.sizes[seq_id] += 1
            return True

        def free(self, seq_id):
            self.free_ids.extend(self.blocks.pop(seq_id))
            del self.sizes[seq_id]
''')

STUB = textwrap.dedent('''
    class MyAllocator:
        def __init__(self, num_blocks, block_size):
            raise NotImplementedError("write your allocator")
''')

_cells = 0


def cell(source: str, namespace: dict | None = None) -> dict:
    """Run ``source`` as a notebook cell: its text known to linecache under a cell's name, not a file."""
    global _cells
    _cells += 1
    name = f"<ipython-input-{_cells}-test>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    namespace = {} if namespace is None else namespace
    exec(compile(source, name, "exec"), namespace)
    return namespace


@pytest.fixture(autouse=True)
def empty_workbook(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPAGING_WORKBOOK", str(tmp_path / "workbook"))
    return tmp_path / "workbook"


def test_source_of_a_class_made_in_a_cell():
    cls = cell("x = 1\n" + GOOD + "y = 2\n")["MyAllocator"]
    with pytest.raises((OSError, TypeError)):
        inspect.getsource(cls)  # what makes source_of necessary on this Python
    source = workbook.source_of(cls)
    assert source.lstrip().startswith("class MyAllocator:") and "x = 1" not in source and "y = 2" not in source
    assert source.strip() == GOOD.strip()


def test_a_passing_allocator_is_kept_and_comes_back_working(empty_workbook, capsys):
    cls = cell(GOOD)["MyAllocator"]
    path = workbook.keep("allocator", cls, check_block_allocator)
    assert path == empty_workbook / "allocator.py" and path.exists()
    assert str(path) in capsys.readouterr().out
    again = workbook.kept("allocator")
    assert again is not cls and again.__name__ == "MyAllocator"
    check = check_block_allocator(again)
    assert check.written and check.passed


def test_a_stub_or_a_wrong_allocator_is_not_kept(empty_workbook):
    assert workbook.keep("allocator", cell(STUB)["MyAllocator"], check_block_allocator) is None
    wrong = cell(GOOD.replace("if self.sizes[seq_id] % self.bs == 0:", "if self.sizes[seq_id] % self.bs == 1:"))
    assert workbook.keep("allocator", wrong["MyAllocator"], check_block_allocator) is None
    assert not empty_workbook.exists() and workbook.kept("allocator") is None


def test_a_class_that_needs_names_from_other_cells_is_not_kept(empty_workbook, capsys):
    namespace = cell("from collections import deque\n")
    leaning = GOOD.replace("        from collections import deque\n", "")
    assert leaning != GOOD
    cls = cell(leaning, namespace)["MyAllocator"]
    assert check_block_allocator(cls).ok  # it works in its notebook...
    assert workbook.keep("allocator", cls, check_block_allocator) is None  # ...but its source alone does not
    out = capsys.readouterr().out
    assert "not kept" in out and "NameError" in out and "deque" in out
    assert not (empty_workbook / "allocator.py").exists()


def test_lesson_12_takes_the_kept_allocator_when_its_own_cell_is_a_stub(empty_workbook):
    stub = cell(STUB)["MyAllocator"]
    before = use("allocator", stub)
    assert not before.mine and before.piece is ReferenceAllocator and "kept none" in before.reason
    workbook.keep("allocator", cell(GOOD)["MyAllocator"], check_block_allocator)
    after = use("allocator", stub)
    assert after.mine and after.piece.__name__ == "MyAllocator" and after.piece is not ReferenceAllocator
    assert after.kept_in == str(empty_workbook / "allocator.py") and "lesson 04" in repr(after)
    # one written in lesson 12 itself comes first
    own = cell(GOOD)["MyAllocator"]
    assert use("allocator", own).piece is own and not use("allocator", own).kept_in


def test_a_kept_file_that_went_wrong_gives_the_reference_and_says_so(empty_workbook):
    workbook.keep("allocator", cell(GOOD)["MyAllocator"], check_block_allocator)
    path = empty_workbook / "allocator.py"
    path.write_text(path.read_text().replace("% self.bs == 0", "% self.bs == 1"))  # edited by hand, badly
    choice = use("allocator", cell(STUB)["MyAllocator"])
    assert not choice.mine and choice.piece is ReferenceAllocator and "workbook" in choice.reason


PAGED = textwrap.dedent('''
    def my_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, scale):
        import torch
        out = torch.empty_like(query)
        block_size, group = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
        for b in range(query.shape[0]):
            t = torch.arange(int(seq_lens[b]))
            blocks = block_tables[b, t // block_size].long()
            keys, values = k_cache[blocks, t % block_size], v_cache[blocks, t % block_size]
            for h in range(query.shape[1]):
                weights = torch.softmax(keys[:, h // group] @ query[b, h] * scale, dim=0)
                out[b, h] = weights @ values[:, h // group]
        return out
''')


PLAN = textwrap.dedent('''
    def plan_step(running, waiting, budget, max_num_seqs):
        plan, seats = {}, len(running)
        for seq_id, left in running:
            if budget:
                plan[seq_id] = min(left, budget)
                budget -= plan[seq_id]
        for seq_id, left in waiting:
            if not budget or seats == max_num_seqs:
                break
            plan[seq_id] = min(left, budget)
            budget -= plan[seq_id]
            seats += 1
        return plan
''')


QUANTIZE = textwrap.dedent('''
    def my_quantize(x):
        import torch
        heads = x.shape[-2]
        amax = x.abs().float().transpose(0, 1).reshape(heads, -1).max(dim=1).values
        scales = torch.clamp(amax / 448.0, min=1e-12)
        return (x.float() / scales[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scales
''')


# piece, its lesson, its source, the function's name, its check, what repr names, a mistake in it
CARRIED = [
    ("quantize", "09", QUANTIZE, "my_quantize", check_fp8_quantizer, "random key/value tensors",
     ("amax / 448.0", "amax / 240.0")),  # e4m3fnuz's largest number, not e4m3fn's
    ("paged_attention", "04b", PAGED, "my_paged_attention", check_paged_attention, "random paged caches",
     (" * scale", "")),  # the scale forgotten
    ("plan", "07", PLAN, "plan_step", check_step_planner, "steps of random workloads",
     (" or seats == max_num_seqs", "")),  # the sequence cap forgotten
]


@pytest.mark.parametrize("name, lesson, source, function, check, what, mistake", CARRIED, ids=[c[0] for c in CARRIED])
def test_an_earlier_lessons_function_carries_over_to_lesson_12(empty_workbook, name, lesson, source, function, check,
                                                               what, mistake):
    stub = cell(f"def {function}(*args):\n    raise NotImplementedError\n")[function]
    assert f"lesson {lesson} kept none" in use(name, stub).reason
    path = workbook.keep(name, cell(source)[function], check)
    assert path == empty_workbook / f"{name}.py"
    choice = use(name, stub)
    assert choice.mine and choice.kept_in == str(path) and f"lesson {lesson}" in repr(choice) and what in repr(choice)
    # a wrong one is neither kept nor taken
    wrong = cell(source.replace(*mistake))[function]
    path.unlink()
    assert not check(wrong).ok and not use(name, wrong).mine
    assert workbook.keep(name, wrong, check) is None and not path.exists()


def test_a_piece_whose_source_cannot_be_found_is_not_kept_and_says_so(empty_workbook, capsys):
    """A class made with type() has no class statement to copy: keep says so instead of failing the lesson's cell."""
    body = textwrap.dedent(GOOD.split("class MyAllocator:\n", 1)[1])  # the methods, as top-level functions
    functions = cell(body)
    members = ("__init__", "num_free_blocks", "table", "allocate", "append", "free")
    made = type("MyAllocator", (), {name: functions[name] for name in members})
    assert check_block_allocator(made).ok
    assert workbook.keep("allocator", made, check_block_allocator) is None
    assert "not kept" in capsys.readouterr().out and not (empty_workbook / "allocator.py").exists()


# A learner's lesson-05 allocator: reference counts, fork and copy-on-write (blocks handed out from the front).
SHARING = textwrap.dedent('''
    class SharingAllocator:
        def __init__(self, num_blocks, block_size):
            self.bs, self.free_ids, self.refs = block_size, list(range(num_blocks)), [0] * num_blocks
            self.blocks, self.sizes = {}, {}

        @property
        def num_free_blocks(self):
            return len(self.free_ids)

        def table(self, seq_id):
            return self.blocks[seq_id]

        def _new(self):
            block = self.free_ids.pop(0)
            self.refs[block] = 1
            return block

        def allocate(self, seq_id, num_tokens):
            need = -(-num_tokens // self.bs)
            if need > len(self.free_ids):
                return False
            self.blocks[seq_id] = [self._new() for _ in range(need)]
            self.sizes[seq_id] = num_tokens
            return True

        def fork(self, parent_id, child_id):
            self.blocks[child_id] = list(self.blocks[parent_id])
            self.sizes[child_id] = self.sizes[parent_id]
            for block in self.blocks[child_id]:
                self.refs[block] += 1

        def append(self, seq_id):
            table, full = self.blocks[seq_id], self.sizes[seq_id] % self.bs == 0
            shared = not full and self.refs[table[-1]] > 1
            if (full or shared) and not self.free_ids:
                return False
            if full:
                table.append(self._new())
            elif shared:
                self.refs[table[-1]] -= 1
                table[-1] = self._new()
            self.sizes[seq_id] += 1
            return True

        def free(self, seq_id):
            for block in self.blocks.pop(seq_id):
                self.refs[block] -= 1
                if self.refs[block] == 0:
                    self.free_ids.append(block)
            del self.sizes[seq_id]
''')


def test_lesson_05s_sharing_allocator_carries_over_to_lesson_12(empty_workbook):
    import functools

    check = functools.partial(check_block_allocator, fork=True)
    stub = cell(STUB.replace("MyAllocator", "MySharingAllocator"))["MySharingAllocator"]
    assert "lesson 05 kept none" in use("sharing_allocator", stub).reason
    path = workbook.keep("sharing_allocator", cell(SHARING)["SharingAllocator"], check)
    assert path == empty_workbook / "sharing_allocator.py"
    choice = use("sharing_allocator", stub)
    assert choice.mine and choice.kept_in == str(path) and "lesson 05" in repr(choice) and "forks" in repr(choice)
    # one that writes into a shared block (no copy-on-write) is neither kept nor taken
    wrong = cell(SHARING.replace("shared = not full and self.refs[table[-1]] > 1", "shared = False"))
    path.unlink()
    assert not check(wrong["SharingAllocator"]).ok and not use("sharing_allocator", wrong["SharingAllocator"]).mine
    assert workbook.keep("sharing_allocator", wrong["SharingAllocator"], check) is None and not path.exists()
