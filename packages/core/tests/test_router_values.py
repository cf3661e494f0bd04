"""Router values of a mixture of experts: their declarations, refusals by name, and the oracle's router edit."""

from __future__ import annotations

import pytest
import torch

import vlenvoys
from vlenvoys import Mlp, oracle
from vlenvoys.support import _rows


class Routed(Mlp):
    KIND = "routed"


class RoutedWithRoutes(Mlp):
    KIND = "routed"
    ROUTES = "router.output"


ROUTER_VALUES = ("mlp_router_logits", "mlp_router_experts", "mlp_router_weights")


@pytest.mark.parametrize("kind", ["plain", "gated"])
def test_a_dense_mlp_refuses_every_router_value_as_not_routed(kind):
    dense = type("Dense", (Mlp,), {"KIND": kind})
    for name in ROUTER_VALUES:
        assert dense.unavailable(name) == vlenvoys.NOT_ROUTED


def test_a_mixture_of_experts_serves_its_logits_and_refuses_the_fused_choice():
    assert Routed.unavailable("mlp_router_logits") is None
    assert Routed.unavailable("mlp_router_experts") == vlenvoys.FUSED_ROUTING
    assert Routed.unavailable("mlp_router_weights") == vlenvoys.FUSED_ROUTING
    # Still no neurons, and the other refusals are unchanged.
    assert Routed.unavailable("mlp_neurons") == vlenvoys.ROUTED
    assert RoutedWithRoutes.unavailable("mlp_router_experts") is None
    assert RoutedWithRoutes.unavailable("mlp_router_weights") is None


def test_support_lists_the_router_values_with_their_layouts_and_codes():
    rows = {row.value: row for row in _rows("mlp", Routed)}
    assert rows["mlp_router_logits"].available and rows["mlp_router_logits"].shape == "[1, T, E]"
    assert rows["mlp_router_experts"].code == "FUSED_ROUTING" and rows["mlp_router_experts"].shape == "[1, T, K]"
    assert rows["mlp_router_weights"].layout == "Routes"
    dense = {row.value: row for row in _rows("mlp", Mlp)}
    assert [dense[name].code for name in ROUTER_VALUES] == ["NOT_ROUTED"] * 3
    assert Mlp.mlp_router_logits.layout == "Experts"


@pytest.mark.parametrize(
    "module, config",
    [
        ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False}),
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}),
    ],
)
def test_the_oracle_edits_a_transformers_router_before_its_top_k(module, config):
    """`oracle._rerouted` runs transformers' own router on the edited logits: the top-k follows the edit."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    configuration = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    config_class = next(getattr(configuration, name) for name in dir(configuration) if name.endswith("Config"))
    router_class = next(getattr(modeling, name) for name in dir(modeling) if name.endswith("TopKRouter"))
    router = router_class(config_class(hidden_size=16, **config))
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    logits, weights, experts = router(hidden)

    with oracle._rerouted(router, lambda served: served):
        same = router(hidden)
    assert all(torch.equal(a, b) for a, b in zip(same, (logits, weights, experts)))

    def demote(served):  # [1, tokens, experts], as vlenvoys serves it
        assert served.shape == (1, 5, 4)
        return served.scatter(-1, served.argmax(-1, keepdim=True), served.amin(-1, keepdim=True) - 1.0)

    with oracle._rerouted(router, demote):
        new_logits, new_weights, new_experts = router(hidden)
    assert torch.equal(new_logits, demote(logits[None])[0])
    favourite = logits.argmax(-1, keepdim=True)
    assert not (new_experts == favourite).any(), "the demoted expert is chosen no more"
    assert torch.equal(new_experts[:, :1], logits.scatter(-1, favourite, -torch.inf).argmax(-1, keepdim=True))
    # Outside the context the router is transformers' own again.
    assert all(torch.equal(a, b) for a, b in zip(router(hidden), (logits, weights, experts)))
    assert "forward" not in vars(router)
