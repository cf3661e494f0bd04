"""What the client and vLLM's worker send each other, one format each; both sides import it.

- `requests`: what a request carries in ``SamplingParams.extra_args`` (a collector's name, a steering spec,
  nnsight's block or edits) and the prefix of the edits only their own requests run;
- `steering`: a request's steering as it travels;
- `shm`: the shared-memory files rows and saves are handed over in (names, alignment, the sweep of an
  exited worker's).
"""
