"""Loading a model on vLLM with its family's envoys, in the client and in every worker."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
from nnsight.modeling.vllm import VLLM
from nnsight.modeling.vllm.envoys import parallel_envoys

from .envoys import block_index
from .errors import InvalidWrite, UnknownArchitecture, reraise
from .family import Architecture, InstalledFamily, resolve
from .parallel import gather_vocab
from .values import Checked, Derived, Residual, argument

__all__ = ["StandardizedVLLM", "load", "on_transformers_backend", "resolve_checkpoint"]

#: KV-cache size the CPU engine reserves unless told otherwise: vLLM's default
#: fraction of a NUMA node is more than a small machine has free.
CPU_KV_CACHE_BYTES = 1 << 30

#: Persistent-id prefix of an envoy sent to the worker by reference (`StandardizedVLLM._attach_mediators`).
_ENVOY_ID = "vlenvoys.Envoy:"


class StandardizedVLLM(VLLM):
    """An nnsight ``VLLM`` model whose modules carry the standard names and values.

    Built by `load`. Standard module names sit beside vLLM's own:
    ``model.embed_tokens``, ``model.layers[i]`` (with ``.self_attn`` and
    ``.mlp``), ``model.ln_final``, ``model.lm_head``, and nnsight's
    ``model.logits``; the values are on the envoys (``model.layers[i].layer_output``,
    ...). Everything nnsight's ``VLLM`` does works as before.
    """

    def __init__(
        self, *args: Any, architecture: Architecture | None = None, cuda_graphs: bool = False, **kwargs: Any
    ) -> None:
        self.cuda_graphs = cuda_graphs  # read by _load_sync, which the constructor reaches
        # The worker builds its tree from the family's declarations alone (`vlenvoys.workers`).
        users_own = kwargs.get("envoys") is not None or kwargs.get("rename") is not None
        self._as_the_worker_builds = architecture is not None and not users_own
        if architecture is not None:
            kwargs["envoys"] = {**(kwargs.get("envoys") or parallel_envoys()), **architecture.envoys()}
            kwargs["rename"] = {**architecture.rename, **(kwargs.get("rename") or {})}
        self.architecture = architecture
        super().__init__(*args, **kwargs)

    def _load_meta(self, repo_id: str, **kwargs: Any) -> Any:
        from . import routing

        with _meta_build():
            model = super()._load_meta(repo_id, **kwargs)
        routing.install(model)  # the routing's module boundary, as the worker's model gets it (`_wrap`)
        return model

    def _wrap(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        # The worker's loaded model: each FusedMoE layer's routing through a module of its own
        # (`vlenvoys.routing`), at the same paths as on the client's weightless tree.
        from . import routing

        routing.install(module)
        return super()._wrap(module, *args, **kwargs)

    def _load(self, repo_id: str, **kwargs: Any) -> Any:
        from .handover import engine_named

        # nnsight's own worker refuses vLLM's CPU runner; pick ours by platform.
        self._WORKER_CLS = worker_class()
        _spawn_on_a_gpu()
        # Its workers' row files are named for it (`shutdown` waits for them to go); a Ctrl-C stops the caller alone.
        with engine_named() as name, interrupts_stay_with_the_caller(), interrupts_held_while_starting() as heard:
            self._engine_name = name
            loaded = super()._load(repo_id, **kwargs)
        if heard:  # a Ctrl-C came while the engine started: it is stopped now, and the caller interrupted
            shutdown(self)
            raise KeyboardInterrupt("interrupted while the engine started; it has been shut down")
        return loaded

    #: Set by `_load`: the name the engine's workers' arenas start with (`vlenvoys.handover.engine_named`).
    _engine_name: str | None = None

    #: Set by `load`: each envoy's attribute names when the model was handed over (none: nothing travels by path).
    _built_keys: dict[str, frozenset] = {}

    #: Set by `load` (``cuda_graphs=True``): the engine replays CUDA graphs of its decode steps.
    cuda_graphs = False

    def _load_sync(self, repo_id: str, **kwargs: Any) -> Any:
        from vllm import LLM

        from .stepping import StandardLLMEngine

        if self.cuda_graphs:
            # nnsight's own loader always runs eagerly (without taps): its hooks cannot fire in a replay.
            llm = LLM(repo_id, worker_cls=self._WORKER_CLS, enforce_eager=False, **kwargs)
        else:
            llm = super()._load_sync(repo_id, **kwargs)
        StandardLLMEngine.install(llm.llm_engine, self._installed_edits)
        return llm

    def _load_async(self, repo_id: str, **kwargs: Any) -> Any:
        if self.cuda_graphs:
            raise NotImplementedError("cuda_graphs=True serves vlenvoys.generate, which drives the synchronous engine")
        return super()._load_async(repo_id, **kwargs)

    # A block's captured `model` used to travel by value: every request pickled the whole envoy tree (a few
    # hundred envoys, their classes and state), which cost more than the GPU's forward of the request. Each
    # envoy now travels as its path, and the worker resolves it to its own envoy over the same modules, built
    # by this class with the same family declarations, as nnsight already does for the modules themselves.
    # Only while the trees are alike: a tree built with the user's own `rename=` or `envoys=`, or an envoy
    # given an attribute since it was built (`model.layers[0].vector = v`), still travels by value.
    def _remoteable_persistent_objects(self) -> dict:
        objects = super()._remoteable_persistent_objects()
        for envoy in self.modules():
            objects[_ENVOY_ID + envoy.path] = envoy
        return objects

    def _travels_by_path(self) -> bool:
        """Whether a trace's requests carry this model's envoys as their paths (see above), not pickled."""
        return self._as_the_worker_builds and all(
            frozenset(envoy.__dict__) <= self._built_keys.get(envoy.path, frozenset()) for envoy in self.modules()
        )

    def _attach_mediators(self, params: list, **kwargs: Any) -> list:
        from .sources import install

        install()  # each function a block calls: its source read once, not per request
        if not self._travels_by_path():
            return super()._attach_mediators(params, **kwargs)
        envoys = list(self.modules())
        for envoy in envoys:
            envoy.__dict__["_persistent_id"] = _ENVOY_ID + envoy.path
        try:
            return super()._attach_mediators(params, **kwargs)
        finally:  # only these requests' payloads: an edit sent to a server, a copy, travel as before
            for envoy in envoys:
                envoy.__dict__.pop("_persistent_id", None)

    def _call(self, prompts: list, params: list, lora_requests: list, **kwargs: Any) -> Any:
        from .stepping import abandoned_on_error

        with abandoned_on_error(self):  # an interrupted trace leaves nothing running on the engine
            return super()._call(prompts, params, lora_requests, **kwargs)

    def _batch(self, invokes: list[tuple], fn: Any) -> tuple:
        (prompts, params, lora_requests), kwargs = super()._batch(invokes, fn)
        return ([salted(prompt, "trace") for prompt in prompts], params, lora_requests), kwargs

    def trace(self, *inputs: Any, **kwargs: Any) -> Any:
        self._check_running()
        if self.cuda_graphs:
            raise NotImplementedError(
                "this engine replays CUDA graphs of its decode steps (vlenvoys.load(..., cuda_graphs=True)), where "
                "a trace's reads and edits would not run: it serves vlenvoys.generate's steering and "
                "vlenvoys.collect; trace on an engine loaded without cuda_graphs"
            )
        return super().trace(*inputs, **kwargs)

    # Not `generate`: nnsight tells `with model.generate(...)` from a plain call by
    # reading its caller's frame, which a wrapper here would hide. Its trace goes
    # through `trace` above, its plain run through `_generate`.
    def _generate(self, *inputs: Any, **kwargs: Any) -> Any:
        self._check_running()
        return super()._generate(*inputs, **kwargs)

    def _check_running(self) -> None:
        if getattr(self, "_shut_down", False):
            raise RuntimeError("this model's engine was stopped by vlenvoys.shutdown: start another with vlenvoys.load")

    @staticmethod
    def _collect(mediators: list, outputs: list) -> None:
        from nnsight.modeling.vllm import collect as nnsight_collect

        from .saves import merged

        # nnsight's merge of containers saved above the invokes keeps one request's entries where
        # the copies' lengths differ; ours merges against the base the client still has (`saves`).
        own, nnsight_collect.merge_shared_saves = nnsight_collect.merge_shared_saves, merged
        try:
            VLLM._collect(mediators, outputs)
        except RuntimeError as error:
            reraise(error)
            raise
        finally:
            nnsight_collect.merge_shared_saves = own

    @Checked("logits", lambda model, value, raw: _checked_logits(value, raw),
             description="pre-sampling logits for this step")
    def logits(self, value: Any) -> torch.Tensor:
        """This request's logits at the step, ``[1, vocab]``, before sampling: nnsight's ``model.logits``.

        A private copy; an edit, or an assignment, is the step's logits for
        this request. A written value must have the served shape and a float
        dtype (it is cast to the engine's) with no NaN or ``+inf`` entries
        (``-inf`` masks a token out); otherwise `InvalidWrite`, and the
        engine samples from its own logits.
        """
        return value

    @Checked("samples", lambda model, value, raw: _checked_samples(model, value, raw),
             description="token ids drawn from logits this step")
    def samples(self, value: Any) -> torch.Tensor:
        """The token ids drawn for this request at the step: nnsight's ``model.samples``.

        A private copy; an edit, or an assignment, is the token the request
        goes on from. A written value must have the served shape and integer
        ids in ``[0, vocab_size)``; otherwise `InvalidWrite` (an id outside
        the vocabulary ended the engine at the next step's embedding lookup),
        and the engine keeps the token it drew.
        """
        return value

    @property
    def EMBEDDING(self) -> str:
        """Where `input_ids` is read: the token embedding module's path under the model (vLLM's own)."""
        return self.embed_tokens.path.removeprefix(f"{self.path}.")

    @Derived(
        "{EMBEDDING}.input",
        read_only="the prompt's tokens are fixed when its request is made; pass other tokens to the invoke",
    )
    def input_ids(self, inputs) -> torch.Tensor:
        """The current invoke's token ids, [1, tokens], int64: the token embedding's input; read-only.

        nnterp's ``model.input_ids`` inside a trace: the prompt's ids on the
        prefill; on a decode step (``tracer.iter``) that step's one token. Read
        at the embedding, the first module the model runs, so read it before
        any block's value. A private copy.
        """
        return argument(inputs, (0, "input_")).reshape(1, -1).to(torch.int64, copy=True)

    @property
    def input_size(self) -> torch.Size:
        """nnterp's ``input_size``: the shape of `input_ids`, ``(1, tokens)``, read where it is (before any block)."""
        return self.input_ids.shape

    @property
    def token_embeddings(self) -> Residual:
        """The residual stream block 0 receives, [1, tokens, hidden_size].

        It is the embeddings after anything the model applies before block 0
        (a scale, learned positions), read at block 0's input, so it is the
        value the blocks see. Assignable like every value.
        """
        return self.layers[0].layer_input

    @token_embeddings.setter
    def token_embeddings(self, value: torch.Tensor) -> None:
        try:
            self.layers[0].layer_input = value
        except InvalidWrite as error:  # named as assigned, not as block 0's layer_input only (found by fuzzing, #46)
            raise InvalidWrite(f"token_embeddings (block 0's {error})") from None

    @property
    def num_layers(self) -> int:
        """How many decoder blocks the model has."""
        return len(self.layers)

    @property
    def config(self) -> Any:
        """The model's transformers config, as vLLM loaded it."""
        return self._module.config

    @property
    def num_heads(self) -> int:
        """Query heads per attention layer."""
        return int(self.config.num_attention_heads)

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream."""
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """Rows of the unembedding matrix."""
        return int(self.config.vocab_size)

    # nnterp's per-layer accessors: model.layers_output[3], model.layers_output[3] = x.
    @property
    def layers_input(self) -> "LayerValues":
        """``layers_input[i]``: block i's input stream, ``[1, tokens, hidden_size]``."""
        return LayerValues(self, "layer_input")

    @property
    def layers_output(self) -> "LayerValues":
        """``layers_output[i]``: block i's output stream, ``[1, tokens, hidden_size]``."""
        return LayerValues(self, "layer_output")

    @property
    def attentions_output(self) -> "LayerValues":
        """``attentions_output[i]``: what block i's attention adds to the stream, ``[1, tokens, hidden_size]``."""
        return LayerValues(self, "attention_output", "self_attn")

    @property
    def mlps_output(self) -> "LayerValues":
        """``mlps_output[i]``: what block i's MLP adds to the stream, ``[1, tokens, hidden_size]``."""
        return LayerValues(self, "mlp_output", "mlp")

    @property
    def attention_probabilities(self) -> "LayerValues":
        """``attention_probabilities[i]``: block i's pattern, ``[1, heads, tokens, tokens]``; prefill only, read-only."""
        return LayerValues(self, "attention_probabilities", "self_attn")

    def steer(
        self,
        layers: int | list[int],
        steering_vector: torch.Tensor,
        factor: float = 1.0,
        positions: int | list[int] | slice | None = None,
        token_positions: int | list[int] | slice | None = None,
        batch_index: int | None = None,
    ) -> None:
        """Add ``factor * steering_vector`` (``[hidden_size]``) to the output stream of ``layers``.

        The vector may live on any device and in any float dtype: it is moved
        to the stream's (the engine's device, the model's dtype), as nnterp does.

        nnterp's ``steer``: at ``token_positions`` (every position when None),
        in place, inside a trace. On a generation it steers the step it is
        called for; call it in ``for _ in tracer.iter[0:n]:`` to steer every step.
        ``positions`` is nnterp's deprecated name for ``token_positions`` (its
        DeprecationWarning is issued where steer runs: in a trace, on the engine).
        ``batch_index`` may only be None or 0: each invoke is its own request,
        a batch of one, so another prompt is steered inside its own invoke.

        Raises:
            NoSuchBlock: a block that does not exist (checked before any block is steered; an IndexError).
            ValueError: both ``positions`` and ``token_positions``, a
                ``batch_index`` other than None or 0, or a vector whose last axis
                is not ``hidden_size``.
            IndexError: a token position the stream does not have (in the trace: the prompt's
                tokens on the prefill, one on a decode step).
            InvalidWrite: the steered stream has NaN or infinite entries (see `values.unbatched`).
        """
        if positions is not None:
            if token_positions is not None:
                raise ValueError("Cannot specify both `positions` (deprecated) and `token_positions`.")
            warnings.warn("`positions` is deprecated, use `token_positions` instead.", DeprecationWarning, stacklevel=2)
            token_positions = positions
        if batch_index is not None and (isinstance(batch_index, bool) or batch_index != 0):
            raise ValueError(
                f"batch_index={batch_index!r}: each invoke is its own vLLM request, a batch of one (index 0); "
                "steer another prompt inside its own tracer.invoke"
            )
        shape = tuple(getattr(steering_vector, "shape", ()))
        if not isinstance(steering_vector, torch.Tensor) or shape[-1:] != (self.hidden_size,):
            raise ValueError(f"steering_vector: expected a tensor of shape [{self.hidden_size}] (hidden_size), got {list(shape)}")
        positions = slice(None) if token_positions is None else token_positions
        count = self.num_layers
        indices = [layers] if isinstance(layers, int) else layers
        # In forward order, as nnterp does: a later block cannot be edited before an earlier one.
        for layer in sorted({block_index(layer, count) for layer in indices}):
            stream = self.layers[layer].layer_output
            _check_positions(positions, stream.shape[1])
            # To the stream's device and dtype, as nnterp's steer does: a CPU vector steers a GPU engine.
            stream[:, positions] += factor * steering_vector.to(device=stream.device, dtype=stream.dtype)

    @property
    def next_token_probs(self) -> torch.Tensor:
        """nnterp's next-token distribution: softmax of the last token's logits, ``[1, vocab_size]``, float32.

        Read at nnsight's ``model.logits`` (the logits processor's output, after
        any soft cap and scale), so it comes after every block's values.
        """
        return self.logits.float().softmax(-1)

    def skip_layer(self, layer: int, skip_with: torch.Tensor | None = None) -> None:
        """Skip block ``layer``, handing on ``skip_with`` (its input stream when None); see `Layer.skip`."""
        block = self.layers[layer]
        block.skip(block.layer_input if skip_with is None else skip_with)

    def skip_layers(self, start: int, end: int, skip_with: torch.Tensor | None = None) -> None:
        """Skip blocks ``start`` to ``end`` (inclusive, as nnterp), handing block ``start``'s input on."""
        stream = self.layers[start].layer_input if skip_with is None else skip_with
        for layer in range(start, end + 1):
            self.layers[layer].skip(stream)

    def project_on_vocab(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of a residual stream, ``[..., hidden_size]`` -> ``[..., vocab_size]``.

        Applies what the model applies after its last block: the final norm,
        the unembedding matrix (``lm_head``, the embedding matrix where the two
        are one module) and its bias where it has one (GPT-J), and the logits processor's scale and soft cap
        (Gemma 2's final soft cap, Granite's logits scaling). Works inside a
        trace, where vLLM's LM head cannot be called as a module, and under
        tensor parallelism (every rank's vocabulary slice gathered).

        Raises:
            ValueError: ``hidden`` is not a tensor whose last axis is ``hidden_size``, or the call
                is outside a trace (this process holds no weights).
        """
        shape = tuple(getattr(hidden, "shape", ()))
        if not isinstance(hidden, torch.Tensor) or shape[-1:] != (self.hidden_size,):
            raise ValueError(f"project_on_vocab: expected a tensor of shape [..., {self.hidden_size}] (hidden_size), got {list(shape)}")
        if self.lm_head.weight.is_meta:
            raise ValueError(
                "project_on_vocab runs inside a trace, where the model's weights are (this process holds a "
                "weightless copy): call it in the trace and .save() the logits"
            )
        shape = hidden.shape
        normed = self.ln_final(hidden.reshape(-1, shape[-1]))
        if isinstance(normed, tuple):
            normed = normed[0]
        # Under tensor parallelism each rank holds a slice of the vocabulary's rows (and of a bias).
        logits = normed @ self.lm_head.weight.T
        bias = getattr(self.lm_head, "bias", None)
        if isinstance(bias, torch.Tensor):  # GPT-J's unembedding has one, which vLLM adds with the logits processor
            logits = logits + bias
        logits = gather_vocab(logits, self.vocab_size)
        # In vLLM's LogitsProcessor order: soft cap, then scale.
        processor = getattr(self._module, "logits_processor", None)
        cap = getattr(processor, "soft_cap", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        scale = float(getattr(processor, "scale", 1.0) or 1.0)
        if scale != 1.0:
            logits = logits * scale
        return logits.reshape(*shape[:-1], logits.shape[-1])

    def get_topk_closest_tokens(
        self, hidden_state: torch.Tensor, k: int = 5
    ) -> dict[str, float] | list[dict[str, float]]:
        """nnterp's top ``k`` tokens of a residual stream through `project_on_vocab`, with their probabilities.

        ``hidden_state`` ``[hidden_size]`` gives one ``{token: probability}``
        dict, ``[n, hidden_size]`` a list of ``n``. Runs where
        `project_on_vocab` does, inside a trace (on the engine, with its
        weights and tokenizer): ``.save()`` the result there. A stream saved
        out of a trace cannot be projected here; save
        ``project_on_vocab(h).softmax(-1).topk(k)`` in the trace and pass its
        indices and values to `probs_to_dict` instead. Probabilities in float32.

        Raises:
            ValueError: ``hidden_state``'s last axis is not ``hidden_size``, it
                is not 1-D or 2-D, or this is called outside a trace.
        """
        if hidden_state.shape[-1] != self.hidden_size:
            raise ValueError(
                f"Hidden state shape {tuple(hidden_state.shape)} does not match model hidden size {self.hidden_size}."
            )
        if hidden_state.ndim not in (1, 2):
            raise ValueError(f"Unsupported hidden state shape {tuple(hidden_state.shape)}. Expected 1D or 2D tensor.")
        if self.lm_head.weight.is_meta:
            raise ValueError(
                "get_topk_closest_tokens projects with the model's weights, which are on the engine: call it "
                "inside a trace and .save() the result (or save project_on_vocab(h).softmax(-1).topk(k) there "
                "and pass indices and values to probs_to_dict here)"
            )
        top = self.project_on_vocab(hidden_state).float().softmax(-1).topk(k, dim=-1)
        if hidden_state.ndim == 1:
            return self.probs_to_dict(top.indices, top.values)
        return [self.probs_to_dict(indices, values) for indices, values in zip(top.indices, top.values)]

    def probs_to_dict(self, tokens: torch.Tensor, probs: torch.Tensor) -> dict[str, float]:
        """nnterp's ``{token: probability}`` of token ids ``[n]`` and their probabilities ``[n]``.

        Tokens are the tokenizer's (``convert_ids_to_tokens``, so ``Ġ`` marks a
        leading space on byte-level tokenizers). Works in a trace and outside.

        Raises:
            ValueError: not one id per probability, or rows of several (call it per row).
        """
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        values = probs.tolist() if isinstance(probs, torch.Tensor) else list(probs)
        if len(ids) != len(values) or any(isinstance(each, list) for each in (*ids, *values)):
            raise ValueError(
                f"probs_to_dict takes token ids [n] and their probabilities [n], got shapes "
                f"{list(getattr(tokens, 'shape', [len(ids)]))} and {list(getattr(probs, 'shape', [len(values)]))}; "
                "for several rows, call it per row"
            )
        return {token: float(prob) for token, prob in zip(self.tokenizer.convert_ids_to_tokens(ids), values)}


@contextlib.contextmanager
def _meta_build() -> Iterator[None]:
    """Let vLLM's loader build the client's meta tree (structure only, no weights).

    Two steps of the loader need real tensors or a device and serve no purpose
    for a tree read only for its structure: emptying the accelerator's cache
    (which raises where there is none; vLLM's CPU runner silences it the same
    way in its own process), and turning weights into kernel formats (the CPU
    mixture-of-experts prepack has no meta kernel).
    """
    from vllm.model_executor.model_loader import base_loader

    patches = [(base_loader, "process_weights_after_loading", lambda *args, **kwargs: None)]
    if torch.accelerator.current_accelerator() is None:
        patches.append((torch.accelerator, "empty_cache", lambda *args, **kwargs: None))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


class LayerValues:
    """One standard value of every block, indexed by block: ``model.layers_output[i]``."""

    def __init__(self, model: StandardizedVLLM, value: str, child: str | None = None) -> None:
        self.model, self.value, self.child = model, value, child

    def _envoy(self, layer: int) -> Any:
        block = self.model.layers[layer]
        return block if self.child is None else getattr(block, self.child)

    def __getitem__(self, layer: int) -> torch.Tensor:
        return getattr(self._envoy(layer), self.value)

    def __setitem__(self, layer: int, value: torch.Tensor) -> None:
        setattr(self._envoy(layer), self.value, value)

    def __len__(self) -> int:
        return self.model.num_layers


def _checked_logits(value: Any, raw: torch.Tensor) -> torch.Tensor:
    from .values import checked_tensor

    value = checked_tensor("model.logits", value, raw)
    if not value.is_floating_point():
        raise InvalidWrite(f"model.logits: expected a float tensor, got {value.dtype}")
    value = value.to(raw.dtype)
    if bool((torch.isnan(value) | (value == float("inf"))).any()):
        raise InvalidWrite("model.logits: NaN or +inf entries cannot be sampled from (-inf masks a token out)")
    return value


def _checked_samples(model: Any, value: Any, raw: torch.Tensor) -> torch.Tensor:
    from .values import checked_tensor

    value = checked_tensor("model.samples", value, raw)
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise InvalidWrite(f"model.samples: expected integer token ids, got {value.dtype}")
    vocab = model.vocab_size
    if bool(((value < 0) | (value >= vocab)).any()):
        raise InvalidWrite(
            f"model.samples: token ids must be in [0, {vocab}) (the vocabulary), got "
            f"{int(value.min())}..{int(value.max())}; the request keeps the token the engine drew"
        )
    return value.to(raw.dtype)


def salted(prompt: Any, kind: str, unique: str | None = None) -> Any:
    """``prompt`` (a string or a vLLM prompt dict) with a cache salt of its own: its key/value cache is its alone.

    ``unique``: a name no other request carries (a run's random id and the
    prompt's index), which spares a random UUID per request; default: a new UUID.

    With prefix caching on, a traced or collected request never reads a cached
    prefix (it would skip the prefix's forward, and its values would be short)
    and never leaves one that a plain request could read (its edits would
    spill into another request's output). A salt only this request carries
    keeps it out of the cache both ways; plain requests share the cache as on
    stock vLLM. A salt the caller set is kept.
    """
    import uuid

    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    elif not isinstance(prompt, dict) or prompt.get("cache_salt") is not None:
        return prompt
    return {**prompt, "cache_salt": f"vlenvoys-{kind}-{unique or uuid.uuid4().hex}"}


def on_transformers_backend(envoy: Any) -> bool:
    """Whether ``envoy``'s model runs on vLLM's transformers backend, where activations carry the batch axis."""
    root = envoy.root if hasattr(envoy, "root") else envoy
    return type(root._module).__name__.startswith("Transformers")


def worker_class() -> str:
    """The vLLM worker class for the platform vLLM reports: nnsight's runner on CPU or GPU."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "vlenvoys.workers.cpu.CPUWorker"
    if current_platform.is_cuda_alike():
        return "vlenvoys.workers.gpu.GPUWorker"
    raise NotImplementedError(
        f"vlenvoys runs on vLLM's CPU and CUDA/ROCm engines; this vLLM reports platform "
        f"{current_platform.device_name!r}, for which nnsight has no model runner"
    )


def architectures_of(model: str | os.PathLike) -> list[str]:
    """The ``architectures`` a checkpoint's config.json declares.

    Raises:
        FileNotFoundError: ``model`` names a local path with no checkpoint.
    """
    path = Path(model).expanduser()
    config = path / "config.json"
    if config.is_file():
        return list(json.loads(config.read_text()).get("architectures") or [])
    if path.exists() or str(model).startswith(("/", ".", "~")) or str(model).count("/") > 1:
        raise FileNotFoundError(
            f"no checkpoint at {model}: expected a folder with a config.json (or a hub name such as org/model)"
        )
    from transformers import AutoConfig

    return list(AutoConfig.from_pretrained(str(model)).architectures or [])


def config_of(model: str | os.PathLike) -> Any:
    """A checkpoint's config: its ``config.json`` as a dict, or the hub's transformers config."""
    config = Path(model).expanduser() / "config.json"
    if config.is_file():
        return json.loads(config.read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model))


def resolve_checkpoint(model: str | os.PathLike, engine_kwargs: dict) -> tuple[InstalledFamily, str, Architecture]:
    """The family and declarations that serve checkpoint ``model`` with ``engine_kwargs``.

    An architecture vLLM has no implementation of (GPT-NeoX on vLLM 0.32),
    which a family declares on vLLM's transformers backend alone, runs
    there: ``model_impl="transformers"`` is set in ``engine_kwargs``, as
    vLLM itself would fall back to it. Declarations `ByConfig` are chosen by
    the checkpoint's config.

    Raises:
        UnknownArchitecture: no installed family declares the architecture
            (with the message of vLLM's own implementation).
    """
    architectures, config = architectures_of(model), config_of(model)
    impl = engine_kwargs.get("model_impl")
    try:
        return resolve(architectures, backend=impl == "transformers", config=config)
    except UnknownArchitecture:
        if impl not in (None, "auto"):
            raise
        try:
            found = resolve(architectures, backend=True, config=config)
        except UnknownArchitecture:
            pass
        else:
            engine_kwargs["model_impl"] = "transformers"
            return found
        raise


def load(model: str | os.PathLike | None = None, *, cuda_graphs: bool = False, **engine_kwargs: Any) -> StandardizedVLLM:
    """Start vLLM on ``model`` and return it ready to trace with the standard values.

    Args:
        model: A local checkpoint folder or a hub name; None loads the built-in
            real model, SmolLM2-135M-Instruct (see `vlenvoys.weights`).
        **engine_kwargs: vLLM engine arguments (``dtype``, ``max_model_len``,
            ``tensor_parallel_size``, ...) and nnsight ``VLLM`` arguments. On
            every platform the dtype defaults to the checkpoint's own (float32
            where it names none; vLLM would otherwise run float32 checkpoints
            in half precision); on a GPU a float32 engine's Triton kernels run
            in full float32 (see `_float32_kernels`); on the CPU engine the KV
            cache defaults to 1 GiB. Prefix caching is on, as on stock vLLM, for
            plain requests: a traced, collected or steered request carries a
            cache salt (`salted`), so it never reads a cached prefix (its
            values would be short) nor leaves one (its edits would spill).
        cuda_graphs: Replay CUDA graphs of the decode steps, as plain vLLM
            does, for `vlenvoys.generate`'s steering and `vlenvoys.collect` at
            engine speed. The forward is captured as it runs eagerly (vLLM's
            compilation mode ``NONE``, graphs of pure decode steps only:
            ``FULL_DECODE_ONLY``), with the steering hooks of every block in
            it; prefill steps run eagerly. Traces, whose hooks a replay would
            skip, are refused on such an engine (NotImplementedError). On the
            CPU engine, which has no graphs, it changes nothing but that.

    Raises:
        UnknownArchitecture: no installed family declares the model's architecture.
        ValueError: ``cuda_graphs=True`` with ``enforce_eager``, or with a
            compilation mode other than ``NONE`` (torch.compile would trace
            away the Python hooks that serve the values); nnsight's ``taps=``.
    """
    if engine_kwargs.get("taps"):
        # Measured on an H200 (nnsight 0.8.1): under taps= a 6-step generation's trace recorded 1 row,
        # decode-step steering vanished, and the standard values are read where no tap is.
        raise ValueError(
            "vlenvoys does not run nnsight's taps=: its graph replays skip the reads and edits of every location "
            "without a tap, so a trace would serve fewer rows than it asked for. Load with cuda_graphs=True for "
            "steered generation and collection with CUDA graphs, or without either for traces"
        )
    if cuda_graphs:
        _graph_defaults(engine_kwargs)
    if model is None:
        from .weights import smollm2_path

        model = smollm2_path()
    model = str(model)
    installed, name, architecture = resolve_checkpoint(model, engine_kwargs)
    _engine_defaults(model, engine_kwargs)
    # On, as on stock vLLM: plain requests share cached prefixes; traced, collected and steered
    # requests carry cache salts of their own (`salted`), so none of them reads or leaves one.
    engine_kwargs.setdefault("enable_prefix_caching", True)
    with _cpu_ranks(engine_kwargs.get("tensor_parallel_size", 1)), _float32_kernels(engine_kwargs["dtype"]):
        loaded = StandardizedVLLM(
            model, dispatch=True, architecture=architecture, cuda_graphs=bool(cuda_graphs), **engine_kwargs
        )
    loaded.family, loaded.architecture_name = installed, name
    # The keys each envoy has as the model is handed over, as the worker's have them (`_travels_by_path`).
    loaded._built_keys = {}
    loaded._built_keys.update((envoy.path, frozenset(envoy.__dict__)) for envoy in loaded.modules())
    return loaded


@contextlib.contextmanager
def interrupts_held_while_starting() -> Iterator[list[float]]:
    """Hold a SIGINT that comes while vLLM starts its engine; the list yielded says whether one came.

    vLLM's start-up waits in ZeroMQ polls, and pyzmq drops a KeyboardInterrupt
    raised there by the signal's handler (it retries the poll): a Ctrl-C
    during `load` was lost, or left the caller and the engine each waiting for
    the other. So the handler only notes it here, vLLM finishes starting, and
    the caller (`_load`) shuts the engine down and raises KeyboardInterrupt.
    Off the main thread (no signal reaches it) nothing changes.
    """
    with interrupts_held("vlenvoys: interrupted; the engine is shut down as soon as it has started") as heard:
        yield heard


@contextlib.contextmanager
def interrupts_held(message: str) -> Iterator[list[int]]:
    """Note a SIGINT that comes inside the block instead of raising KeyboardInterrupt; the list yielded holds them.

    For work that must not stop half done: an engine's start, and the calls
    that wind up an interrupted request (a second Ctrl-C there left requests
    on the engine, and a thread still calling it beside the caller's next
    call). ``message`` goes to stderr at the first one. On a thread other than
    the main one (no signal reaches it) nothing changes.
    """
    heard: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield heard
        return

    def hold(signum: int, frame: Any) -> None:
        if not heard:
            print(message, file=sys.stderr, flush=True)
        heard.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield heard
    finally:
        signal.signal(signal.SIGINT, previous)


#: True while `interrupts_stay_with_the_caller` starts an engine (read in a forked child, see `_own_group`).
_STARTING_ENGINE = False


@contextlib.contextmanager
def interrupts_stay_with_the_caller() -> Iterator[None]:
    """Start vLLM's engine processes inside the block in a process group of their own: an interrupt stops the caller alone.

    A terminal's Ctrl-C (and Jupyter's interrupt) sends SIGINT to the whole
    foreground process group, and vLLM's engine core and workers shut down on
    it: the caller's next call raised ``EngineDeadError``. An engine process
    started here leads a process group of its own (its workers join it), so
    the interrupt reaches the caller alone, where it is a KeyboardInterrupt;
    the engine stops on `shutdown` or the caller's exit, as before. Neither a
    blocked nor an ignored SIGINT would do: a spawned child starts with an
    empty signal mask, and vLLM's processes set their own SIGINT handlers.

    Out of the caller's group, the engine no longer hears the signals that
    ended it with its caller (a closed terminal's SIGHUP, a Ctrl-C that ends
    the program), and vLLM's engine process does not notice its caller's exit:
    a caller killed outright would leave the engine holding its memory. So
    each engine process also watches its parent (`ORPHAN_WATCH`) and
    shuts down (SIGTERM, which vLLM handles) once it is gone.

    A spawned process (vLLM's default where CUDA is set up, and the CPU
    engine's) runs ``os.setpgid(0, 0)`` and the watch first in its command
    line; a forked one at fork (`_own_group`).
    """
    global _STARTING_ENGINE
    from multiprocessing import spawn

    command_line = spawn.get_command_line

    def own_group(**kwargs: Any) -> list[str]:
        line = command_line(**kwargs)
        program = line.index("-c") + 1
        line[program] = f"import os; os.setpgid(0, 0); exec({ORPHAN_WATCH!r}, {{}}); {line[program]}"
        return line

    spawn.get_command_line, _STARTING_ENGINE = own_group, True
    try:
        yield
    finally:
        spawn.get_command_line, _STARTING_ENGINE = command_line, False


def _own_group() -> None:
    if _STARTING_ENGINE:  # a child forked while an engine starts: vLLM's engine core
        os.setpgid(0, 0)
        exec(ORPHAN_WATCH, {})


#: Run first in an engine process (stdlib only: nothing else is imported yet): a daemon thread that sends
#: the process SIGTERM once its parent, the caller, has gone (the process is then adopted: its parent pid
#: changes), and SIGKILL to its process group (it and its workers) if it is still there 10 s later: a
#: SIGTERM that comes while vLLM waits in a ZeroMQ poll (its start-up handshake) is lost there.
ORPHAN_WATCH = """
import os, signal, threading, time

def _vlenvoys_watch(parent=os.getppid()):
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10.0)
    os.killpg(os.getpgid(0), signal.SIGKILL)

threading.Thread(target=_vlenvoys_watch, name="vlenvoys-orphan-watch", daemon=True).start()
"""


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_own_group)


def _spawn_on_a_gpu() -> None:
    """Start a GPU engine's process by spawning it, as vLLM's CPU engine does, unless the user chose a method.

    vLLM forks its engine process unless ``torch.cuda`` is initialized here. On an
    H200 (vLLM 0.32) the tiny Mixtral and Qwen2-MoE engines then failed to start,
    forked: "CUDA error: initialization error", or a hang, while every other
    family's started; the client already held the driver open (``/dev/nvidia-uvm``)
    from its imports on, in every case, so no check here can tell when a fork is safe.
    Spawned, every family's engine started and passed its suite. A script that
    starts an engine needs ``if __name__ == "__main__":`` either way.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def _graph_defaults(engine_kwargs: dict) -> None:
    from vllm.config import CompilationConfig, CompilationMode

    if "enforce_eager" in engine_kwargs:
        raise ValueError("cuda_graphs=True replays graphs; drop enforce_eager (or load without cuda_graphs)")
    config = engine_kwargs.get("compilation_config")
    if config is None:
        config = {}
    if isinstance(config, dict):
        config = {"mode": CompilationMode.NONE, "cudagraph_mode": "FULL_DECODE_ONLY", **config}
        mode = config["mode"]
    else:
        mode = config.mode if isinstance(config, CompilationConfig) else config  # vLLM also takes a mode alone
    if _compilation_mode(mode) != CompilationMode.NONE:
        raise ValueError(
            f"cuda_graphs=True captures the eager forward (compilation mode NONE), got mode {mode!r}: "
            "torch.compile would trace away the Python hooks that steer and read the values"
        )
    engine_kwargs["compilation_config"] = config


def _compilation_mode(mode: Any) -> Any:
    """vLLM's ``CompilationMode`` named by ``mode`` (a member, its number, or its name as a string); None if none."""
    from vllm.config import CompilationMode

    if isinstance(mode, str):
        if mode.upper() in CompilationMode.__members__:
            return CompilationMode[mode.upper()]
        mode = int(mode) if mode.isdigit() else mode
    try:
        return CompilationMode(mode)
    except ValueError:
        return None


def _engine_defaults(model: str, engine_kwargs: dict) -> None:
    from vllm.platforms import current_platform

    # vLLM downcasts float32 checkpoints to half precision unless told otherwise
    # (bfloat16 on the CPU, float16 or bfloat16 on a GPU): keep the checkpoint's
    # own dtype, on every platform, and float32 where it names none.
    config = Path(model) / "config.json"
    settings = json.loads(config.read_text()) if config.is_file() else {}
    engine_kwargs.setdefault("dtype", settings.get("dtype") or settings.get("torch_dtype") or "float32")
    if current_platform.is_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        engine_kwargs.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)


#: Triton's default precision for a dot product of float32 inputs (``tl.dot``).
_TRITON_F32 = "TRITON_F32_DEFAULT"


@contextlib.contextmanager
def _float32_kernels(dtype: Any) -> Iterator[None]:
    """Run a float32 engine's Triton kernels in full float32, where the user chose nothing.

    vLLM's Triton attention computes its dot products with ``tl.dot``, which
    on an NVIDIA GPU rounds float32 inputs to TF32 (10 bits of mantissa)
    unless told otherwise. Measured on an H200 (tiny Llama, float32): with
    TF32 dots the stream is 1.7e-3 away from transformers' (5.6e-4 of its
    magnitude) from block 1 on; with ``TRITON_F32_DEFAULT=ieee``, which makes
    those dots full float32, every value of every family is within 3e-6 of
    its magnitude, as on the CPU engine (another attention backend set by
    environment variable changed nothing: its kernels are Triton's too). vLLM's
    engine and worker processes inherit it when they start; this process's
    environment is restored afterwards. Half-precision engines are untouched.
    """
    from vllm.platforms import current_platform

    if str(dtype).removeprefix("torch.") != "float32" or current_platform.is_cpu() or os.environ.get(_TRITON_F32):
        yield
        return
    os.environ[_TRITON_F32] = "ieee"
    try:
        yield
    finally:
        del os.environ[_TRITON_F32]


@contextlib.contextmanager
def _cpu_ranks(ranks: int) -> Iterator[None]:
    """Give each CPU rank its own cores while the engine starts, where the user set none.

    vLLM's CPU engine binds one rank per NUMA node and refuses more ranks
    than nodes; a one-node machine (a laptop, a 2-core CI runner) can still
    run two ranks with the allowed cores split between them
    (``VLLM_CPU_OMP_THREADS_BIND="0|1"``). The worker processes inherit the
    setting; this process's environment is restored afterwards.
    """
    from vllm.platforms import current_platform

    name = "VLLM_CPU_OMP_THREADS_BIND"
    if ranks <= 1 or not current_platform.is_cpu() or os.environ.get(name, "auto") != "auto":
        yield
        return
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    if len(get_visible_memory_node()) >= ranks:  # vLLM's own binding works: one node per rank
        yield
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ValueError(f"tensor_parallel_size={ranks} needs at least {ranks} CPU cores; this process may use {len(cores)}")
    share = len(cores) // ranks
    groups = [cores[rank * share : (rank + 1) * share] for rank in range(ranks)]
    os.environ[name] = "|".join(",".join(map(str, group)) for group in groups)
    try:
        yield
    finally:
        del os.environ[name]


def shutdown(model: VLLM) -> None:
    """Stop ``model``'s engine and its worker processes."""
    engine = getattr(model.vllm_entrypoint, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        try:
            core.shutdown()
        except psutil.NoSuchProcess:
            # vLLM names each worker process before it kills it, and one that exits in between raises
            # (seen in CI, on a loaded machine): finish what its shutdown left.
            _stop_leftovers(core)
    from .handover import SAVES_MAPS, sweep

    # Collected rows' files of a worker killed before it removed them (vLLM kills an engine that has not
    # stopped 5 s after its SIGTERM); a worker just killed may hold its lock a moment longer.
    sweep(engine=getattr(model, "_engine_name", None), wait=10.0)
    SAVES_MAPS.drop_stale()  # this process's mappings of the engine's trace saves: their files are gone now
    model.vllm_entrypoint = None
    model._shut_down = True


def _check_positions(positions: Any, tokens: int) -> None:
    """IndexError naming the token count for a position a ``[1, tokens, ...]`` stream does not have (torch's says "dimension 0")."""
    if isinstance(positions, slice):
        return
    listed = [positions] if isinstance(positions, int) else list(positions) if isinstance(positions, (list, tuple)) else []
    outside = [position for position in listed if isinstance(position, int) and not -tokens <= position < tokens]
    if outside:
        raise IndexError(
            f"token_positions {outside}: the stream of this step has {tokens} token{'s' if tokens != 1 else ''} (positions "
            f"{-tokens} to {tokens - 1}; the prompt's on the prefill, one on a decode step)"
        )


def family_of(model: StandardizedVLLM) -> InstalledFamily:
    """The installed family serving ``model``."""
    return model.family


def _stop_leftovers(core: Any) -> None:
    """Kill the engine processes (and theirs) still alive, then release the client's resources."""
    resources = getattr(core, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    for process in getattr(manager, "processes", ()):
        if process.pid is None or not process.is_alive():
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(process.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            process.kill()
            process.join(5)
    if resources is not None:
        resources()  # the sockets and threads vLLM's shutdown releases after the processes
