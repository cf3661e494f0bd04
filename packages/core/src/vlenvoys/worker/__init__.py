"""What runs inside vLLM's worker process: vLLM loads `vlenvoys.worker.cpu.CPUWorker` or
`vlenvoys.worker.gpu.GPUWorker` by path (the client names it, `vlenvoys.engine.processes.worker_class`).

- `runner`: the worker and model-runner mixins (the family's envoy tree, the RPCs, each step's spans);
- `collector`: one hook per module per step reading every collected request's rows (`vlenvoys.collect`, capture);
- `steerer`, `kernels`: each steered request's vector added by one hook per block per step (`vlenvoys.generate`);
- `arena`: the shared-memory writer rows and saves are handed over in;
- `saves`: a trace's saves sent back through it;
- `tracing`: nnsight's runner adjusted for traced requests beside the batched paths;
- `v2`: the CPU worker over vLLM's V2 model runner (opt in: ``VLENVOYS_MODEL_RUNNER=v2``), the same parts at V2's seams.

The client's code never imports these modules (an import-linter contract says so): what the two sides
share is in `vlenvoys.wire`.
"""
