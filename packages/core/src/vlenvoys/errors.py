"""The errors vlenvoys raises, and the named reasons a value can be unavailable."""

from __future__ import annotations

import builtins
import re

__all__ = ["DECODE_STEP", "FUSED_ROUTING", "GATED", "NOT_ROUTED", "PARALLEL", "ROUTED", "BlockExit", "InvalidWrite", "NoSuchBlock", "Preempted", "RawOutputWarning", "ReadOnly", "SkipRefused", "UnknownArchitecture", "Unavailable", "UnsupportedVLLM"]

#: Scores and patterns are recomputed from one step's queries and keys; on a decode step the
#: earlier keys are in vLLM's KV cache, which only its kernel reads.
DECODE_STEP = (
    "it is recomputed from this step's queries and keys, and on a decode step the earlier "
    "tokens' keys are in vLLM's cache, which only its kernel reads; read it on the prefill"
)
#: A gated MLP computes act(gate) * up in one fused kernel: act(gate) alone is never a tensor.
GATED = (
    "this MLP is gated: vLLM computes act(gate) * up in one fused kernel, so act(gate) alone "
    "is never a tensor; read mlp_neurons (the down projection's input) instead"
)
#: A mixture of experts has no single down projection for a token.
ROUTED = (
    "this MLP routes each token to experts, which have no shared neurons; read mlp_output "
    "(the MLP's contribution) instead"
)
#: A dense MLP sends every token through the same neurons: there is no router.
NOT_ROUTED = (
    "this MLP is dense: every token goes through the same neurons, so there is no router, "
    "no experts and no routing weights; router values exist on a mixture of experts only"
)
#: A monolithic experts' kernel (some quantized or vendor kernels on a GPU) takes the router's logits and
#: chooses each token's experts and their weights inside itself: they are never tensors outside it.
FUSED_ROUTING = (
    "vLLM's experts' kernel for this mixture of experts is monolithic: it takes the router's logits and "
    "chooses each token's experts and their weights inside itself, so neither is ever a tensor to read or "
    "edit (where vLLM's router chooses them, as on the CPU engine and with the unquantized Triton experts "
    "on a GPU, both are served); read mlp_router_logits, the router's output they are computed from (a "
    "softmax and top-k of it), and edit it to change the routing"
)
#: A parallel block (GPT-J, Pythia) adds the attention and the MLP to the same input: no stream lies between them.
PARALLEL = (
    "this block is parallel: its attention and its MLP both read the block's input and their outputs are "
    "added to it together, so no stream exists between them; read layer_input + attention_output, or "
    "layer_output (= layer_input + attention_output + mlp_output)"
)


class Unavailable(Exception):
    """A value this model cannot serve, with the reason by name.

    Not an AttributeError on purpose: a property that raises one falls
    through to the envoy's ``__getattr__``, which would blame the attribute
    instead of giving the reason. ``reason`` is one of the module constants (`DECODE_STEP`, `GATED`,
    `ROUTED`, `NOT_ROUTED`, `FUSED_ROUTING`, `PARALLEL`) or a reason a family declares; ``value`` names the value and
    ``where`` the envoy class that was asked.
    """

    def __init__(self, value: str, where: str, reason: str) -> None:
        super().__init__(f"{value} is unavailable on {where}: {reason}")
        self.value = value
        self.where = where
        self.reason = reason

    @classmethod
    def from_message(cls, message: str) -> "Unavailable":
        """Rebuild one from its message, as it comes back from a vLLM worker process."""
        head, _, reason = message.partition(": ")
        value, _, where = head.partition(" is unavailable on ")
        return cls(value, where, reason)


def reraise(error: RuntimeError) -> None:
    """Raise a vlenvoys error that came back from a worker as its own class.

    nnsight brings a block's error home as a RuntimeError whose message starts
    with the original class name; the ones raised here are worth catching by
    class (``except vlenvoys.InvalidWrite``). Returns for any other error.
    """
    text = str(error)
    name, _, rest = text.partition(": ")
    message = rest.split("\n\nIntervention traceback:")[0]
    if name == "Unavailable":
        raise Unavailable.from_message(message) from error
    simple = {cls.__name__: cls for cls in (BlockExit, InvalidWrite, NoSuchBlock, Preempted, ReadOnly, SkipRefused)}
    if name in simple:
        raise simple[name](message) from error
    if "Expected all tensors to be on the same device" in text:  # torch's words, however nnsight wraps them
        head = text.split("\n\nIntervention traceback:")[0].strip()
        raise InvalidWrite(f"{head}\n{OTHER_DEVICE}") from error
    if name == "OutOfOrderError":
        from nnsight.intervention.interleaver import OutOfOrderError

        raise OutOfOrderError(f"{_out_of_order(message)}\n{FORWARD_ORDER}") from error
    # A built-in exception raised in the block (ValueError, NameError, ...) comes
    # back as its own type too, so `except ValueError` works around a trace.
    builtin = getattr(builtins, name, None)
    if builtin is RuntimeError and rest:
        # torch's own error in a block (an in-place edit that cannot broadcast) came back as
        # "RuntimeError: RuntimeError: output with shape ...": the class named twice (found by fuzzing, #46).
        raise RuntimeError(rest) from error
    if isinstance(builtin, type) and issubclass(builtin, Exception) and builtin is not RuntimeError:
        try:
            rebuilt = builtin(rest)  # without the class name, which the traceback prints itself
        except Exception:
            return
        raise rebuilt from error


def _out_of_order(message: str) -> str:
    """nnsight's out-of-order message in blocks: it names only the hook (``'model.model.layers.1.self_attn.attn.input.i0'``)."""
    found = re.match(r"'([\w.]+?)\.(input|output)(?:\.i\d+)?' was requested", message)
    if found is None:
        return message
    path, side = found.groups()
    block = re.search(r"\.layers\.(\d+)(?:\.|$)", path)
    owner = f"A value of block {block.group(1)}" if block else "A value"
    return f"{owner} (read at the {side} of {path}) was requested after the model had run past it."


#: What an in-place edit with a tensor on another device is told (torch refuses the operation).
OTHER_DEVICE = (
    "The values live on the engine's device; a tensor made on the CPU (in the caller, or in the block) "
    "meets them there. Assignment (value = x) and model.steer move it to the engine's device; an in-place "
    "operation does not: write value += x.to(value.device)."
)

#: What an out-of-order read is told: the order the model computes the values in.
FORWARD_ORDER = (
    "Read and write values in the order the model computes them: token_embeddings, then block 0, 1, ...; "
    "within a block layer_input, attention_norm_output, the attention's queries, keys, values, scores, "
    "probabilities, head outputs, premix and attention_output, then layer_mid, mlp_norm_output, mlp_router_logits, "
    "mlp_router_experts and mlp_router_weights, mlp_neurons, mlp_output, layer_output; logits last. Patch between prompts with two traces (read, then write)."
)


class InvalidWrite(ValueError):
    """A written value of the wrong shape or dtype, or with NaN or infinite entries (router
    logits: NaN, +inf, or fewer than top-k finite per token; -inf bans an expert), refused in
    the block that wrote it; or an in-place edit of a value with a tensor on another device.

    The model keeps what it had, and the engine goes on serving every other
    request in the step.
    """


class BlockExit(RuntimeError):
    """A trace's block raised ``SystemExit`` (``sys.exit()``) or ``KeyboardInterrupt`` where it runs, in the engine's
    worker process: its request ends with this error, as with any other error in a block, and the engine goes on.

    Raised there, either would end the worker and with it the engine. Ctrl-C in the caller's process is not this: it
    interrupts the trace from outside and is raised as ``KeyboardInterrupt`` there.
    """


class Preempted(RuntimeError):
    """A traced request (or one an installed edit runs on) that vLLM preempted and recomputed, refused.

    Under key/value-cache pressure vLLM takes a running request's cache blocks for
    others and later recomputes the request's tokens from the start (or from a
    cached prefix) in new steps. A block would see those positions a second time
    as extra steps of ``tracer.iter``, and the edits it made there earlier would
    not be in the recomputed cache, so the request's block is ended with this
    error instead of serving values that differ from an unpressured run.
    """


class RawOutputWarning(UserWarning):
    """A trace reads a decoder block's raw ``.output`` (``model.layers[i].output``) or ``.input``, which on vLLM
    are not the stream (a raw ``.input`` is the first argument vLLM passes the layer: on most families the
    positions).

    On transformers ``output[0]`` of a decoder layer is the residual stream
    leaving it, ``[batch, tokens, hidden]``; vLLM's decoder layers return their
    own layout (on most families ``(hidden_states, residual)``, whose first half
    is only the last sublayer's output, with no batch axis). The stream is
    ``model.layers[i].layer_output``. Shown once per place that reads it; the raw
    value stays readable. Silence it with
    ``warnings.filterwarnings("ignore", category=vlenvoys.RawOutputWarning)``.
    """


class ReadOnly(TypeError):
    """A value that is computed for reading and cannot be written (the attention pattern)."""


class SkipRefused(RuntimeError):
    """A block skip refused because other requests share the engine step.

    vLLM runs every request in flight through a block as one batch; a skipped
    block would have to answer for all of them, and the requests that did not
    ask for it would get wrong values or end the engine.
    """


class NoSuchBlock(IndexError, ValueError):
    """A block index outside the model's blocks (``model.layers[5]`` of a 3-block model, ``steer``, ``collect``).

    An IndexError, as Python's sequences raise, and a ValueError, as every
    other bad argument of `vlenvoys.collect` and the CLI: either ``except`` catches it.
    """


class UnknownArchitecture(LookupError):
    """No installed family package declares the model's architecture."""


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is one vlenvoys cannot serve as asked: outside the range the model's family was verified
    against (``VLENVOYS_ALLOW_UNVERIFIED_VLLM=1`` goes on with a warning), or set to run a model runner vlenvoys'
    workers do not instrument. Raised by `vlenvoys.load` and ``vlenvoys serve`` before any engine starts."""
