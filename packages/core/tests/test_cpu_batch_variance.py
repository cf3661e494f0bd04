"""Why `conformance.same_rows` holds Qwen2-MoE to a bound on the CPU engine (`Subject.batch_variant_on_cpu`).

Qwen2-MoE scales its shared expert by ``F.sigmoid(shared_expert_gate(x))``, a
``[tokens, 1]`` tensor. torch's CPU sigmoid computes 32-element chunks with its
vectorized kernel and the remainder with a scalar loop, and the two round
differently in the last bit: a token's gate depends on where its row falls in
the step. If this test fails, torch's sigmoid no longer depends on the position,
and the exemption may be dropped (test_collect_equals_a_trace[Qwen2MoeForCausalLM]
bit-identical again).
"""

from __future__ import annotations

import torch


def test_torch_cpu_sigmoid_rounds_by_an_elements_place_in_the_tensor():
    x = torch.randn(4000, 1, generator=torch.Generator().manual_seed(0))
    whole = torch.sigmoid(x)
    differing = []
    for rows in range(1, 200):
        alone = torch.sigmoid(x[:rows].clone())
        differing += [(rows, int(i)) for i in (alone != whole[:rows]).nonzero()[:, 0]]
        # One rounding at most: the same value to float32's precision.
        assert torch.allclose(alone, whole[:rows], rtol=2.5e-7, atol=0)
    assert differing, "torch's CPU sigmoid no longer depends on an element's place"
    # Only in the scalar remainder after the last full 32-element chunk.
    assert all(index >= rows // 32 * 32 for rows, index in differing)
