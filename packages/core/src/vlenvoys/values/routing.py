"""A mixture of experts' routing at a module boundary: each token's chosen experts and their weights.

vLLM's FusedMoE layer (a ``MoERunner``) asks its router, a plain Python
object, for each token's experts and their weights (``topk_weights,
topk_ids``) and hands them straight to its experts' kernel: both are tensors,
but at no module boundary nnsight could read or edit. `install` gives every
such layer an identity child, ``routes`` (`Routes`), and passes the router's
result through it, on the client's weightless tree and on each worker's
model alike (`vlenvoys.engine.model.StandardizedVLLM`), so both trees have the same
paths. Reading ``routes``'s output reads the routing; replacing it changes
what the experts' kernel uses.

Where vLLM's experts' kernel is monolithic (it takes the router's logits and
routes inside itself: some quantized or vendor kernels on a GPU), the router
is never asked and ``routes`` never runs; `Routes.computed` says so and the
values are refused by name (`vlenvoys.FUSED_ROUTING`).

The values (`Chosen`) serve each token's experts sorted by weight, highest
first, as transformers' ``torch.topk`` returns them: vLLM's CPU router takes
an unsorted top-k, and the order of a token's experts changes nothing in
its output (their outputs are summed).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..errors import InvalidWrite
from .layouts import Flat

__all__ = ["Chosen", "Routes", "install"]

#: The child name `install` gives the identity module on each FusedMoE layer.
NAME = "routes"


class Routes(torch.nn.Module):
    """Identity over a FusedMoE layer's routing: ``forward(weights, experts) -> (weights, experts)``.

    ``weights`` ``[tokens, experts_per_token]`` (float32 on vLLM 0.32's
    routers) and ``experts`` ``[tokens, experts_per_token]`` (the chosen
    experts' indices, int32 on vLLM 0.32's routers), in the router's order,
    before any expert-parallel load-balancing map (logical expert ids).
    ``experts_per_token`` is the router's top-k (None where not given).
    """

    def __init__(self, runner: torch.nn.Module, num_experts: int, experts_per_token: int | None = None) -> None:
        super().__init__()
        # A weak reference, not a submodule: the layer is this module's parent.
        self._runner = weakref.ref(runner)
        self.num_experts = int(num_experts)
        self.experts_per_token = None if experts_per_token is None else int(experts_per_token)

    def forward(self, weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return weights, experts

    @property
    def computed(self) -> bool:
        """Whether the layer's router computes the routing (and this module runs): False on a monolithic kernel."""
        runner = self._runner()
        return runner is not None and not bool(runner.is_monolithic)


def install(model: torch.nn.Module) -> int:
    """Give every FusedMoE layer of ``model`` a `Routes` child its router's result passes through.

    Idempotent. A layer whose router is not vLLM's ``BaseRouter`` (none on
    vLLM 0.32), or shares its router object with a layer already given one,
    gets no child (its values are then refused). Returns how many layers got one.
    """
    try:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    except ImportError:  # another vLLM layout: nothing to route through
        return 0
    installed = 0
    for module in list(model.modules()):
        if not isinstance(module, MoERunner) or NAME in module._modules:
            continue
        router = getattr(module, "router", None)
        if not isinstance(router, BaseRouter) or "_compute_routing" in vars(router):
            continue
        routes = Routes(module, router.global_num_experts, router.top_k)
        module.add_module(NAME, routes)
        router._compute_routing = _through(routes, router._compute_routing)
        installed += 1
    return installed


def _through(routes: Routes, compute: Any) -> Any:
    # Wraps the router's own routing (BaseRouter._compute_routing): after it, vLLM maps logical ids to
    # physical ones (expert-parallel load balancing) and converts their dtype, on what `routes` returned.
    def compute_routing(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = compute(*args, **kwargs)
        return routes(weights, experts)

    return compute_routing


def routes_of(envoy: Any, key: str) -> Any:
    """The module at ``key`` (a location such as ``experts.routes.output``) under ``envoy``'s module, or None."""
    path = key.rsplit(".", 1)[0]
    try:
        return envoy._module.get_submodule(path)
    except AttributeError:
        return None


class Chosen(Flat):
    """A value of a module returning ``(weights, experts)``: each token's weights (``select=0``) or experts (``select=1``).

    Served ``[1, tokens, experts_per_token]``, each token's entries sorted by
    weight, highest first (stable): weights in the router's dtype (float32),
    experts as int64 indices (``torch.topk``'s dtype). A write replaces both
    of the pair as the value was served: a written weight goes with the
    expert shown beside it, and written experts with the weights shown beside
    them; the model gets them back in its own dtypes.

    Raises (a write, in the block): `InvalidWrite` for another shape or
    dtype, non-finite weights, or experts outside ``[0, num_experts)`` or
    repeated within a token.
    """

    def __init__(self, key: str, *, select: int, description: str | None = None) -> None:
        super().__init__(key, select=select, batch=False, description=description)

    @staticmethod
    def _order(raw: Any) -> torch.Tensor:
        return torch.argsort(raw[0], dim=-1, descending=True, stable=True)

    def pick(self, obj: Any, raw: Any) -> torch.Tensor:
        order = self._order(raw)
        if self.select == 0:
            return raw[0].gather(-1, order)
        return raw[1].gather(-1, order).to(torch.int64)

    def place(self, obj: Any, raw: Any, new: torch.Tensor, current: torch.Tensor) -> Any:
        weights, experts = raw[0], raw[1]
        order = self._order(raw)
        if self.select == 0:
            new_weights, new_experts = new, experts.gather(-1, order)
        else:
            self._check_experts(obj, new)
            new_weights, new_experts = weights.gather(-1, order), new
        placed = (new_weights.to(weights.dtype).contiguous(), new_experts.to(experts.dtype).contiguous())
        return type(raw)((*placed, *raw[2:]))

    def halves(self, obj: Any, raw: Any) -> None:
        return None

    def _fresh(self, obj: Any, raw: Any) -> bool:
        return True

    def _check_experts(self, obj: Any, experts: torch.Tensor) -> None:
        routes = routes_of(obj, self.located_key(obj))
        count = getattr(routes, "num_experts", None)
        if count is not None and experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= count):
            raise InvalidWrite(
                f"{self.name}: expert indices must lie in [0, {count}), got {int(experts.min())} to {int(experts.max())}"
            )
        if experts.shape[-1] > 1 and bool((experts.sort(-1).values.diff(dim=-1) == 0).any()):
            raise InvalidWrite(f"{self.name}: a token's experts must be distinct, as the router chooses them")
