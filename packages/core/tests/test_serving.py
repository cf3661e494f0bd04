"""`vlenvoys.serve.steering`'s reading of a request's steering field, without a server or an engine."""

from __future__ import annotations

import base64
import json

import pytest
import torch
from vlenvoys import Steering
from vlenvoys.serve.fields import SteeringError
from vlenvoys.serve.steering import Vectors, rewritten, steering_spec
from vlenvoys.wire.requests import STEER_KEY as KEY

HIDDEN, LAYERS = 8, 4


def spec(field, vectors=None, dtype=torch.float32):
    """The field's spec as it travels (JSON text), parsed."""
    return json.loads(steering_spec(field, HIDDEN, LAYERS, dtype, vectors or Vectors()))


def test_a_served_steering_travels_as_the_text_steering_encode_makes():
    """One wire format: the field and `vlenvoys.Steering` give the same text, so the same cache salt."""
    vector = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        served = steering_spec([{"layer": -1, "vector": vector.tolist(), "factor": 3.0}], HIDDEN, LAYERS, dtype, Vectors())
        assert served == Steering(3, vector, 3.0).encode_for(HIDDEN, LAYERS, dtype)
        made = json.loads(served)
        scaled = (3.0 * vector.to(dtype)).float()
        assert base64.b64decode(made["vector"]) == scaled.numpy().tobytes()
        assert made["layers"] == [3] and made["positions"] is None


def test_entries_of_one_vector_at_several_blocks_are_one_spec():
    vectors = Vectors()
    vectors.add("v", [1.0] * HIDDEN, HIDDEN)
    made = spec([{"layer": 2, "vector": "v", "positions": "generated"}, {"layer": 0, "vector": [1.0] * HIDDEN,
                                                                         "positions": "generated"}], vectors)
    assert made["layers"] == [0, 2] and made["positions"] == "generated"
    assert spec({"layer": 1, "vector": "v", "positions": [3, 1]}, vectors)["positions"] == [1, 3]


def test_entries_of_several_vectors_are_one_spec_each():
    vectors = Vectors()
    vectors.add("v", [1.0] * HIDDEN, HIDDEN)
    made = spec([{"layer": 0, "vector": "v"}, {"layer": 1, "vector": "v", "factor": 2.0},
                 {"layer": 2, "vector": "v", "positions": "prompt"}, {"layer": 3, "vector": "v"}], vectors)
    assert [(each["layers"], each["positions"]) for each in made] == [([0, 3], None), ([1], None), ([2], "prompt")]
    assert made[1]["vector"] == json.loads(Steering(1, torch.ones(HIDDEN), 2.0).encode_for(
        HIDDEN, LAYERS, torch.float32))["vector"]


@pytest.mark.parametrize("field, reason", [
    ([{"value": "nope", "layer": 0, "vector": [0.0] * HIDDEN}], "unknown value 'nope'"),
    ([{"value": "attention_output", "layer": 0, "vector": [0.0] * HIDDEN}], "not served yet"),
    ([{"layer": 4, "vector": [0.0] * HIDDEN}], "block 4 does not exist"),
    ([{"layer": True, "vector": [0.0] * HIDDEN}], "expected a block index"),
    ([{"layer": 0, "vector": [0.0] * (HIDDEN + 1)}], f"expected shape [{HIDDEN}]"),
    ([{"layer": 0, "vector": [float("inf")] + [0.0] * (HIDDEN - 1)}], "NaN or infinite"),
    ([{"layer": 0, "vector": ["a"] * HIDDEN}], "expected a list"),
    ([{"layer": 0, "vector": "missing"}], "no vector is registered as 'missing'"),
    ([{"layer": 0, "vector": [1.0] * HIDDEN, "factor": float("nan")}], "finite number"),
    ([{"layer": 0, "vector": [1.0] * HIDDEN, "factor": 1e300}], "non-finite"),
    ([{"layer": 0, "vector": [1.0] * HIDDEN, "positions": "last"}], "positions"),
    ([], "non-empty list"),
    # Each entry under the per-entry bound, their squares' sum past float32's range.
    ([{"layer": 0, "vector": [1.0] * HIDDEN, "factor": 1e19}], "has a norm beyond"),
    ([{"layer": 0, "vector": [1.5e19] * HIDDEN}], "has a norm beyond"),
    ([{"layer": 0, "vector": [1.0] * HIDDEN}, {"layer": -4, "vector": [2.0] * HIDDEN}], "steering[1]: block 0 is steered by two"),
    # A value that is no string (CI's server log: TypeError, unhashable type 'list', an exception in the server).
    ([{"value": ["layer_output"], "layer": 0, "vector": [1.0] * HIDDEN}], "unknown value ['layer_output']"),
    ([{"value": {"a": 1}, "layer": 0, "vector": [1.0] * HIDDEN}], "unknown value {'a': 1}"),
])
def test_a_field_the_model_cannot_take_says_why(field, reason):
    with pytest.raises(SteeringError) as raised:
        spec(field)
    assert reason in str(raised.value)


def test_the_body_gets_the_spec_in_vllm_xargs_and_a_salt_of_its_steering():
    body = {"prompt": "x", "vllm_xargs": {"mine": 1}, "steering": [{"layer": 0, "vector": [0.5] * HIDDEN}]}
    new = rewritten(body, HIDDEN, LAYERS, torch.float32, Vectors())
    assert "steering" not in new and new["vllm_xargs"]["mine"] == 1
    assert json.loads(new["vllm_xargs"][KEY])["layers"] == [0]
    assert new["cache_salt"].startswith("vlenvoys-steer-")
    again = rewritten({**body, "cache_salt": "own"}, HIDDEN, LAYERS, torch.float32, Vectors())
    assert again["cache_salt"] == "own-" + new["cache_salt"]
    assert rewritten({"prompt": "x"}, HIDDEN, LAYERS, torch.float32, Vectors()) is None
    for later in ({"Capture": []}, {"steer": []}, {"vllm_xargs": {KEY: "{}"}}):
        with pytest.raises(SteeringError):
            rewritten({"prompt": "x", **later}, HIDDEN, LAYERS, torch.float32, Vectors())


def test_a_vectors_file_is_checked_when_loaded(tmp_path):
    from safetensors.torch import save_file

    save_file({"good": torch.ones(HIDDEN)}, str(tmp_path / "good.safetensors"))
    save_file({"wide": torch.ones(HIDDEN, 2)}, str(tmp_path / "wide.safetensors"))
    vectors = Vectors()
    assert vectors.load(tmp_path / "good.safetensors", HIDDEN) == ["good"]
    with pytest.raises(SteeringError, match="shape"):
        vectors.load(tmp_path / "wide.safetensors", HIDDEN)
    with pytest.raises(FileNotFoundError):
        vectors.load(tmp_path / "none.safetensors", HIDDEN)


def test_beam_search_is_refused_and_a_huge_vector_is_not_registered():
    """vLLM's beam search runs requests of its own (they would go unsteered); a vector whose norm overflows is kept out."""
    from vlenvoys.serve.steering import Vectors, rewritten

    with pytest.raises(SteeringError, match="beam search is not steered"):
        rewritten({"prompt": "x", "use_beam_search": True, "steering": [{"layer": 0, "vector": [0.5] * HIDDEN}]},
                  HIDDEN, 2, torch.float32, Vectors())
    vectors = Vectors()
    with pytest.raises(SteeringError, match="norm is beyond float32's range"):
        vectors.add("big", [1e30] * HIDDEN, HIDDEN)
    assert "big" not in vectors.named


def test_a_capture_field_is_checked_and_its_layers_counted_from_the_end():
    from vlenvoys.serve.capture import _reads, capture_spec

    made = capture_spec([{"value": "layer_output", "layers": [-1, 0]}, {"value": "attention_queries", "layers": "all",
                                                                         "positions": [0, -1], "dtype": "bfloat16"}], 3)
    assert made[0]["layers"] == [2, 0] and made[0]["positions"] == "prompt" and made[0]["dtype"] == "float32"
    assert made[1]["layers"] == [0, 1, 2] and made[1]["owner"] == "self_attn"
    # Forward order: by block, then as the block computes them (queries before the block's output).
    assert _reads(made) == ((0, "self_attn", "attention_queries"), (0, "layer", "layer_output"),
                            (1, "self_attn", "attention_queries"), (2, "self_attn", "attention_queries"),
                            (2, "layer", "layer_output"))


@pytest.mark.parametrize("field, reason", [
    ([], "non-empty list"),
    ({"value": "layer_output"}, "expected a block index"),
    ({"value": "layer_output", "layers": [0, 0]}, "listed twice"),
    ({"value": "layer_output", "layers": [True]}, "expected a block index"),
    ({"value": "layer_output", "layers": 1, "positions": []}, "positions"),
    ({"value": "layer_output", "layers": 1, "positions": [0.5]}, "positions"),
    ([{"value": "layer_output", "layers": 1}] * 17, "at most 16"),
])
def test_a_capture_field_the_model_cannot_take_says_why(field, reason):
    from vlenvoys.serve.capture import CaptureError, capture_spec

    with pytest.raises(CaptureError, match=reason) as error:
        capture_spec(field, 3)
    assert error.value.param == "capture"


def test_decode_checks_the_size_and_reads_every_dtype():
    import base64

    from vlenvoys.serve.capture import DTYPES
    from vlenvoys.serve.client import decode

    values = torch.randn(2, 3, 4)
    for name, dtype in DTYPES.items():
        data = base64.b64encode(values.to(dtype).view(torch.uint8).numpy().tobytes()).decode()
        entry = {"value": "layer_output", "dtype": name, "shape": [2, 3, 4], "data": data}
        assert torch.equal(decode(entry), values.to(dtype))
    with pytest.raises(ValueError, match="bytes of data"):
        decode({**entry, "shape": [2, 3, 5]})


def test_an_async_http_client_works_after_import_vlenvoys():
    """nnsight's `.save` mount made anyio refuse its classes, so httpx's (and openai's) async client failed."""
    import subprocess
    import sys

    code = "import vlenvoys, anyio._backends._asyncio, anyio.streams.tls"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_capture_too_large_to_hold_names_sizes_under_a_mib_in_bytes():
    from vlenvoys.serve.capture import CaptureError, Held, Image

    with pytest.raises(CaptureError, match=r"capture: 4,000 bytes of values, beyond the 1,000 bytes this server holds"):
        Held(most=1000).put(Image({"layer_output": (torch.float32, (1000,))}))
    with pytest.raises(CaptureError, match=r"capture: 4.0 MiB of values, beyond the 1.0 MiB"):
        Held(most=2**20).put(Image({"layer_output": (torch.float32, (2**20,))}))


def test_a_held_capture_is_taken_once_and_served_as_safetensors():
    from safetensors.torch import load
    from vlenvoys.serve.capture import CaptureGone, Held, Image, fetch_body

    held = Held()
    image = Image({"layer_output": (torch.float32, (2, 3))}, held.prefix)
    image.tensors["layer_output"].copy_(torch.arange(6.0).view(2, 3))
    name = held.put(image)
    body = b"".join(bytes(part) for part in fetch_body({name: held.take(name)}, prefixed=False))
    assert torch.equal(load(body)["layer_output"], torch.arange(6.0).view(2, 3))
    with pytest.raises(CaptureGone, match="fetched already"):
        held.take(name)
    held.close()


def test_the_client_opens_and_removes_only_the_servers_own_capture_files(tmp_path):
    """A path the server names is mapped and removed only where it is one of that server's capture files directly
    under /dev/shm, no link, of the beacon's owner; any other is refused and left where it is."""
    import os

    from vlenvoys.serve.capture import Held, Image
    from vlenvoys.serve.client import NotLocal, _held, _here

    held = Held()
    beacon = {"path": held.beacon.path, "token": held.beacon.token}
    assert os.stat(held.beacon.path).st_mode & 0o777 == 0o600
    here = _here([{"url": "/v1/captures/x", "beacon": beacon}], None)
    assert here is not None and here.owner == held.beacon.owner

    def image() -> Image:
        made = Image({"layer_output": (torch.float32, (2, 3))}, held.prefix)
        made.tensors["layer_output"].copy_(torch.arange(6.0).view(2, 3))
        return made

    good = image()
    path = good.handed()
    assert torch.equal(_held(path, here)["layer_output"], torch.arange(6.0).view(2, 3)) and not os.path.exists(path)
    other = Held()  # another server's file: its owner name is not this beacon's
    foreign = Image({"layer_output": (torch.float32, (2,))}, other.prefix)
    link = f"{held.prefix}{'0' * 32}.safetensors"
    os.symlink(image().path, link)
    outside = tmp_path / os.path.basename(image().path)
    outside.write_bytes(b"")
    for wrong in (foreign.path, link, str(outside), "/etc/passwd"):
        with pytest.raises(NotLocal, match="left alone"):
            _held(wrong, here)
        assert os.path.lexists(wrong), wrong
    os.unlink(link)
    foreign.discard()
    held.close()
    other.close()


def test_a_beacon_not_read_here_is_no_proof_and_local_true_says_so():
    """A beacon this client cannot open (another host's /dev/shm), or one holding another token: the bytes are
    fetched (no local=1); with local=True a NotLocal before anything is fetched."""
    from vlenvoys.serve.capture import Held
    from vlenvoys.serve.client import NotLocal, _here

    held = Held()
    for beacon in ({"path": held.beacon.path, "token": "0" * 32},
                   {"path": "/dev/shm/vlenvoys-serve-0123456789abcdef.lock", "token": held.beacon.token},
                   {"path": "/tmp/vlenvoys-serve-0123456789abcdef.lock", "token": held.beacon.token}):
        entries = [{"url": "/v1/captures/x", "beacon": beacon}]
        assert _here(entries, None) is None
        with pytest.raises(NotLocal, match="local=True: this client cannot read the server's capture files"):
            _here(entries, True)
    assert _here([{"url": "/v1/captures/x", "beacon": {"path": held.beacon.path, "token": held.beacon.token}}],
                 False) is None
    held.close()


def test_a_killed_servers_capture_files_are_swept():
    """A server SIGKILLed with captures held (and one handed over) leaves its files in /dev/shm; `sweep` (run by
    every engine's workers as they start) tells them by their unlocked beacon and removes them, not a live one's."""
    import os
    import signal
    import subprocess
    import sys

    from vlenvoys.serve.capture import Held, Image
    from vlenvoys.wire.shm import sweep

    code = (
        "import sys, torch\n"
        "from vlenvoys.serve.capture import Held, Image\n"
        "held = Held()\n"
        "paths = [Image({'v': (torch.float32, (4,))}, held.prefix) for _ in range(2)]\n"
        "held.put(paths[0]); print(held.beacon.path, paths[0].path, paths[1].handed(), flush=True)\n"
        "sys.stdin.read()\n"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    left = process.stdout.readline().split()
    alive = Held()
    mine = Image({"v": (torch.float32, (4,))}, alive.prefix)
    alive.put(mine)
    try:
        assert len(left) == 3 and all(os.path.exists(path) for path in left)
        assert not any(os.path.basename(path) in sweep() for path in left), "a live server's files stay"
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    assert all(os.path.exists(path) for path in left), "SIGKILL leaves them"
    swept = sweep()
    assert {os.path.basename(path) for path in left} <= set(swept)
    assert not any(os.path.exists(path) for path in left)
    assert os.path.exists(mine.path) and os.path.exists(alive.beacon.path)
    alive.close()
    assert not os.path.exists(mine.path) and not os.path.exists(alive.beacon.path)
