"""A short soak (#46) on the session's server: benchmarks/soak.py's `Soak`, loaded by its path, with a few hundred
mixed requests instead of its 2,000.

Plain, steered, fetched-capture and inline-capture requests go to the session's ``vlenvoys serve`` 16 at a time in
four rounds, while traces and `vlenvoys.generate` run on the session's in-process engine of the same weights (the
``subject``); every response and trace must equal its run alone (bit for bit on the CPU engine), none may be lost,
and the private memory of the server, this process and its engine must level off over the last two rounds.
``python benchmarks/soak.py`` is the long version, with its memory curve.
"""

from __future__ import annotations

from pathlib import Path

import torch
from test_llama_serve import KEY, exact_here, on_llama
from vlenvoys_testing import script
from vlenvoys_testing.conformance import TOLERANCE, record

ROOT = Path(__file__).resolve().parents[3]


soak = script(ROOT / "benchmarks" / "soak.py")
REQUESTS, ROUNDS, IN_FLIGHT = 320, 4, 16
#: MiB a private series may grow over the last two rounds (160 requests): 150 KB a request, a gross leak (a
#: request's block state or its captured rows kept). The long soak (16 MiB over 1,000 requests) finds the smaller
#: ones (#46 first saw some 40 KB a request). Measured here: 0.3 to 1.4 MiB with the server to itself, 9.9 MiB once
#: when it was the session's first user on a machine busy with other work (the workers' shared chunks are
#: touched as they fill). The session's server runs without oneDNN's primitive cache, whose filling would count
#: here (test_llama_serve.py).
BOUND_MIB = 24.0


@on_llama
def test_a_short_soak_loses_no_request_and_answers_each_as_alone(subject, server):
    hidden, layers = subject.hidden_size, subject.model.num_layers
    pool = soak.make_pool(6, hidden, layers)
    traces = soak.Traces(subject.model, soak.texts(2, seed=1), hidden, layers)
    memory = soak.Memory(server["pid"])
    try:
        with soak.Soak(server["url"], server["model"], pool, api_key=KEY, concurrency=IN_FLIGHT, memory=memory,
                       traces=traces, exact=exact_here(), tolerance=TOLERANCE, log=lambda line: None) as run:
            run.references()
            done = run.run(REQUESTS, ROUNDS)
    finally:
        memory.stop()
    assert not done["lost"], f"{len(done['lost'])} requests lost: {done['lost'][:5]}"
    assert not done["differing"], f"{len(done['differing'])} differ from alone: {done['differing'][:5]}"
    assert sum(entry["requests"] for entry in done["rounds"][1:]) == REQUESTS
    assert done["traces"] > 0, "no trace ran beside the requests"
    kinds = {name.rsplit("-", 1)[0] for name in run.wanted}
    assert kinds == set(soak.KINDS), kinds
    for series, verdict in soak.levelled(done["rounds"], BOUND_MIB).items():
        record("LlamaForCausalLM (vlenvoys serve)", f"short soak: {series}, MiB grown in the last 2 rounds",
               verdict["second_half_growth_mib"])
        assert verdict["levelled"] is not False, f"{series} grew {verdict['second_half_growth_mib']} MiB in 2 rounds"


def test_a_response_one_rounding_off_its_reference_differs():
    """The soak's comparison has teeth: a log-probability or a captured value one float32 spacing away is caught
    where runs must be bit for bit, and passes within a tolerance; another token never passes."""
    values = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    want = soak.Outcome((3, 7), (-1.25, -0.5), (values, values.bfloat16()))
    nudged = values.clone()
    nudged[1, 2, 3] = torch.nextafter(nudged[1, 2, 3], torch.tensor(float("inf")))
    logprob = float(torch.nextafter(torch.tensor(-0.5), torch.tensor(0.0)))
    same = soak.Outcome((3, 7), (-1.25, -0.5), (values.clone(), values.bfloat16()))
    assert soak.difference(same, want, exact=True) is None
    for got in (soak.Outcome((3, 7), (-1.25, logprob), want.captures),
                soak.Outcome((3, 7), want.logprobs, (nudged, want.captures[1]))):
        assert soak.difference(got, want, exact=True) is not None
        assert soak.difference(got, want, exact=False, tolerance=TOLERANCE) is None
    other_token = soak.Outcome((3, 8), want.logprobs, want.captures)
    assert "tokens" in soak.difference(other_token, want, exact=False, tolerance=1.0)
    assert "captures" in soak.difference(soak.Outcome((3, 7), want.logprobs, want.captures[:1]), want, exact=True)
