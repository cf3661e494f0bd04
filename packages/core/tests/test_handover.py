"""`vlenvoys.handover`: rows written once into host chunks, handed over by place, mapped by the client."""

from __future__ import annotations

import os

import pytest
import torch

from vlenvoys import handover
from vlenvoys.handover import Arena, received


def mine(name: str) -> list[str]:
    """This arena's files still in shared memory."""
    return sorted(entry for entry in os.listdir(handover.SHARED_MEMORY) if entry.startswith(f"vlenvoys-{name}-"))


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
    if request.param == "files" and not os.access(handover.SHARED_MEMORY, os.W_OK):
        pytest.skip(f"{handover.SHARED_MEMORY} is not writable here")
    monkeypatch.setattr(handover, "FIRST_CHUNK", 4096)  # a few steps per chunk: rows span chunks
    monkeypatch.setattr(handover, "LARGEST_CHUNK", 8192)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_come_back_equal_and_no_file_outlives_the_run(where, dtype):
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
        handed = arena.handover({"v": [pieces[number] for number in batch]}, layout)
        assert (handed["inline"] is not None) == (where == "process memory")
        got.extend(received(handed)["v"])
    arena.close()
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.dtype == dtype and torch.equal(ours, theirs)
    assert mine(name) == [], "every file was unlinked (retired ones by the client, the rest by close)"
    # Private mappings: writing into a returned tensor changes no other request's rows.
    got[0].zero_()
    assert torch.equal(got[1], expected[1])


def test_rows_dropped_unhanded_free_their_chunk():
    """A request that comes back short is dropped; its chunk retires once nobody else holds rows in it."""
    if not os.access(handover.SHARED_MEMORY, os.W_OK):
        pytest.skip(f"{handover.SHARED_MEMORY} is not writable here")
    name = f"test-{os.getpid()}-dropped"
    arena = Arena(name, device_copies=False)
    pieces = write_steps(arena, [torch.ones(4, 8), torch.ones(2, 8)], [[1, 3], [2]])
    assert len(mine(name)) == 1
    arena.release(pieces[1])
    arena.block(torch.Size([handover.FIRST_CHUNK // 4]), torch.float32)  # fills the chunk: a new one is current
    handed = arena.handover({"v": [pieces[0], pieces[2]]}, {"v": ([8], "float32")})
    assert handed["retired"], "the first chunk is retired with its last rows"
    received(handed)
    assert len(mine(name)) == 1, "the client unlinked the retired one; the current one is left"
    arena.close()
    assert mine(name) == []


def test_a_file_the_host_does_not_have_is_a_clear_error():
    handed = {"rows": {"v": ([8], "float32")}, "pieces": {"v": [[("/dev/shm/vlenvoys-nowhere.rows", 0, 1)]]},
              "inline": None, "retired": []}
    with pytest.raises(RuntimeError, match="left its values at /dev/shm/vlenvoys-nowhere.rows, which this host"):
        received(handed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies off a CUDA device")
def test_rows_copied_off_the_device_without_waiting_arrive_whole():
    """On a GPU the chunks are registered with CUDA and the copies queued; the handover follows a sync."""
    name = f"test-{os.getpid()}-cuda"
    arena = Arena(name, device_copies=True)
    generator = torch.Generator().manual_seed(1)
    steps = [torch.randn(count, 64, generator=generator).to("cuda", torch.bfloat16) for count in (300, 5, 900)]
    pieces = {}
    for number, rows in enumerate(steps):
        block, chunk, offset = arena.block(rows.shape, rows.dtype)
        block.copy_(rows, non_blocking=True)
        pieces[number] = [(chunk, offset, rows.shape[0])]
    assert all(chunk.pinned for chunk in arena.chunks.values() if chunk.path is not None)
    torch.cuda.current_stream().synchronize()
    got = received(arena.handover({"v": list(pieces.values())}, {"v": ([64], "bfloat16")}))["v"]
    arena.close()
    for ours, theirs in zip(got, steps, strict=True):
        assert torch.equal(ours, theirs.cpu())
    assert mine(name) == []
