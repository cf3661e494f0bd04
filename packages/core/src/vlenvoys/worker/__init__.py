"""What runs inside vLLM's worker process: vLLM loads `vlenvoys.worker.cpu.CPUWorker`,
`vlenvoys.worker.gpu.GPUWorker` or their V2 counterparts by path (the client names it,
`vlenvoys.engine.processes.worker_class`).

- `runner`: the worker and model-runner mixins (the family's envoy tree, the RPCs, each step's spans);
- `collector`: one hook per module per step reading every collected request's rows (`vlenvoys.collect`, capture);
- `steerer`, `kernels`: each steered request's vector added by one hook per block per step (`vlenvoys.generate`);
- `arena`: the shared-memory writer rows and saves are handed over in;
- `saves`: a trace's saves sent back through it;
- `tracing`: nnsight's runner adjusted for traced requests beside the batched paths;
- `v2`: the CPU and CUDA workers over vLLM's V2 model runner (``VLENVOYS_MODEL_RUNNER=v2``, and on a vLLM
  without V1), the same parts at V2's seams; `v1_stand_in` lets nnsight's worker parts import there.

The client's code never imports these modules (an import-linter contract says so): what the two sides
share is in `vlenvoys.wire`.
"""
