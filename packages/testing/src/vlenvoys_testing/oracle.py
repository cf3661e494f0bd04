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
from vlenvoys import load, shutdown
from vlenvoys.values.names import VALUES

__all__ = ["HFLayout", "LLAMA_LAYOUT", "STREAM_VALUES", "edited_logits", "load_reference", "reference"]

#: The residual-stream values alone.
STREAM_VALUES = tuple(v for v in VALUES if v[1] in {
    "layer_input", "attention_norm_output", "attention_output", "layer_mid", "mlp_norm_output", "mlp_output",
    "layer_output",
})
#: Values read inside transformers' attention function rather than at a module.
ATTENTION_VALUES = (
    "attention_queries", "attention_keys", "attention_values", "attention_scores", "attention_probabilities",
    "attention_head_outputs",
)
#: The name the recording attention function is registered under in transformers.
ORACLE_ATTENTION = "vlenvoys_oracle"

#: (module path under the block, "input" or "output") for one value, optionally followed by which
#: element of a tuple output it is (the first by default).
Place = tuple[str, str] | tuple[str, str, int]


@dataclass(frozen=True)
class HFLayout:
    """Where transformers keeps each standard value, relative to one decoder block.

    Attributes:
        layers: The path of the block list on the transformers model.
        places: Value name -> (child path under the block, ``"input"`` or
            ``"output"``, and optionally the index of the value in a tuple
            output, the first by default); an empty child path is the block itself.
        multipliers: Value name -> the config attribute the block multiplies
            that module's output by before adding it (Granite's
            ``residual_multiplier``): the value is the output times it.
        attention_method: For a model whose attention does not go through
            transformers' attention interface (GPT-J), the attention
            module's method computing the heads' outputs,
            ``(query, key, value, attention_mask) -> (output, weights)`` with
            ``[batch, heads, tokens, head_dim]`` rotated queries and keys and
            outputs in the same layout (GPT-J's ``_attn``); its scale is the
            module's ``scaling``, or one over its ``scale_attn``. The
            attention module is the one ``attention_output`` is read at.
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
            "attention_premix": ("self_attn.o_proj", "input"),
            "mlp_neurons": ("mlp.down_proj", "input"),
            # A mixture of experts' router (transformers' TopKRouter returns (logits, weights, experts),
            # each token's experts by weight, highest first); a dense MLP has no `gate` child and leaves them unread.
            "mlp_router_logits": ("mlp.gate", "output"),
            "mlp_router_experts": ("mlp.gate", "output", 2),
            "mlp_router_weights": ("mlp.gate", "output", 1),
        }
    )
    multipliers: dict[str, str] = field(default_factory=dict)
    attention_method: str | None = None

    def multiplier(self, model: torch.nn.Module, value: str) -> float:
        """What the block multiplies ``value``'s module output by (1 where nothing)."""
        name = self.multipliers.get(value)
        return 1.0 if name is None else float(getattr(model.config, name))

    def blocks(self, model: torch.nn.Module) -> Sequence[torch.nn.Module]:
        return model.get_submodule(self.layers)


#: Llama, Mistral, Qwen2, Qwen3 (and Gemma's names) in transformers 5.
LLAMA_LAYOUT = HFLayout()
#: Granite: Llama's names, sublayer outputs added times residual_multiplier.
GRANITE_LAYOUT = HFLayout(multipliers={"attention_output": "residual_multiplier", "mlp_output": "residual_multiplier"})


class _Recorder:
    """What the recording attention function keeps and changes, while one is active."""

    def __init__(self, key_edits: dict | None = None) -> None:
        self.values: dict[str, dict[int, torch.Tensor]] = {name: {} for name in ATTENTION_VALUES}
        self.key_edits = key_edits or {}


_ACTIVE: list[_Recorder] = []


def _recording_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' own eager attention for the module's model, recording its inputs and pattern.

    ``query`` is ``[batch, heads, tokens, head_dim]`` after projection, any
    norm and rotary; ``key``/``value`` ``[batch, kv_heads, tokens, head_dim]``.
    """
    import sys

    eager = sys.modules[type(module).__module__].eager_attention_forward
    recorder = _ACTIVE[-1] if _ACTIVE else None
    layer = getattr(module, "layer_idx", None)
    if recorder is not None and layer in recorder.key_edits:
        key = recorder.key_edits[layer](key)
    output, weights = eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if recorder is not None:
        groups = query.shape[1] // key.shape[1]
        raw = torch.matmul(query.float(), key.float().repeat_interleave(groups, 1).transpose(2, 3)) * scaling
        cap = kwargs.get("softcap")
        if cap:
            raw = cap * torch.tanh(raw / cap)
        if attention_mask is not None:
            raw = raw.masked_fill(attention_mask[..., : raw.shape[-1]] < -1e30, float("-inf"))
        _keep(recorder, layer, query, key, value, raw, weights, output)
    return output, weights


def _keep(recorder: _Recorder, layer: int, query, key, value, raw, weights, output) -> None:
    """Record one layer's attention values; ``raw`` the scores ``[b, heads, q, k]``, ``output`` ``[b, T, heads, d]``."""
    keep = recorder.values
    keep["attention_queries"][layer] = query.transpose(1, 2).detach().clone()
    keep["attention_keys"][layer] = key.transpose(1, 2).detach().clone()
    keep["attention_values"][layer] = value.transpose(1, 2).detach().clone()
    keep["attention_scores"][layer] = raw.detach().clone()
    keep["attention_probabilities"][layer] = weights.detach().float().clone()
    keep["attention_head_outputs"][layer] = output.detach().clone()


@contextlib.contextmanager
def _recording_method(model: torch.nn.Module, layout: HFLayout) -> Iterator[None]:
    """Wrap each block's ``layout.attention_method`` to record (and edit keys) as `_recording_attention` does."""
    if layout.attention_method is None:
        yield
        return
    name = layout.attention_method
    modules = [_module(block, layout.places["attention_output"][0]) for block in layout.blocks(model)]

    def wrapped(module: torch.nn.Module, layer: int, original: Callable) -> Callable:
        def method(query, key, value, attention_mask=None, *args, **kwargs):
            recorder = _ACTIVE[-1] if _ACTIVE else None
            if recorder is not None and layer in recorder.key_edits:
                key = recorder.key_edits[layer](key)
            output, weights = original(query, key, value, attention_mask, *args, **kwargs)
            if recorder is not None:
                scaling = getattr(module, "scaling", None) or 1.0 / float(module.scale_attn)
                raw = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling
                tokens = raw.shape[-1]
                if attention_mask is not None:
                    raw = raw.masked_fill(attention_mask[..., :tokens] < -1e30, float("-inf"))
                else:  # causal, as the method's own softmax was given no mask
                    raw = raw.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))
                _keep(recorder, layer, query, key, value, raw, weights, output.transpose(1, 2))
            return output, weights

        return method

    for layer, module in enumerate(modules):
        setattr(module, name, wrapped(module, layer, getattr(module, name)))
    try:
        yield
    finally:
        for module in modules:
            delattr(module, name)  # the class's method again


def register_attention() -> str:
    """Register the recording attention (and eager's mask) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ORACLE_ATTENTION, _recording_attention)
    AttentionMaskInterface.register(ORACLE_ATTENTION, eager_mask)
    return ORACLE_ATTENTION


def load_reference(path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers model of a checkpoint, on the CPU, in ``dtype`` (float32 by default), with the recording attention.

    A model whose attention does not take transformers' attention interface
    (GPT-J) is loaded with eager attention; its layout's ``attention_method``
    records it. One loaded after an engine of its architecture started on
    vLLM's transformers backend, in this process, is built as it runs: uncompiled.
    """
    from transformers import AutoModelForCausalLM

    def build(attention: str) -> torch.nn.Module:
        return built(lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention)).eval()

    try:
        return build(register_attention())
    except (ValueError, KeyError):
        return build("eager")


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` run as transformers runs it, though vLLM's transformers backend decorated its classes.

    The backend marks the model's decoder class (``GPTNeoXModel``) for
    vLLM's compiler, in every process that builds an engine of it (nnsight
    builds one, weightless, in the client): the class's call then goes
    through vLLM's compile wrapper, which an instance built before (or
    outside an engine) is not set up for. Told ``do_not_compile``, as vLLM
    tells the instances it runs uncompiled, the wrapper calls the class's
    own forward.
    """
    for module in model.modules():
        if any(base.__name__ == "TorchCompileWithNoGuardsWrapper" for base in type(module).__mro__):
            module.do_not_compile = True
    return model


def built(make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``make()``, a transformers model, built and run as transformers does even where vLLM's backend decorated its class.

    After an engine of the architecture started on vLLM's transformers
    backend in this process, the class's constructor asks for vLLM's config
    (see `_unwrapped`). ``make`` is then called again with the decorated
    classes' own constructors back for the while (vLLM's decorator keeps
    each as ``old_init`` in the one it puts in its place); it must build the
    same model when called twice.
    """
    try:
        return make()
    except AssertionError as error:
        if "vLLM config is not set" not in str(error):
            raise
        failure = error
    import inspect

    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    originals = {}
    for cls in TorchCompileWithNoGuardsWrapper.__subclasses__():
        if cls.__module__.startswith("transformers."):
            original = inspect.getclosurevars(cls.__init__).nonlocals.get("old_init")
            if original is not None:
                originals[cls] = (cls.__init__, original)
    if not originals:
        raise failure
    try:
        for cls, (_, original) in originals.items():
            cls.__init__ = original
        return _unwrapped(make())
    finally:
        for cls, (decorated, _) in originals.items():
            cls.__init__ = decorated


def _first(value: object) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


def _module(block: torch.nn.Module, child: str) -> torch.nn.Module:
    return block.get_submodule(child) if child else block


@torch.no_grad()
def reference(model: torch.nn.Module, input_ids: Sequence[int], layout: HFLayout = LLAMA_LAYOUT) -> dict:
    """Every standard value of every block, and the last token's logits, from transformers.

    The attention values need the model loaded with `load_reference` (the
    recording attention); the rest are read with hooks at the modules
    ``layout`` names.

    Returns:
        ``{"values": {name: [per block, [1, tokens, ...]]}, "logits": [vocab]}``,
        float tensors on the CPU; patterns are ``[1, heads, query, key]`` with
        masked scores ``-inf``.
    """
    values: dict[str, list] = {name: [None] * len(layout.blocks(model)) for name in layout.places}
    handles = []
    recorder = _Recorder()
    for index, block in enumerate(layout.blocks(model)):
        for name, (child, side, *element) in layout.places.items():
            try:
                module = _module(block, child)
            except AttributeError:  # a mixture of experts has no single down projection
                continue

            def keep(store: list = values[name], at: int = index, element: list = element) -> Callable:
                def hook(module, args, kwargs, output=None):
                    if output is None:
                        tensor = args[0] if args else kwargs["hidden_states"]
                    else:
                        tensor = output[element[0]] if element else _first(output)
                    store[at] = tensor.detach().clone()

                return hook

            if side == "input":
                handles.append(module.register_forward_pre_hook(keep(), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(keep(), with_kwargs=True))
    _ACTIVE.append(recorder)
    try:
        with _recording_method(model, layout):
            logits = _unwrapped(model)(torch.tensor([list(input_ids)])).logits[0, -1]
    finally:
        _ACTIVE.remove(recorder)
        for handle in handles:
            handle.remove()
    for name, by_layer in recorder.values.items():
        if by_layer:
            values[name] = [by_layer[layer] for layer in sorted(by_layer)]
    for name in layout.multipliers:
        values[name] = [value * layout.multiplier(model, name) for value in values[name]]
    for name in ("mlp_router_logits", "mlp_router_experts", "mlp_router_weights"):
        # transformers' router flattens the tokens: [tokens, experts] -> [1, tokens, experts]
        # (and [tokens, experts_per_token] -> [1, tokens, experts_per_token]).
        if name in values:
            values[name] = [None if each is None else each.reshape(1, -1, each.shape[-1]) for each in values[name]]
    if "attention_premix" in values and "attention_head_outputs" in values:
        # The output projection's input, split into heads as the head outputs are.
        values["attention_premix"] = [
            premix.reshape(heads.shape) for premix, heads in zip(values["attention_premix"], values["attention_head_outputs"])
        ]
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


class _EditedLinear:
    """``torch.nn.functional`` as a router's module sees it, with its logits edited.

    transformers' routers compute the logits, their softmax and the top-k in
    one forward (``F.linear`` then ``softmax`` and ``topk``); an edit of the
    logits must reach the top-k, so the linear of the router's own weight is
    edited where it is computed and transformers' own routing runs on it.
    """

    def __init__(self, functional: object, weight: torch.Tensor, edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._functional, self._weight, self._edit = functional, weight, edit

    def linear(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        logits = self._functional.linear(input, weight, bias)
        if weight is not self._weight:
            return logits
        # [tokens, experts] there, [1, tokens, experts] for the edit, as vlenvoys serves it.
        return self._edit(logits.reshape(1, -1, logits.shape[-1])).reshape(logits.shape)

    def __getattr__(self, name: str) -> object:
        return getattr(self._functional, name)


@contextlib.contextmanager
def _rerouted(router: torch.nn.Module, edit: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Edit ``router``'s logits (``[1, tokens, experts]``) before its own softmax and top-k use them."""
    import sys

    home = sys.modules[type(router).__module__]
    functional = home.F
    original = router.forward

    def forward(*args, **kwargs):
        home.F = _EditedLinear(functional, router.weight, edit)
        try:
            return original(*args, **kwargs)
        finally:
            home.F = functional

    router.forward = forward
    try:
        yield
    finally:
        del router.forward


@contextlib.contextmanager
def _chosen(router: torch.nn.Module, edit: Callable) -> Iterator[None]:
    """Replace ``router``'s choice (its output's weights and experts) by ``edit(weights, experts)``, ``[1, tokens, k]`` each."""

    def rewrite(module, args, output):
        logits, weights, experts = output
        shape = weights.shape
        new_weights, new_experts = edit(weights.reshape(1, *shape), experts.reshape(1, *shape))
        return logits, new_weights.reshape(shape).to(weights.dtype), new_experts.reshape(shape).to(experts.dtype)

    handle = router.register_forward_hook(rewrite)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def edited_logits(
    model: torch.nn.Module,
    input_ids: Sequence[int],
    edits: Sequence[tuple[int, str, str, Callable[[torch.Tensor], torch.Tensor]]] = (),
    layout: HFLayout = LLAMA_LAYOUT,
    key_edits: dict[int, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    router_edits: dict[int, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    route_edits: dict[int, Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] | None = None,
) -> torch.Tensor:
    """The last token's logits ``[vocab]`` with edits applied on transformers.

    Each edit is ``(block index, child path, "input" | "output", fn)``:
    ``fn`` maps the ``[1, tokens, ...]`` tensor there to its replacement.
    ``key_edits`` maps a block index to a function of its keys as the
    attention function receives them (``[1, kv_heads, tokens, head_dim]``,
    rotated), on a model from `load_reference`. ``router_edits`` maps a
    block index to a function of its router's logits (``[1, tokens,
    experts]``), applied before the router's softmax and top-k, so that it
    changes the routing. ``route_edits`` maps a block index to a function of
    its router's choice, ``(weights, experts)`` each ``[1, tokens,
    experts_per_token]`` as transformers' router returns them (by weight,
    highest first), returning the pair the experts then use.
    """
    recorder = _Recorder(key_edits)
    with contextlib.ExitStack() as stack:
        for index, fn in (router_edits or {}).items():
            stack.enter_context(_rerouted(_module(layout.blocks(model)[index], layout.places["mlp_router_logits"][0]), fn))
        for index, fn in (route_edits or {}).items():
            stack.enter_context(_chosen(_module(layout.blocks(model)[index], layout.places["mlp_router_logits"][0]), fn))
        for index, child, side, fn in edits:
            stack.enter_context(_hooked(_module(layout.blocks(model)[index], child), side, fn))
        stack.enter_context(_recording_method(model, layout))
        _ACTIVE.append(recorder)
        try:
            return _unwrapped(model)(torch.tensor([list(input_ids)])).logits[0, -1].detach().clone()
        finally:
            _ACTIVE.remove(recorder)


@contextlib.contextmanager
def engine(model: str, **engine_kwargs) -> Iterator:
    """A vLLM engine on ``model`` for a test session, shut down on exit.

    Start one per model per session and share it: an engine takes 20-30 s to
    start on the CPU.
    """
    # Short test prompts: a small context and KV cache keep the engine small and quick to start
    # (on a GPU, vLLM would otherwise give the cache most of the device's memory).
    engine_kwargs.setdefault("max_model_len", 256)
    engine_kwargs.setdefault("kv_cache_memory_bytes", 1 << 30)
    from vllm.platforms import current_platform  # not torch.cuda: CUDA set up here would spoil a forked engine

    if current_platform.is_cuda_alike():
        # vLLM refuses to start unless this share of the GPU is free: a small one lets several
        # test engines (and test processes) share the device.
        engine_kwargs.setdefault("gpu_memory_utilization", 0.08)
    loaded = load(model, **engine_kwargs)
    try:
        yield loaded
    finally:
        shutdown(loaded)
