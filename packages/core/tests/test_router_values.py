"""Router values of a mixture of experts: their declarations, refusals by name, and the oracle's router edit."""

from __future__ import annotations

import pytest
import torch

import vlenvoys
from vlenvoys import Mlp
from vlenvoys_testing import oracle
from vlenvoys.values.support import envoy_rows


class Routed(Mlp):
    KIND = "routed"


class RoutedWithoutRoutes(Mlp):
    KIND = "routed"
    ROUTES = None


ROUTER_VALUES = ("mlp_router_logits", "mlp_router_experts", "mlp_router_weights")


@pytest.mark.parametrize("kind", ["plain", "gated"])
def test_a_dense_mlp_refuses_every_router_value_as_not_routed(kind):
    dense = type("Dense", (Mlp,), {"KIND": kind})
    for name in ROUTER_VALUES:
        assert dense.unavailable(name) == vlenvoys.NOT_ROUTED


def test_a_mixture_of_experts_serves_its_logits_and_its_routing():
    for name in ROUTER_VALUES:
        assert Routed.unavailable(name) is None
    assert Routed.ROUTES == "experts.routes.output"  # the child core gives vLLM's FusedMoE layer
    # Still no neurons, and the other refusals are unchanged.
    assert Routed.unavailable("mlp_neurons") == vlenvoys.ROUTED
    assert RoutedWithoutRoutes.unavailable("mlp_router_experts") == vlenvoys.FUSED_ROUTING
    assert RoutedWithoutRoutes.unavailable("mlp_router_weights") == vlenvoys.FUSED_ROUTING


class _Runner(torch.nn.Module):
    """Stands for vLLM's FusedMoE layer (a MoERunner): what `Routes` asks of it."""

    def __init__(self, monolithic: bool) -> None:
        super().__init__()
        self.is_monolithic = monolithic


@pytest.mark.parametrize("monolithic", [False, True])
def test_the_routing_is_refused_by_name_where_the_kernel_is_monolithic(monolithic):
    from vlenvoys.values.routing import Routes

    block = torch.nn.Module()
    block.experts = _Runner(monolithic)
    block.experts.add_module("routes", Routes(block.experts, 4))
    envoy = Routed(block)
    for name in ("mlp_router_experts", "mlp_router_weights"):
        assert envoy.unavailable_here(name) == (vlenvoys.FUSED_ROUTING if monolithic else None)
    assert envoy.unavailable_here("mlp_router_logits") is None
    rows = {row.value: row for row in envoy_rows("mlp", Routed, envoy)}
    assert rows["mlp_router_weights"].available is not monolithic
    weights, experts = torch.rand(3, 2), torch.randint(0, 4, (3, 2), dtype=torch.int32)
    assert block.experts.routes(weights, experts) == (weights, experts)  # an identity


def test_the_routing_is_served_by_weight_highest_first_and_written_back_as_the_model_holds_it():
    from vlenvoys.values.routing import Chosen, Routes

    block = torch.nn.Module()
    block.experts = _Runner(False)
    block.experts.add_module("routes", Routes(block.experts, 4))
    envoy = Routed(block)
    weights = torch.tensor([[0.2, 0.8], [0.7, 0.3]])
    experts = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    raw = (weights, experts)
    chosen_experts, chosen_weights = Mlp.mlp_router_experts, Mlp.mlp_router_weights
    assert isinstance(chosen_experts, Chosen)
    served = chosen_experts.pick(None, raw)
    assert served.dtype == torch.int64 and served.tolist() == [[1, 3], [0, 2]]
    assert torch.equal(chosen_weights.pick(None, raw), torch.tensor([[0.8, 0.2], [0.7, 0.3]]))
    # A written weight goes with the expert served beside it; the model gets its own dtypes, contiguous.
    new_weights, new_experts = chosen_weights.place(None, raw, torch.tensor([[0.1, 0.9], [0.5, 0.5]]), None)
    assert new_experts.dtype == torch.int32 and new_experts.tolist() == [[1, 3], [0, 2]]
    assert torch.equal(new_weights, torch.tensor([[0.1, 0.9], [0.5, 0.5]]))
    written = chosen_experts.place(envoy, raw, torch.tensor([[2, 3], [1, 2]]), None)
    assert written[1].dtype == torch.int32 and written[1].tolist() == [[2, 3], [1, 2]]
    assert torch.equal(written[0], torch.tensor([[0.8, 0.2], [0.7, 0.3]]))
    with pytest.raises(vlenvoys.InvalidWrite, match="distinct"):
        chosen_experts.place(envoy, raw, torch.tensor([[2, 2], [1, 2]]), None)
    with pytest.raises(vlenvoys.InvalidWrite, match=r"must lie in \[0, 4\)"):
        chosen_experts.place(envoy, raw, torch.tensor([[2, 4], [1, 2]]), None)


def test_router_logits_take_minus_inf_while_each_token_keeps_its_top_k():
    """-inf bans an expert (softmax weight 0); NaN, +inf and a token left with fewer than top-k finite logits
    are refused, each saying which; every other value still refuses any non-finite entry."""
    from vlenvoys.values.routing import Routes
    from vlenvoys.values.layouts import unbatched

    block = torch.nn.Module()
    block.experts = _Runner(False)
    block.experts.add_module("routes", Routes(block.experts, 4, 2))
    envoy = Routed(block)
    assert envoy.experts_per_token == 2
    value = Mlp.mlp_router_logits
    rows = torch.randn(3, 4)  # [tokens, experts], as the router returns them
    banned = rows[None].clone()
    banned[0, :, 1] = -torch.inf
    banned[0, 0, 3] = -torch.inf  # token 0 keeps exactly its 2
    assert torch.equal(value._unbatched(envoy, banned, rows), banned[0])
    for entry, match in ((torch.nan, "NaN entries"), (torch.inf, r"\+inf entries")):
        bad = banned.clone()
        bad[0, 2, 0] = entry
        with pytest.raises(vlenvoys.InvalidWrite, match=f"mlp_router_logits: the written value has {match}"):
            value._unbatched(envoy, bad, rows)
    short = banned.clone()
    short[0, 1, 0] = short[0, 1, 2] = -torch.inf
    with pytest.raises(vlenvoys.InvalidWrite, match="mlp_router_logits: token 1 keeps 1 of its 4 entries finite"):
        value._unbatched(envoy, short, rows)
    # Where the loaded MLP does not say its top-k, and for every other value, any non-finite entry is refused.
    assert Routed(torch.nn.Module()).experts_per_token is None
    with pytest.raises(vlenvoys.InvalidWrite, match="NaN or infinite entries; they would reach the engine's key/value"):
        value._unbatched(Routed(torch.nn.Module()), banned, rows)
    with pytest.raises(vlenvoys.InvalidWrite, match="NaN or infinite entries; they would reach the engine's key/value"):
        unbatched(banned, rows, "mlp_output")


def test_support_lists_the_router_values_with_their_layouts_and_codes():
    rows = {row.value: row for row in envoy_rows("mlp", Routed)}
    assert rows["mlp_router_logits"].available and rows["mlp_router_logits"].shape == "[1, T, E]"
    assert rows["mlp_router_experts"].available and rows["mlp_router_experts"].shape == "[1, T, K]"
    assert rows["mlp_router_weights"].layout == "Routes"
    refused = {row.value: row for row in envoy_rows("mlp", RoutedWithoutRoutes)}
    assert refused["mlp_router_experts"].code == "FUSED_ROUTING"
    dense = {row.value: row for row in envoy_rows("mlp", Mlp)}
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


def test_support_gives_keys_and_values_one_head_per_key_value_head():
    """Grouped-query attention: queries and head outputs have n heads, keys and values k; support says which."""
    from vlenvoys.values.envoys import Attention

    rows = {row.value: row for row in envoy_rows("attention", Attention)}
    assert {rows[name].shape for name in ("attention_queries", "attention_head_outputs", "attention_premix")} == {"[1, T, n, d]"}
    assert {rows[name].shape for name in ("attention_keys", "attention_values")} == {"[1, T, k, d]"}
    # The shape follows the layout the value is declared with, as every other value's does.
    assert rows["attention_keys"].layout == rows["attention_values"].layout == "KeyValueHeads" == Attention.attention_keys.layout
    assert rows["attention_queries"].layout == "Heads"
