"""The model object: an nnsight ``VLLM`` with its family's envoys and the standard values.

The client drives vLLM's engine through it (loading, traces, the step loop's
hooks), and every worker builds the same tree over its loaded module
(`vlenvoys.worker.runner`), so a block's reads and edits resolve alike on both.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from nnsight.modeling.vllm import VLLM
from nnsight.modeling.vllm.envoys import parallel_envoys

from ..errors import InvalidWrite, reraise
from ..values import routing
from ..values.envoys import block_index
from ..values.family import Architecture, InstalledFamily
from ..values.layouts import Checked, Derived, Residual, argument, checked_tensor
from ..values.names import OWNERS, hint
from ..values.parallel import gather_vocab
from ..wire.requests import EAGER_KEY, PRIVATE
from ..wire.shm import engine_named
from ..wire.steering import steering_vector as checked_vector
from .processes import (
    interrupts_held_while_starting,
    interrupts_stay_with_the_caller,
    runner_choice,
    shutdown,
    spawn_on_a_gpu,
    worker_class,
)
from .requests import EMPTY, refuse_empty, salted, tokenized_together
from .saves import merged
from .sources import install
from .stepping import StandardLLMEngine, abandoned_on_error
from .traces import Generation, Trace

__all__ = ["LayerValues", "StandardizedVLLM", "family_of", "on_transformers_backend"]


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
        # The worker builds its tree from the family's declarations alone (`vlenvoys.worker.runner`).
        users_own = kwargs.get("envoys") is not None or kwargs.get("rename") is not None
        self._as_the_worker_builds = architecture is not None and not users_own
        if architecture is not None:
            kwargs["envoys"] = {**(kwargs.get("envoys") or parallel_envoys()), **architecture.envoys()}
            kwargs["rename"] = {**architecture.rename, **(kwargs.get("rename") or {})}
        self.architecture = architecture
        grouped = torch.distributed.is_initialized()
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            # nnsight brings a process group up to build the meta tree and takes it down before the engine starts;
            # a load refused in between (vLLM refusing its config, even in nnsight's bringing it up) left it up,
            # half up at worst, and the next load failed ("pipeline model parallel group is not initialized").
            # Down with it, as a load that succeeds takes it down; a group that was up before is the caller's.
            if not grouped and torch.distributed.is_initialized():
                VLLM._cleanup_distributed()
            raise

    def __getattr__(self, name: str) -> Any:
        """nnsight's lookup; a miss close to one of the model's names (``model.layers_ouput``) says which, and a
        block's standard value asked of the model (``model.layer_output``) says where it is served."""
        try:
            return super().__getattr__(name)
        except AttributeError as error:
            if name.startswith("_"):
                raise
            close = [] if name in OWNERS else difflib.get_close_matches(name, _MODEL_NAMES, n=1)
            told = f"did you mean {close[0]!r}?" if close else hint(name, None)
            if told is None:
                raise
            raise AttributeError(f"{error}; {told}") from None

    def _load_meta(self, repo_id: str, **kwargs: Any) -> Any:
        with _meta_build():
            model = super()._load_meta(repo_id, **kwargs)
        routing.install(model)  # the routing's module boundary, as the worker's model gets it (`_wrap`)
        return model

    def _wrap(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        # The worker's loaded model: each FusedMoE layer's routing through a module of its own
        # (`vlenvoys.values.routing`), at the same paths as on the client's weightless tree.
        routing.install(module)
        return super()._wrap(module, *args, **kwargs)

    @staticmethod
    def _require_v1_model_runner() -> None:
        # nnsight asks vLLM for its V1 runner, refusing VLLM_USE_V2_MODEL_RUNNER=1; where V2 is chosen
        # (`VLENVOYS_MODEL_RUNNER=v2`, or a vLLM without V1), `loading.model_runner` asked for it, and our
        # worker serves it.
        if runner_choice() != "v2":
            VLLM._require_v1_model_runner()

    def _load(self, repo_id: str, **kwargs: Any) -> Any:
        # nnsight's own worker refuses vLLM's CPU runner; pick ours by platform.
        self._WORKER_CLS = worker_class()
        spawn_on_a_gpu()
        # Its workers' row files are named for it (`shutdown` waits for them to go); a Ctrl-C stops the caller alone.
        with engine_named() as name, interrupts_stay_with_the_caller(), interrupts_held_while_starting() as heard:
            self._engine_name = name
            loaded = super()._load(repo_id, **kwargs)
        if heard:  # a Ctrl-C came while the engine started: it is stopped now, and the caller interrupted
            shutdown(self)
            raise KeyboardInterrupt("interrupted while the engine started; it has been shut down")
        return loaded

    #: Set by `_load`: the name the engine's workers' arenas start with (`vlenvoys.wire.shm.engine_named`).
    _engine_name: str | None = None

    #: Set by `load`: each envoy's attribute names when the model was handed over (none: nothing travels by path).
    _built_keys: dict[str, frozenset] = {}

    #: Set by `load` (``cuda_graphs=True``): the engine replays CUDA graphs of its decode steps.
    cuda_graphs = False
    #: Set by `load` with ``cuda_graphs=True``: the sites a trace may reach (`vlenvoys.engine.sites`), or None.
    sites = None

    def _load_sync(self, repo_id: str, **kwargs: Any) -> Any:
        from vllm import LLM

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

    def _call(self, prompts: list, params: list, lora_requests: list, *, use_tqdm: bool = False, **kwargs: Any) -> Any:
        # nnsight's `_call` (its blocks attached to the requests, the engine run, their saves collected), with
        # vLLM's progress bars only where the trace asked for them (`trace`'s ``progress``).
        with abandoned_on_error(self):  # an interrupted trace leaves nothing running on the engine
            mediators = self._attach_mediators(params, **kwargs)
            for param in params:  # nnsight's attach writes extra_args afresh: the flag goes in after it
                if getattr(param, "vlenvoys_eager", False):
                    param.extra_args[EAGER_KEY] = True
            outputs = self.vllm_entrypoint.generate(
                prompts, sampling_params=params, lora_request=lora_requests, use_tqdm=use_tqdm
            )
            self._collect(mediators, outputs)
            return outputs

    def _batch(self, invokes: list[tuple], fn: Any) -> tuple:
        for index, (inputs, _) in enumerate(invokes):  # nnsight says only "Empty prompt"
            if len(inputs) == 1 and isinstance(inputs[0], (list, tuple)) and not inputs[0]:
                raise ValueError(f"invoke {index}'s {EMPTY}")
        (prompts, params, lora_requests), kwargs = super()._batch(invokes, fn)
        refuse_empty(self.vllm_entrypoint, prompts)
        prompts = tokenized_together(self.vllm_entrypoint, [salted(prompt, "trace") for prompt in prompts])
        return (prompts, params, lora_requests), kwargs

    def trace(self, *inputs: Any, progress: bool = False, **kwargs: Any) -> Any:
        """nnsight's trace: ``with model.trace(prompt, **sampling):`` reads and edits the values of one request.

        One forward pass, as on transformers and nnterp: a request that names
        no length generates one token (``max_tokens=1``, vLLM's default would
        be 16). Name one to generate more (``max_tokens`` or ``min_tokens``,
        on the trace or an invoke; nnsight's ``max_new_tokens`` on the trace); a
        trace that steps through its generation (``tracer.iter[...]``,
        ``tracer.all()``) and ``with model.generate(...)`` keep vLLM's default
        length (16), as before (`vlenvoys.engine.traces`). Other keyword
        arguments are vLLM ``SamplingParams`` fields (``temperature``, ...).

        ``progress=True`` shows vLLM's progress bars of the trace's requests
        (none by default: a trace prints nothing of its own).

        Reading a block's raw ``.output`` warns once per place
        (`vlenvoys.RawOutputWarning`): the residual stream is ``.layer_output``.

        On an engine loaded with ``cuda_graphs=True`` and ``sites``, a trace
        reaches only the declared sites (ValueError before anything is sent,
        `vlenvoys.engine.sites.check`); without ``sites`` it is refused
        (NotImplementedError).
        """
        _check_progress(progress)
        self._check_running()
        if self.cuda_graphs and self.sites is None:
            raise NotImplementedError(
                "this engine replays CUDA graphs of its decode steps (vlenvoys.load(..., cuda_graphs=True)), where "
                "a trace's reads and edits would not run: declare the values traces may read at load "
                "(sites={'layer_output': 'all'}), or trace on an engine loaded without cuda_graphs"
            )
        # nnsight's `generate` opens its block through this method: a generation keeps vLLM's length.
        generating = sys._getframe(1).f_code is _NNSIGHT_GENERATE
        kwargs.setdefault("tracer_cls", Generation if generating else Trace)
        kwargs.setdefault("fn", functools.partial(self._call, use_tqdm=progress))
        return super().trace(*inputs, **kwargs)

    # Not `generate`: nnsight tells `with model.generate(...)` from a plain call by
    # reading its caller's frame, which a wrapper here would hide. Its trace goes
    # through `trace` above, its plain run through `_generate`.
    def edit(self, *args: Any, name: str | None = None, **kwargs: Any) -> Any:
        """nnsight's ``model.edit()``: a block installed on the engine, run on every request that names none.

        Raises:
            NotImplementedError: on an engine that replays CUDA graphs
                (``cuda_graphs=True``), where a step runs a block only eagerly,
                so an installed edit would take the graphs from every request.
        """
        if self.cuda_graphs and not (name or "").startswith(PRIVATE):  # vlenvoys.collect's own run on its requests
            raise NotImplementedError(
                "model.edit() installs a block every request runs, and this engine runs a step with a block eagerly "
                "(vlenvoys.load(..., cuda_graphs=True)): every step would lose its graphs; edit on an engine loaded "
                "without cuda_graphs, or write the edit in each trace"
            )
        return super().edit(*args, name=name, **kwargs)

    def _generate(self, *inputs: Any, progress: bool = False, **kwargs: Any) -> Any:
        """nnsight's plain ``model.generate(prompts, **sampling)``; vLLM's progress bars with ``progress=True`` only."""
        self._check_running()
        _check_progress(progress)
        if self._async_engine:  # no bars there: its generate streams
            return super()._generate(*inputs, **kwargs)
        with _progress_bars(self.vllm_entrypoint, progress):
            return super()._generate(*inputs, **kwargs)

    def _check_running(self) -> None:
        if getattr(self, "_shut_down", False):
            raise RuntimeError("this model's engine was stopped by vlenvoys.shutdown: start another with vlenvoys.load")

    @staticmethod
    def _collect(mediators: list, outputs: list) -> None:
        from nnsight.modeling.vllm import collect as nnsight_collect

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

        The vector may live on any device and in any real dtype, and may be
        ``[1, hidden_size]``: it is moved to the stream's (the engine's device,
        the model's dtype), as nnterp does. `vlenvoys.Steering` takes the same vectors.

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
                ``batch_index`` other than None or 0, or a vector of another
                shape than ``[hidden_size]`` or ``[1, hidden_size]``.
            TypeError: a vector that is not a real tensor.
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
        steering_vector = checked_vector(steering_vector, self.hidden_size, "steering_vector")
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


def _check_progress(progress: Any) -> None:
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False (whether to show vLLM's progress bars), got {progress!r}")


@contextlib.contextmanager
def _progress_bars(llm: Any, shown: bool) -> Iterator[None]:
    """vLLM's ``LLM.generate`` on ``llm`` with ``use_tqdm=shown`` unless a call names its own, for the block.

    nnsight's plain generate calls it with no ``use_tqdm`` (vLLM's default
    draws the bars); the instance's attribute stands in front of the method
    meanwhile (the synchronous engine has one caller at a time).
    """
    llm.generate = functools.partial(type(llm).generate, llm, use_tqdm=shown)
    try:
        yield
    finally:
        del llm.generate


#: The code of nnsight's ``VLLM.generate``, whose ``with`` block is a trace opened by it (`StandardizedVLLM.trace`).
_NNSIGHT_GENERATE = inspect.unwrap(VLLM.generate).__code__


#: The names a user reaches on the model (nnterp's accessors and helpers, the standard modules): `__getattr__`'s hints.
_MODEL_NAMES = sorted(
    {name for name in vars(StandardizedVLLM) if not name.startswith("_")}
    | {"layers", "embed_tokens", "ln_final", "lm_head", "trace", "generate", "edit", "tokenizer"}
)


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
    value = checked_tensor("model.logits", value, raw)
    if not value.is_floating_point():
        raise InvalidWrite(f"model.logits: expected a float tensor, got {value.dtype}")
    value = value.to(raw.dtype)
    if bool((torch.isnan(value) | (value == float("inf"))).any()):
        raise InvalidWrite("model.logits: NaN or +inf entries cannot be sampled from (-inf masks a token out)")
    return value


def _checked_samples(model: Any, value: Any, raw: torch.Tensor) -> torch.Tensor:
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


def on_transformers_backend(envoy: Any) -> bool:
    """Whether ``envoy``'s model runs on vLLM's transformers backend, where activations carry the batch axis."""
    root = envoy.root if hasattr(envoy, "root") else envoy
    return type(root._module).__name__.startswith("Transformers")


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


