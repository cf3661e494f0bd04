"""`vlenvoys.engine.saves` (and the worker's `vlenvoys.worker.saves`): containers saved above a trace's invokes, merged
against their base as sequential invokes fill them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlenvoys.engine.saves import _merge, merged


def test_sub_lists_filled_per_invoke_keep_every_invokes_entries():
    assert _merge([[], [], []], [[[4, 0], [], []], [[], [6, 1], []], [[], [], [5, 2]]]) == [[4, 0], [6, 1], [5, 2]]


def test_appends_to_one_list_follow_in_invoke_order_after_the_base():
    assert _merge([], [[0], [1], [2]]) == [0, 1, 2]
    assert _merge(["x"], [["x", 0], ["x", 1, 1]]) == ["x", 0, 1, 1]
    assert _merge([], [[5], [5]]) == [5, 5], "equal entries of two invokes are two entries"


def test_slots_written_per_invoke_and_the_last_change_wins():
    assert _merge([None, None, None], [[0, None, None], [None, 10, None], [None, None, 20]]) == [0, 10, 20]
    assert _merge([1], [[2], [1], [3]]) == [3], "an invoke that left a slot alone changes nothing"
    assert _merge(7, [7, 8, 7]) == 8


def test_dicts_take_every_invokes_keys_and_drop_deleted_ones():
    base = {"kept": 1, "gone": 2}
    copies = [{"kept": 1, "gone": 2, "a": 0}, {"kept": 1, "b": 1}, {"kept": 9, "gone": 2}]
    assert _merge(base, copies) == {"kept": 9, "a": 0, "b": 1}


def test_tensors_compare_by_value_and_a_shortened_list_keeps_the_last_copy():
    base = [torch.zeros(2)]
    assert torch.equal(_merge(base, [[torch.zeros(2)], [torch.ones(2)]])[0], torch.ones(2))
    assert _merge([1, 2], [[1, 2, 3], [1]]) == [1]


def test_merged_writes_into_every_scope_and_leaves_names_saved_once():
    base = [[], []]
    mediators = [SimpleNamespace(presaved={"rows", "once"}, lcls={"rows": base, "once": 0}) for _ in range(2)]
    saves = [{"rows": [[1], []], "once": 3, "own": "a"}, {"rows": [[], [2]], "own": "b"}]
    shared = merged(mediators, saves)
    assert shared == {"rows": [[1], [2]]}
    assert all(mediator.lcls["rows"] == [[1], [2]] for mediator in mediators)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("run_bytes", [256 << 20, 100], ids=["one run", "many runs"])
def test_saves_travel_in_one_block_and_come_back_equal(monkeypatch, run_bytes):
    import pickle

    from vlenvoys.engine import saves as client_saves
    from vlenvoys.worker.saves import dumps_saves

    monkeypatch.setattr(client_saves, "COPY_BYTES", run_bytes)  # the client copies a device's tensors in runs this long

    whole = torch.randn(6, 8).to(torch.bfloat16)
    saves = {
        "rows": whole[2:4],  # a view: only its own elements travel
        "columns": whole.t(),
        "twice": [whole, whole],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "mask": torch.tensor([True, False]),
        "ids": torch.arange(5),
        "conjugate": torch.randn(3, dtype=torch.complex64).conj(),
        "parameter": torch.nn.Parameter(torch.ones(2)),  # not a plain tensor: nnsight's way
        "expanded": torch.zeros(1).expand(1000),  # travels small, nnsight's way
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "numbers": [0.5] * 1000,
    }
    back = pickle.loads(dumps_saves(saves))
    for name, sent in saves.items():
        if name == "twice":
            assert back[name][0] is back[name][1], "one object saved twice stays one object"
            assert torch.equal(back[name][0], whole)
            continue
        got = back[name]
        if name == "numbers":
            assert got == sent
            continue
        if name == "nested":
            assert got.is_nested and all(torch.equal(a, b) for a, b in zip(got.unbind(), sent.unbind()))
            continue
        assert type(got) is type(sent) and got.dtype == sent.dtype and got.shape == sent.shape, name
        assert torch.equal(got.detach(), sent.detach().resolve_conj()), name
    assert whole[2:4].numel() * 2 < len(dumps_saves(whole[2:4])) < len(pickle.dumps(whole[2:4].clone()))
    assert back["rows"].untyped_storage().nbytes() == 2 * 8 * 2, "each tensor its own storage"
    assert len(dumps_saves(torch.zeros(1).expand(100_000))) < 2000
    back["rows"].add_(1)  # a tensor the client can write to


@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies onto a CUDA device")
@pytest.mark.parametrize("staged_bytes", [0, 1 << 40], ids=["through page-locked memory", "straight"])
def test_saves_of_a_cuda_device_come_back_equal_on_it(monkeypatch, staged_bytes):
    """A device's saves go back to it through page-locked memory, or straight from the block, equal either way."""
    import pickle

    from vlenvoys.engine import saves as client_saves
    from vlenvoys.worker.saves import dumps_saves

    monkeypatch.setattr(client_saves, "STAGED_BYTES", staged_bytes)
    monkeypatch.setattr(client_saves, "COPY_BYTES", 3 << 20)  # several runs, each staged on its own
    saves = {f"rows{number}": torch.randn(256 + number, 2048, device="cuda").to(torch.bfloat16) for number in range(6)}
    saves["host"] = torch.arange(7)
    back = pickle.loads(dumps_saves(saves))
    for _ in range(2):  # a second load reuses what the host allocator kept, after the first's copies are done
        again = pickle.loads(dumps_saves(saves))
    for name, sent in saves.items():
        for got in (back[name], again[name]):
            assert got.device == sent.device and got.dtype == sent.dtype and torch.equal(got, sent), name


def test_saves_in_shared_memory_come_back_equal_and_hold_their_block_until_loaded(monkeypatch):
    import os
    import pickle

    from vlenvoys.wire import shm
    from vlenvoys.worker import arena as worker_arena
    from vlenvoys.worker.arena import Arena
    from vlenvoys.worker.saves import dumps_saves

    if not os.access(shm.SHARED_MEMORY, os.W_OK):
        pytest.skip(f"{shm.SHARED_MEMORY} is not writable here")
    monkeypatch.setattr(worker_arena, "FIRST_CHUNK", 4096)
    monkeypatch.setattr(worker_arena, "LARGEST_CHUNK", 8192)
    monkeypatch.setattr(worker_arena, "BLOCKS_A_CHUNK", 1)
    arena = Arena(f"test-saves-{os.getpid()}", device_copies=False)
    try:
        def saves(seed: int) -> dict:  # 3,008 bytes of tensors: one block a chunk
            generator = torch.Generator().manual_seed(seed)
            whole = torch.randn(48, 16, generator=generator)
            row = whole[0]
            return {"rows": whole[3:48], "ids": torch.arange(8) + seed, "step": seed, "twice": [row, row]}

        def check(back: dict, seed: int) -> None:
            sent = saves(seed)
            assert torch.equal(back["rows"], sent["rows"]) and torch.equal(back["ids"], sent["ids"])
            assert back["step"] == seed and back["twice"][0] is back["twice"][1]

        first = dumps_saves(saves(0), arena)
        assert len(first) < 1000, "only where the data lies travels in the message"
        assert arena.current == 0 and arena.chunks[0].unread_saves()
        second = dumps_saves(saves(1), arena)
        assert arena.current == 1, "a chunk whose saves are unread is not reused"
        back = pickle.loads(first)
        check(back, 0)
        assert not arena.chunks[0].unread_saves(), "loading the saves frees their block"
        back["rows"].add_(1)  # the client's own memory: the block (and the next saves in it) are untouched
        third = dumps_saves(saves(2), arena)
        assert arena.current == 0, "a chunk whose saves were loaded is reused"
        fourth = dumps_saves(saves(3), arena)
        assert arena.current == 2, "both chunks hold unread saves: a new one"
        for payload, seed in ((second, 1), (third, 2), (fourth, 3)):
            check(pickle.loads(payload), seed)
        assert not any(chunk.unread_saves() for chunk in arena.chunks.values())
        made = len(arena.chunks)
        with monkeypatch.context() as patch:
            patch.setattr(arena, "_file", lambda size: None)  # shared memory full: no new chunk can be had
            big = {"rows": torch.randn(4096)}  # more than any chunk holds
            full = dumps_saves(big, arena)
        assert len(full) > 4 * 4096 and torch.equal(pickle.loads(full)["rows"], big["rows"]), "the block went in the message"
        assert len(arena.chunks) == made, "no chunk of process memory was made for saves that went as bytes"
        arena.files = False  # no shared memory at all: the block goes in the message
        inline = dumps_saves(saves(4), arena)
        assert len(inline) > 3008
        check(pickle.loads(inline), 4)
    finally:
        arena.close()
    assert not [entry for entry in os.listdir(shm.SHARED_MEMORY) if entry.startswith(f"vlenvoys-test-saves-{os.getpid()}")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="registers the mapping with CUDA"))])
def test_the_client_keeps_one_mapping_per_file_and_drops_it_with_the_file(device):
    """Saves in shared memory are read through one mapping per engine file, kept across traces, dropped once
    the file is gone; on a CUDA device the mapping is registered and the copies go straight from it."""
    import os
    import pickle

    from vlenvoys.engine.handover import SAVES_MAPS
    from vlenvoys.wire import shm
    from vlenvoys.worker.arena import Arena
    from vlenvoys.worker.saves import dumps_saves

    if not os.access(shm.SHARED_MEMORY, os.W_OK):
        pytest.skip(f"{shm.SHARED_MEMORY} is not writable here")
    SAVES_MAPS.forget()
    arena = Arena(f"test-maps-{os.getpid()}", device_copies=device == "cuda")
    try:
        sent = [{"rows": torch.randn(300 + seed, 64, device=device), "seed": seed} for seed in range(4)]
        for seed, saves in enumerate(sent):
            back = pickle.loads(dumps_saves(saves, arena))
            assert back["rows"].device == saves["rows"].device and torch.equal(back["rows"], saves["rows"]), seed
            if seed == 0:
                (path, mapping), = SAVES_MAPS.maps.items()
        assert len(arena.chunks) == 1 and SAVES_MAPS.maps == {path: mapping}, "one mapping, kept from load to load"
        if device == "cuda":
            assert mapping.pinned in (True, None)  # registered, or refused and staged instead: equal either way
    finally:
        arena.close()
    other = Arena(f"test-maps-{os.getpid()}-2", device_copies=False)
    try:
        pickle.loads(dumps_saves({"rows": torch.randn(8)}, other))
        assert path not in SAVES_MAPS.maps, "the mapping of a file the worker removed is dropped"
    finally:
        other.close()
        SAVES_MAPS.forget()
    assert not SAVES_MAPS.maps


def test_saves_too_large_for_a_message_fail_their_request_alone(monkeypatch):
    """Where shared memory has no room, a request's saves past `message_bytes` lose their largest values, each
    the request's error naming it; its smaller values and the other requests' saves come back."""
    import pickle

    from nnsight.modeling.vllm.model_runners import GPUModelRunner as runner_module

    from vlenvoys.worker import saves as workers

    workers.send_back_what_can_be_sent(None)  # no runner, no arena: every block goes in the message
    monkeypatch.setattr(workers, "message_bytes", lambda: 3000)

    def entry(**saves):  # as nnsight's collect makes it: sequence 0's dicts are the entry's own
        sequence = {"saves": saves, "registered": {}}
        return {"saves": saves, "error": None, "registered": sequence["registered"], "sequences": {0: sequence}}

    collected = {
        "big": entry(rows=torch.zeros(1000), kept=torch.arange(5), step=3),  # 4,000 bytes of rows: over the bound
        "fine": entry(rows=torch.ones(100)),
    }
    back = pickle.loads(runner_module.dumps_compact(collected))
    error = back["big"]["error"]
    assert error is not None and "the saved variable 'rows' (torch.Tensor) cannot be sent back" in str(error)
    assert "GiB of tensors" in str(error) and "vlenvoys.collect" in str(error)
    assert set(back["big"]["saves"]) == {"kept", "step"} and torch.equal(back["big"]["saves"]["kept"], torch.arange(5))
    assert back["fine"]["error"] is None and torch.equal(back["fine"]["saves"]["rows"], torch.ones(100))
    with pytest.raises(workers.SavesTooLarge):
        workers.dumps_saves({"rows": torch.zeros(1000)})
    mixed = {"mixed": entry(function=lambda x: x, rows=torch.zeros(1000), kept=torch.ones(3))}
    back = pickle.loads(runner_module.dumps_compact(mixed))  # will not pickle, then too large: both go
    assert "the saved variable 'function'" in str(back["mixed"]["error"])
    assert set(back["mixed"]["saves"]) == {"kept"}
