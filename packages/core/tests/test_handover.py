"""A handover (`vlenvoys.wire.shm`): rows written once into host chunks (`vlenvoys.worker.arena`), handed over by
place, mapped by the client (`vlenvoys.engine.handover`)."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import time

import pytest
import torch

from vlenvoys.engine import handover
from vlenvoys.engine.handover import received
from vlenvoys.wire import shm
from vlenvoys.worker import arena as worker_arena
from vlenvoys.worker.arena import BLOCKS_A_CHUNK, Arena


def mine(name: str) -> list[str]:
    """This arena's files still in shared memory."""
    return sorted(entry for entry in os.listdir(shm.SHARED_MEMORY) if entry.startswith(f"vlenvoys-{name}-"))


def write_steps(arena: Arena, steps: list[torch.Tensor], lengths: list[list[int]]) -> dict[int, list]:
    """Each step's rows into one block, split into requests as `Collector` does; request -> its pieces."""
    pieces: dict[int, list] = {}
    request = 0
    for rows, counts in zip(steps, lengths, strict=True):
        block, chunk, offset = arena.block(rows.shape, rows.dtype, holders=len(counts))
        block.copy_(rows)
        row_bytes = rows[0].numel() * rows.element_size()
        for count in counts:
            pieces.setdefault(request, []).append((chunk, offset, count))
            offset += count * row_bytes
            request += 1
    return pieces


@pytest.fixture(params=["files", "process memory"])
def where(request, monkeypatch):
    if request.param == "files" and not os.access(shm.SHARED_MEMORY, os.W_OK):
        pytest.skip(f"{shm.SHARED_MEMORY} is not writable here")
    monkeypatch.setattr(worker_arena, "FIRST_CHUNK", 4096)  # a few steps per chunk: rows span chunks
    monkeypatch.setattr(worker_arena, "LARGEST_CHUNK", 8192)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_come_back_equal_and_no_file_outlives_the_arena(where, dtype):
    name = f"test-{os.getpid()}-{where.replace(' ', '')}-{str(dtype)[6:]}"
    arena = Arena(name, device_copies=False)
    arena.files = where == "files"
    generator = torch.Generator().manual_seed(0)
    lengths = [[3, 5], [2], [7, 1, 4], [6], [200, 100], [1]]  # 300 rows: a block larger than any chunk
    steps = [torch.randn(sum(counts), 2, 8, generator=generator).to(dtype) for counts in lengths]
    pieces = write_steps(arena, steps, lengths)
    expected = torch.cat(steps).split([count for counts in lengths for count in counts])
    layout = {"v": ([2, 8], str(dtype).removeprefix("torch."))}
    got = []
    for batch in ([0, 1], [2], [3, 4, 5], [6, 7], [8, 9]):  # handed over in several takes, as requests finish
        arena.acknowledge("c")
        handed = arena.handover({"v": [pieces[number] for number in batch]}, layout, owner="c")
        assert (handed["inline"] is not None) == (where == "process memory")
        got.extend(received(handed)["v"])
    arena.close()
    assert mine(name) == [], "close removed every file"
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.dtype == dtype and torch.equal(ours, theirs), "a client's mapping outlives the file's name"
    # Private mappings: writing into a returned tensor changes no other request's rows.
    got[0].zero_()
    assert torch.equal(got[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unread_rows_read_into_place_are_the_rows(where, dtype):
    """`rows_of` and `read_rows`: runs of each request's rows (some skipped, some across two chunks' pieces)
    land in one destination's rows in order, read from the files or the inline bytes; `Rows.tensor` is all of them."""
    name = f"test-{os.getpid()}-unread-{where.replace(' ', '')}-{str(dtype)[6:]}"
    arena = Arena(name, device_copies=False)
    arena.files = where == "files"
    generator = torch.Generator().manual_seed(1)
    lengths = [[3, 5], [2], [7, 1, 4], [200], [100]]
    steps = [torch.randn(sum(counts), 2, 8, generator=generator).to(dtype) for counts in lengths]
    pieces = write_steps(arena, steps, lengths)
    # The last request's rows came in two steps (a prefill in chunks): two pieces, in two chunks.
    requests = [pieces[number] for number in range(6)] + [pieces[6] + pieces[7]]
    expected = torch.cat(steps).split([3, 5, 2, 7, 1, 4, 300])
    handed = arena.handover({"v": requests}, {"v": ([2, 8], str(dtype)[6:])}, owner="c")
    unread = handover.rows_of(handed)["v"]
    assert [rows.count for rows in unread] == [len(rows) for rows in expected]
    assert (where == "files") == all(held is not None for rows in unread for held, _, _ in rows.pieces)
    assert len(unread[-1].pieces) == 2
    runs = [[(0, 3)], [(1, 5)], [(0, 1), (1, 2)], [(0, 2), (3, 7)], [(0, 1)], [(0, 4)], [(1, 150), (160, 260), (290, 300)]]
    want = torch.cat([expected[number][start:stop] for number, each in enumerate(runs) for start, stop in each])
    destination = torch.full((len(want) + 5, 2, 8), -1.0, dtype=dtype)
    reads, first = [], 5  # from row 5 on
    for rows, each in zip(unread, runs, strict=True):
        reads.append((rows, each, memoryview(destination.view(-1).view(torch.uint8).numpy()), first))
        first += sum(stop - start for start, stop in each)
    handover.read_rows(reads)
    assert torch.equal(destination[5:], want) and bool((destination[:5] == -1).all())
    assert all(torch.equal(rows.tensor(), theirs) for rows, theirs in zip(unread, expected, strict=True))
    del unread, reads
    arena.close()
    assert mine(name) == []


@pytest.fixture
def files_only(monkeypatch):
    monkeypatch.setattr(worker_arena, "FIRST_CHUNK", 4096)
    if not os.access(shm.SHARED_MEMORY, os.W_OK):
        pytest.skip(f"{shm.SHARED_MEMORY} is not writable here")


def fill(arena: Arena) -> None:
    """Use up the current chunk (and drop the filler): the next rows need another chunk."""
    chunk = arena.chunks[arena.current]
    arena.block(torch.Size([chunk.size - chunk.used]), torch.uint8)
    arena.release([(arena.current, 0, 0)])


def one_take(arena: Arena, rows: torch.Tensor, owner: str = "c") -> torch.Tensor:
    """One request's rows written, handed over and received, as a collector and its client do."""
    pieces = write_steps(arena, [rows], [[len(rows)]])
    return received(arena.handover({"v": [pieces[0]]}, {"v": ([rows.shape[1]], "float32")}, owner=owner))["v"][0]


def test_a_chunk_is_as_large_however_many_came_before(files_only, monkeypatch):
    """A chunk made while the others are busy holds `BLOCKS_A_CHUNK` blocks of its size, never more: a long
    collection that sometimes runs short of idle chunks adds one such chunk each time, not a doubling."""
    monkeypatch.setattr(worker_arena, "LARGEST_CHUNK", 1 << 20)
    name = f"test-{os.getpid()}-sizes"
    arena = Arena(name, device_copies=False)
    held = [arena.block(torch.Size([2048]), torch.uint8) for _ in range(20)]  # all kept busy: 2 KiB blocks
    sizes = {chunk.size for chunk in arena.chunks.values()}
    assert len(arena.chunks) == 20 // BLOCKS_A_CHUNK and sizes == {BLOCKS_A_CHUNK * 2048}
    big = arena.block(torch.Size([1 << 19]), torch.uint8)  # a block of its own size class: 4 of them, capped
    assert arena.chunks[big[1]].size == 1 << 20
    huge = arena.block(torch.Size([3 << 20]), torch.uint8)  # beyond the cap: the block alone
    assert arena.chunks[huge[1]].size == 3 << 20
    del held, big, huge
    arena.close()
    assert mine(name) == []


def test_a_chunk_is_reused_only_once_the_client_let_go_of_it(files_only):
    name = f"test-{os.getpid()}-reuse"
    arena = Arena(name, device_copies=False)
    first = one_take(arena, torch.full((4, 8), 1.0))
    fill(arena)
    arena.acknowledge("c")
    second = one_take(arena, torch.full((4, 8), 2.0))
    assert len(mine(name)) == 2, "the first chunk is still mapped by the client: a new one was made"
    assert torch.equal(first, torch.full((4, 8), 1.0)), "rows a client holds are never overwritten"
    del first
    gc.collect()
    fill(arena)
    arena.acknowledge("c")
    made = arena.stats()
    third = one_take(arena, torch.full((4, 8), 3.0))
    assert len(mine(name)) == 2, "the first chunk, let go, was reused"
    assert torch.equal(second, torch.full((4, 8), 2.0)) and torch.equal(third, torch.full((4, 8), 3.0))
    stats = arena.stats()
    assert stats["chunks"] == 2 and stats["bytes"] == sum(os.path.getsize(f"{shm.SHARED_MEMORY}/{f}") for f in mine(name))
    assert stats["made_bytes"] == made["made_bytes"] == stats["bytes"], "a reused chunk is not counted as made"
    assert stats["made_seconds"] == made["made_seconds"] > 0
    arena.close()
    assert mine(name) == []


@pytest.mark.parametrize("step_rows", [512, 2048, 8192, 12800])
def test_runs_of_the_same_work_make_no_chunk_after_the_first(files_only, step_rows):
    """Each run writes 12,800 rows of 2 KiB at 3 values, in steps of ``step_rows``, and lets them all go.

    A run used to begin where the last one stopped, mid-chunk: with steps of 2,048 rows the sixth run made
    a third chunk (on an H200 with V2's steps, the fourth did: `test_repeated_collections_reuse_the_workers_memory`).
    """
    name = f"test-{os.getpid()}-runs-{step_rows}"
    arena = Arena(name, device_copies=False)
    rows = torch.zeros(step_rows, 512)
    made = []
    for _ in range(8):
        left, lengths, steps = 12_800, [], []
        while left:
            count = min(step_rows, left)
            left -= count
            steps += [rows[:count]] * 3
            lengths += [[count]] * 3
        arena.acknowledge("c")
        pieces = write_steps(arena, steps, lengths)
        received(arena.handover({"v": list(pieces.values())}, {"v": ([512], "float32")}, owner="c"))
        made.append(arena.stats()["made_bytes"])
    arena.close()
    assert made == made[:1] * len(made), f"bytes made so far, run by run: {made}"


def test_unread_rows_keep_their_chunk_from_reuse_until_they_go(files_only):
    name = f"test-{os.getpid()}-unread-reuse"
    arena = Arena(name, device_copies=False)

    def unread_take(value: float) -> handover.Rows:
        pieces = write_steps(arena, [torch.full((4, 8), value)], [[4]])
        return handover.rows_of(arena.handover({"v": [pieces[0]]}, {"v": ([8], "float32")}, owner="c"))["v"][0]

    first = unread_take(1.0)
    fill(arena)
    arena.acknowledge("c")
    second = unread_take(2.0)
    assert len(mine(name)) == 2, "the first chunk's rows are not read yet: a new one was made"
    assert torch.equal(first.tensor(), torch.full((4, 8), 1.0))
    del first
    gc.collect()
    fill(arena)
    arena.acknowledge("c")
    third = unread_take(3.0)
    assert len(mine(name)) == 2, "the first chunk, let go, was reused"
    assert torch.equal(second.tensor(), torch.full((4, 8), 2.0)) and torch.equal(third.tensor(), torch.full((4, 8), 3.0))
    del second, third
    arena.close()
    assert mine(name) == []


def test_a_chunk_named_in_a_handover_waits_for_its_collector_to_call_again(files_only):
    """Between a handover and the client's mapping of it, no lock is held yet: only the next call says it is mapped."""
    name = f"test-{os.getpid()}-ack"
    arena = Arena(name, device_copies=False)
    pieces = write_steps(arena, [torch.ones(2, 8)], [[2]])
    handed = arena.handover({"v": [pieces[0]]}, {"v": ([8], "float32")}, owner="c")
    fill(arena)
    arena.acknowledge("someone else")
    one_take(arena, torch.zeros(2, 8), owner="someone else")
    assert len(mine(name)) == 2, "not reused before its collector called again"
    assert torch.equal(received(handed)["v"][0], torch.ones(2, 8))
    arena.close()


def test_rows_dropped_unhanded_free_their_chunk(files_only):
    """A request that comes back short is dropped; its chunk is reused once nobody else holds rows in it."""
    name = f"test-{os.getpid()}-dropped"
    arena = Arena(name, device_copies=False)
    pieces = write_steps(arena, [torch.ones(4, 8), torch.ones(2, 8)], [[1, 3], [2]])
    arena.release(pieces[1])
    handed = arena.handover({"v": [pieces[0], pieces[2]]}, {"v": ([8], "float32")}, owner="c")
    assert [len(rows) for rows in received(handed)["v"]] == [1, 2]
    gc.collect()
    fill(arena)
    arena.acknowledge("c")
    one_take(arena, torch.ones(2, 8))
    assert len(mine(name)) == 1, "the chunk was reused: its dropped rows hold it no longer"
    arena.close()


def test_idle_chunks_above_the_bound_are_given_up_mapped_ones_first(files_only):
    name = f"test-{os.getpid()}-keep"
    arena = Arena(name, device_copies=False, keep=4096)
    one_take(arena, torch.ones(1, 8))  # the first chunk (4 KiB): idle once filled, and nobody keeps its rows
    fill(arena)
    held = one_take(arena, torch.full((3, 8), 5.0))  # the second (4 KiB): the client keeps these rows
    fill(arena)
    free, mapped = (arena.chunks[chunk_id].path for chunk_id in sorted(arena.chunks))
    one_take(arena, torch.ones(1, 8))  # a third one is current
    arena.acknowledge("c")  # idle: 8 KiB, 4 over the bound
    assert os.path.exists(free) and not os.path.exists(mapped), "the mapped chunk went first, though the other is older"
    assert torch.equal(held, torch.full((3, 8), 5.0)), "its mapping outlives the file"
    arena.close()


def test_a_moment_without_room_makes_one_chunk_process_memory_not_every_later_one(files_only, monkeypatch):
    name = f"test-{os.getpid()}-room"
    arena = Arena(name, device_copies=False)
    monkeypatch.setattr(worker_arena, "MARGIN", 1 << 62)  # no room
    pieces = write_steps(arena, [torch.ones(2, 8)], [[2]])
    assert arena.chunks[arena.current].path is None and mine(name) == []
    handed = arena.handover({"v": [pieces[0]]}, {"v": ([8], "float32")}, owner="c")
    assert handed["inline"] is not None and torch.equal(received(handed)["v"][0], torch.ones(2, 8))
    monkeypatch.setattr(worker_arena, "MARGIN", 0)
    fill(arena)
    arena.acknowledge("c")
    arena.block(torch.Size([2 * 4096]), torch.uint8)  # larger than the first chunk: a new one
    assert arena.chunks[arena.current].path is not None and len(mine(name)) == 1
    arena.close()


def test_handovers_of_one_run_share_one_mapping_per_file(files_only):
    name = f"test-{os.getpid()}-maps"
    arena = Arena(name, device_copies=False)
    maps, got = {}, []
    for value in (1.0, 2.0, 3.0):
        pieces = write_steps(arena, [torch.full((2, 8), value)], [[2]])
        got += received(arena.handover({"v": [pieces[0]]}, {"v": ([8], "float32")}, owner="c"), maps)["v"]
        arena.acknowledge("c")
    assert len(maps) == 1, "one chunk, mapped once"
    assert [rows[0, 0].item() for rows in got] == [1.0, 2.0, 3.0], "rows written after the mapping show in it"
    arena.close()


def test_sweep_removes_the_files_of_arenas_whose_lock_is_free_only(files_only):
    living = Arena(shm.worker_name(), device_copies=False)
    one_take(living, torch.ones(2, 8))
    lock = os.path.join(shm.SHARED_MEMORY, f"vlenvoys-{living.name}.lock")
    dead = shm.worker_name()
    made = [os.path.join(shm.SHARED_MEMORY, f"vlenvoys-{dead}{suffix}") for suffix in (".lock", "-a.rows", "-b.rows")]
    orphan = os.path.join(shm.SHARED_MEMORY, f"vlenvoys-{shm.worker_name()}-c.rows")  # no lock file
    other = os.path.join(shm.SHARED_MEMORY, f"vlenvoys-test-{os.getpid()}-other.rows")  # not a worker's
    for path in (*made, orphan, other):
        open(path, "wb").close()
    try:
        removed = shm.sweep()
        assert sorted(removed) == sorted(os.path.basename(path) for path in (*made, orphan))
        assert os.path.exists(other)
        assert len(mine(living.name)) == 1 and os.path.exists(lock), "the living arena's chunk and lock are left alone"
    finally:
        living.close()
        for path in (*made, orphan, other):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    assert mine(living.name) == [] and not os.path.exists(lock), "close removed its chunk and its lock"


def test_sweep_waits_for_its_own_engines_arenas_to_be_let_go(files_only):
    """vLLM kills an engine that has not stopped 5 s after its SIGTERM; its worker may hold its lock a moment
    after the kill, and a sweep at once would leave its files. A sweep for that engine waits for them to go."""
    with shm.engine_named() as engine:
        name = shm.worker_name()
    assert name.startswith(f"rows-{engine}") and shm.ENGINE_VARIABLE not in os.environ
    files = [os.path.join(shm.SHARED_MEMORY, f"vlenvoys-{name}{suffix}") for suffix in (".lock", "-a.rows")]
    for path in files:
        open(path, "wb").close()
    holder = subprocess.Popen(  # the dying worker: holds the arena's lock for a second, then exits
        [sys.executable, "-c", "import fcntl, os, sys, time; handle = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(handle, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(1.0)", files[0]],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        shm.sweep()
        assert all(os.path.exists(path) for path in files), "a held arena is left alone"
        began = time.monotonic()
        shm.sweep(engine="0" * 8, wait=30.0)  # another engine's arenas: nothing to wait for
        assert time.monotonic() - began < 15 and all(os.path.exists(path) for path in files)
        removed = shm.sweep(engine=engine, wait=30.0)
        assert holder.poll() is not None, "the sweep waited for the worker to exit"
        assert sorted(removed) == sorted(os.path.basename(path) for path in files)
        assert not any(os.path.exists(path) for path in files)
    finally:
        holder.kill()
        holder.wait()
        for path in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_a_file_the_host_does_not_have_is_a_clear_error():
    handed = {"rows": {"v": ([8], "float32")}, "pieces": {"v": [[("/dev/shm/vlenvoys-nowhere.rows", 0, 1)]]}, "inline": None}
    with pytest.raises(RuntimeError, match="left its values at /dev/shm/vlenvoys-nowhere.rows, which this host"):
        received(handed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies off a CUDA device")
def test_rows_copied_off_the_device_without_waiting_arrive_whole(monkeypatch):
    """On a GPU the chunks are registered with CUDA and the copies queued; the handover follows a sync.

    Rounds as a user's loop runs them (``out = collect(...)``: each round's rows are kept until the next
    round has returned), with small chunks: chunks are reused, registered once, and kept rows stay whole.
    """
    monkeypatch.setattr(worker_arena, "FIRST_CHUNK", 64 << 10)
    monkeypatch.setattr(worker_arena, "LARGEST_CHUNK", 256 << 10)
    name = f"test-{os.getpid()}-cuda"
    arena = Arena(name, device_copies=True)
    generator = torch.Generator().manual_seed(1)
    kept, files = None, []
    for round in range(8):
        arena.acknowledge("c")  # the client calls again: it mapped the last round's handover
        steps = [torch.randn(count, 64, generator=generator).to("cuda", torch.bfloat16) for count in (300, 5, 900, 40)]
        pieces = {}
        for number, rows in enumerate(steps):
            block, chunk, offset = arena.block(rows.shape, rows.dtype)
            block.copy_(rows, non_blocking=True)
            pieces[number] = [(chunk, offset, rows.shape[0])]
        assert all(chunk.pinned for chunk in arena.chunks.values() if chunk.path is not None)
        torch.cuda.current_stream().synchronize()
        got = received(arena.handover({"v": list(pieces.values())}, {"v": ([64], "bfloat16")}, owner="c"))["v"]
        for ours, theirs in zip(got, steps, strict=True):
            assert torch.equal(ours, theirs.cpu()), round
        if kept is not None:
            for ours, theirs in zip(*kept, strict=True):
                assert torch.equal(ours, theirs), f"round {round - 1}'s rows, still kept, were written over"
        kept = (got, [rows.cpu() for rows in steps])
        del got
        gc.collect()
        files.append(len(mine(name)))
    assert files[-1] == files[-4], f"chunks are reused once let go (files after each round: {files})"
    arena.close()
    assert mine(name) == []
