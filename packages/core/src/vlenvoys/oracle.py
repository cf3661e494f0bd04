"""The oracle: the standard values as transformers computes them, for comparing with vLLM's.

A value on vLLM is right when it equals what the transformers model with the
same weights computes, in float32. This module reads those reference values
off a transformers model with forward hooks, by a small map from standard
names to transformers' modules (`HFLayout`), and applies the same edits there
that the tests make on vLLM, so both engines' logits can be compared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["HFLayout", "LLAMA_LAYOUT", "STREAM_VALUES", "edited_logits", "reference"]

#: The values of a block, in the order the forward reaches them (nnsight needs that order).
STREAM_VALUES = (
    ("layer", "layer_input"),
    ("layer", "attention_norm_output"),
    ("self_attn", "attention_output"),
    ("layer", "layer_mid"),
    ("layer", "mlp_norm_output"),
    ("mlp", "mlp_output"),
    ("layer", "layer_output"),
)

#: (module path under the block, "input" or "output") for one value.
Place = tuple[str, str]


@dataclass(frozen=True)
class HFLayout:
    """Where transformers keeps each standard value, relative to one decoder block.

    Attributes:
        layers: The path of the block list on the transformers model.
        places: Value name -> (child path under the block, ``"input"`` or
            ``"output"``); an empty child path is the block itself.
    """

    layers: str = "model.layers"
    places: dict[str, Place] = field(
        default_factory=lambda: {
            "layer_input": ("", "input"),
            "attention_norm_output": ("input_layernorm", "output"),
            "attention_output": ("self_attn", "output"),
            "layer_mid": ("post_attention_layernorm", "input"),
            "mlp_norm_output": ("post_attention_layernorm", "output"),
            "mlp_output": ("mlp", "output"),
            "layer_output": ("", "output"),
        }
    )

    def blocks(self, model: torch.nn.Module) -> Sequence[torch.nn.Module]:
        return model.get_submodule(self.layers)


#: Llama, Mistral, Qwen2, Qwen3 (and Gemma's names) in transformers 5.
LLAMA_LAYOUT = HFLayout()


def _first(value: object) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


def _module(block: torch.nn.Module, child: str) -> torch.nn.Module:
    return block.get_submodule(child) if child else block


@torch.no_grad()
def reference(model: torch.nn.Module, input_ids: Sequence[int], layout: HFLayout = LLAMA_LAYOUT) -> dict:
    """Every standard value of every block, and the last token's logits, from transformers.

    Returns:
        ``{"values": {name: [per block, [1, tokens, ...]]}, "logits": [vocab]}``,
        float tensors on the CPU.
    """
    values: dict[str, list] = {name: [None] * len(layout.blocks(model)) for name in layout.places}
    handles = []
    for index, block in enumerate(layout.blocks(model)):
        for name, (child, side) in layout.places.items():
            module = _module(block, child)

            def keep(store: list = values[name], at: int = index) -> Callable:
                def hook(module, args, kwargs, output=None):
                    if output is None:
                        tensor = args[0] if args else kwargs["hidden_states"]
                    else:
                        tensor = _first(output)
                    store[at] = tensor.detach().clone()

                return hook

            if side == "input":
                handles.append(module.register_forward_pre_hook(keep(), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(keep(), with_kwargs=True))
    try:
        logits = model(torch.tensor([list(input_ids)])).logits[0, -1]
    finally:
        for handle in handles:
            handle.remove()
    return {"values": values, "logits": logits.detach().clone()}


@contextlib.contextmanager
def _hooked(module: torch.nn.Module, side: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    def rewrite(value: object) -> object:
        if isinstance(value, tuple):
            return (edit(value[0]), *value[1:])
        return edit(value)

    if side == "output":
        handle = module.register_forward_hook(lambda m, args, output: rewrite(output))
    else:
        handle = module.register_forward_pre_hook(lambda m, args: (edit(args[0]), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def edited_logits(
    model: torch.nn.Module,
    input_ids: Sequence[int],
    edits: Sequence[tuple[int, str, str, Callable[[torch.Tensor], torch.Tensor]]],
    layout: HFLayout = LLAMA_LAYOUT,
) -> torch.Tensor:
    """The last token's logits ``[vocab]`` with edits applied on transformers.

    Each edit is ``(block index, child path, "input" | "output", fn)``:
    ``fn`` maps the ``[1, tokens, ...]`` tensor there to its replacement.
    """
    with contextlib.ExitStack() as stack:
        for index, child, side, fn in edits:
            stack.enter_context(_hooked(_module(layout.blocks(model)[index], child), side, fn))
        return model(torch.tensor([list(input_ids)])).logits[0, -1].detach().clone()


@contextlib.contextmanager
def engine(model: str, **engine_kwargs) -> Iterator:
    """A vLLM engine on ``model`` for a test session, shut down on exit.

    Start one per model per session and share it: an engine takes 20-30 s to
    start on the CPU.
    """
    from . import load, shutdown

    # Short test prompts: a small context keeps the engine small.
    engine_kwargs.setdefault("max_model_len", 256)
    loaded = load(model, **engine_kwargs)
    try:
        yield loaded
    finally:
        shutdown(loaded)
