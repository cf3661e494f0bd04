"""The oracle suite every family package runs against transformers.

A family's tests import this module's tests (``from vlenvoys_testing.conformance
import *``) and define a session-scoped ``subject`` fixture with
`subject_fixture`: one vLLM engine per model, beside the transformers model
with the same weights. The suite compares every value of every layer on
several prompts (and two prompts in one trace), checks the stream
identities, and makes the same edits on both engines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import vlenvoys
from vlenvoys import weights
from vlenvoys.values.family import architectures_of
from vlenvoys.values.names import VALUES
from vlenvoys.values.reads import unsteerable

from . import oracle
from .models import PROMPTS, tiny_model
from .oracle import HFLayout, edited_logits

#: The oracle's bound in float32, on the CPU engine and on a GPU alike: |vLLM -
#: transformers| <= 1e-4, relative to each token's own stream magnitude where that
#: exceeds 1. On the tiny models (magnitudes of a few units) that is 1e-4 absolute.
#: SmolLM2's first-token stream reaches ~22,500 (float32's spacing there is 0.002)
#: and rounding grows through 30 layers to ~1.6e-5 of a token's magnitude; an
#: absolute 1e-4 is below float32 there. On a GPU it holds because a float32
#: engine's Triton dots run in full float32 (`vlenvoys.engine.loading.float32_kernels`):
#: measured on an H200, every family's values are within 3e-6 of transformers'
#: (relative), as on the CPU; with Triton's default TF32 dots, 5.6e-4.
TOLERANCE = 1e-4
#: The bound of a bfloat16 engine against transformers in bfloat16, same scaling.
#: bfloat16 keeps 8 bits of mantissa (a spacing of 2**-7 of a value at 1), and the
#: two engines round in different places (fused kernels, other summation orders),
#: so differences of a few spacings grow through the blocks; measured largest, tiny
#: Llama: 0.06 on the CPU engine (attention_values), 0.035 on an H200 (mlp_neurons).
BF16_TOLERANCE = 0.1
#: Attention probabilities (absolute, they are at most 1), per dtype.
PATTERN_TOLERANCE = 1e-5
BF16_PATTERN_TOLERANCE = 0.02


#: The largest difference to transformers seen per model and value, for the summary.
DIFFERENCES: dict[tuple[str, str], float] = {}
#: Per model: the largest difference relative to the token's magnitude (what the bound
#: applies to), the value it was seen on, and the bound.
RELATIVE: dict[str, tuple[float, str, float]] = {}


def record(model: str, value: str, difference: float) -> None:
    """Keep the largest ``difference`` seen for ``(model, value)``."""
    DIFFERENCES[(model, value)] = max(difference, DIFFERENCES.get((model, value), 0.0))


def summary(terminalreporter) -> None:
    """Print the differences; call it from a conftest's ``pytest_terminal_summary``."""
    if not DIFFERENCES:
        return
    from vllm.platforms import current_platform

    terminalreporter.section(f"largest |vLLM - transformers| (vLLM on {current_platform.device_type})")
    for (model, value), difference in sorted(DIFFERENCES.items()):
        terminalreporter.write_line(f"{model:28s} {value:42s} {difference:.3g}")
    for model, (relative, value, bound) in sorted(RELATIVE.items()):
        terminalreporter.write_line(f"{model:28s} largest relative difference {relative:.3g} ({value}; bound {bound:g})")


@dataclass
class Subject:
    """A model served by vLLM and the same weights on transformers."""

    name: str
    model: object
    reference: torch.nn.Module
    prompts: list[list[int]]
    layout: HFLayout
    cache: dict = field(default_factory=dict)
    #: Under tensor parallelism: every value of every prompt read on one rank, for comparison.
    one_rank: list[dict] | None = None
    #: The dtype both engines run in.
    dtype: torch.dtype = torch.float32

    @property
    def tolerance(self) -> float:
        """The oracle's bound for this subject's dtype (see `TOLERANCE`)."""
        return TOLERANCE if self.dtype == torch.float32 else BF16_TOLERANCE

    @property
    def pattern_tolerance(self) -> float:
        return PATTERN_TOLERANCE if self.dtype == torch.float32 else BF16_PATTERN_TOLERANCE

    @property
    def device_type(self) -> str:
        """Where the engine runs and its values live: ``"cpu"`` or ``"cuda"``."""
        from vllm.platforms import current_platform

        return current_platform.device_type

    @property
    def identity_tolerance(self) -> float:
        """How far ``layer_input + attention_output`` may be from ``layer_mid`` (one rounding of the sum)."""
        return max(1e-5, 2 * torch.finfo(self.dtype).eps)

    def expected(self, index: int) -> dict:
        """transformers' values for prompt ``index``, computed once."""
        if index not in self.cache:
            self.cache[index] = oracle.reference(self.reference, self.prompts[index], self.layout)
        return self.cache[index]

    @property
    def routed(self) -> bool:
        """Whether the model's MLPs are mixtures of experts."""
        return self.mlp_kind == "routed"

    @property
    def batch_variant_on_cpu(self) -> str | None:
        """Why this model's values on the CPU engine depend on the other rows of the step (None: they do not).

        Qwen2-MoE's shared expert is scaled by ``F.sigmoid(shared_expert_gate(x))``, a
        ``[tokens, 1]`` tensor: one element per token. torch's CPU sigmoid runs its
        vectorized kernel over 32-element chunks and a scalar loop over the remainder,
        and the two round differently in the last bit (measured: 98 of the tail elements
        of sizes 1..199 differ, 3.0e-8 at most, none in a vectorized chunk). Which path a
        token's gate takes depends on its row's place in the step, i.e. on the other
        requests: a 21-token prompt's block-0 mlp_output beside prompts of 3, 10 and 24
        tokens differed from its value alone by 1.2e-7 (its shared expert's inputs and
        its router logits were bit-identical). Mixtral and Qwen3-MoE have no shared
        expert gate, and their values, like the dense families', stay bit-identical.
        """
        if hasattr(self.block(0).mlp, "shared_expert_gate"):
            return "torch's CPU sigmoid of the shared expert's [tokens, 1] gate rounds by the row's place in the step"
        return None

    @property
    def hidden_size(self) -> int:
        return self.reference.config.hidden_size

    @property
    def heads(self) -> tuple[int, int]:
        """(query heads, key/value heads)."""
        config = self.reference.config
        return config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads

    def window(self, layer: int) -> int | None:
        """The sliding window of block ``layer`` per the transformers config, None for full attention."""
        config = self.reference.config
        if not getattr(config, "use_sliding_window", True):
            return None
        types = getattr(config, "layer_types", None)
        if types is not None and types[layer] != "sliding_attention":
            return None
        return getattr(config, "sliding_window", None)

    @property
    def parallel(self) -> bool:
        """Whether the blocks are parallel (``Layer.PARALLEL``): no stream between attention and MLP."""
        return bool(self.model.architecture.layer.PARALLEL)

    @property
    def mlp_kind(self) -> str:
        return self.model.architecture.mlp.KIND

    def edited(self, prompt: list[int], edits=(), key_edits=None, router_edits=None, route_edits=None) -> torch.Tensor:
        """transformers' last-token logits with ``edits`` (see `vlenvoys_testing.oracle.edited_logits`)."""
        return edited_logits(self.reference, prompt, edits, self.layout, key_edits, router_edits, route_edits)

    def multiplier(self, value: str) -> float:
        """What the block multiplies ``value``'s transformers module output by."""
        return self.layout.multiplier(self.reference, value)

    def place(self, value: str) -> str:
        """The transformers module path (under a block) where ``value`` is read."""
        return self.layout.places[value][0]

    def block(self, index: int) -> torch.nn.Module:
        return self.layout.blocks(self.reference)[index]


#: Prompts for the real model (the tiny models use `vlenvoys_testing.PROMPTS`).
REAL_PROMPTS = (
    "The Eiffel Tower is located in the city of",
    "def fibonacci(n):",
    "Once upon a time, a small fox found a golden key under the old oak tree and",
    "Water boils at",
)


def subject_fixture(models: dict[str, tuple], layout: HFLayout = oracle.LLAMA_LAYOUT) -> Callable:
    """A session-scoped, parametrized ``subject`` fixture over ``models``.

    ``models`` maps a test name to ``(architecture, config overrides)`` for
    `vlenvoys_testing.tiny_model`, or to ``(None, {})`` for the built-in
    SmolLM2, optionally followed by the model's own `HFLayout` and a dict of
    vLLM engine arguments (``{"tensor_parallel_size": 2}``: the values are
    then also read on one rank first, for `test_tensor_parallel_matches_one_rank`;
    ``{"dtype": "bfloat16"}``: both engines run in bfloat16, against `BF16_TOLERANCE`).
    One engine runs at a time; pytest groups the tests by model. On a GPU, a
    subject of more ranks than the machine has GPUs is skipped. A subject on
    vLLM's transformers backend (``{"model_impl": "transformers"}``) is
    marked ``transformers_backend``: the backend decorates transformers'
    classes process-wide, so those subjects run in a pytest process of their
    own (``-m transformers_backend``).
    """

    def param(name: str) -> object:
        engine_kwargs = next((item for item in models[name][2:] if isinstance(item, dict)), {})
        if engine_kwargs.get("model_impl") == "transformers":
            return pytest.param(name, marks=pytest.mark.transformers_backend)
        return name

    @pytest.fixture(scope="session", params=[param(name) for name in models])
    def subject(request, tmp_path_factory):
        from transformers import AutoTokenizer

        name = request.param
        architecture, overrides, *rest = models[name]
        own = next((item for item in rest if isinstance(item, HFLayout)), layout)
        engine_kwargs = next((item for item in rest if isinstance(item, dict)), {})
        if architecture is None:
            path, texts = weights.smollm2_path(), REAL_PROMPTS
        else:
            path = tiny_model(architecture, tmp_path_factory.mktemp(name), **overrides)
            texts = PROMPTS
        ranks = engine_kwargs.get("tensor_parallel_size", 1)
        gpus = gpu_count()
        if ranks > 1 and gpus is not None and gpus < ranks:
            pytest.skip(f"{name} needs {ranks} GPUs; this machine has {gpus}")
        dtype = getattr(torch, engine_kwargs.get("dtype", "float32"))
        tokenizer = AutoTokenizer.from_pretrained(path)
        prompts = [tokenizer(text)["input_ids"] for text in texts]
        reference = oracle.load_reference(path, dtype)
        one_rank = None
        if ranks > 1:
            with oracle.engine(str(path), dtype=str(dtype).removeprefix("torch.")) as model:
                one_rank = read_all(model, prompts)
        with oracle.engine(str(path), **engine_kwargs) as model:
            yield Subject(name, model, reference, prompts, own, one_rank=one_rank, dtype=dtype)

    return subject


def dtype_independent(subject) -> None:
    """Skip, on a half-precision subject, a check of a path the dtype does not change (a refusal, a listing).

    The float32 subjects of the same family run it; the half-precision ones keep
    the value comparisons, edits and steering, where rounding does differ.
    """
    if subject.dtype != torch.float32:
        pytest.skip(f"dtype-independent: checked on the float32 subjects, not again in {subject.dtype}")


def host(value):
    """A value saved on the engine, on the CPU where the oracle's are (dicts and lists of them too).

    A trace's saved tensors come back on the engine's device (``cuda:0`` on a GPU engine).
    """
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: host(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host(item) for item in value)
    return value


def same_rows(batched: torch.Tensor, alone: torch.Tensor, subject=None) -> bool:
    """Whether a request's value computed beside other requests equals the same value computed alone.

    On the CPU engine they are bit-identical (measured), except on a model whose
    subject names a reason it is not (``batch_variant_on_cpu``: Qwen2-MoE's shared
    expert gate), which is held to the bound as on a GPU. vLLM's GPU kernels pick
    their tiling, and with it their order of summation, by the step's shape,
    so beside other requests a request's values differ from its values alone by
    float rounding: there they are held to the oracle's bound (``subject``'s, or
    float32's), and the difference is recorded as "batched vs alone". Requests
    in steps of the same shapes are compared exactly, with ``torch.equal``.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and getattr(subject, "batch_variant_on_cpu", None) is None:
        return torch.equal(batched, alone)
    difference = difference_of(batched, alone)
    bound = TOLERANCE if subject is None else subject.tolerance
    same = bool((difference / alone.detach().float().abs().amax(-1, keepdim=True).cpu().clamp(min=1.0)).max() <= bound)
    if subject is not None and same:  # a check that two values differ (an edit showed) is no rounding to report
        record(subject.name, "batched vs alone", difference.max().item())
    return same


def gpu_count() -> int | None:
    """The GPUs vLLM may use, None on the CPU engine.

    Counted the way vLLM counts them, without setting up CUDA in this process:
    torch.cuda's count would, and an engine forked afterwards fails to start
    ("Cannot re-initialize CUDA in forked subprocess", measured on an H200).
    """
    from vllm.platforms import current_platform

    return current_platform.device_count() if current_platform.is_cuda_alike() else None


def logits_of(model, prompt, edit=None) -> torch.Tensor:
    """The last token's logits ``[vocab]`` of one traced request, with ``edit(model)`` applied in its block, on the CPU."""
    with model.trace(prompt, temperature=0.0):
        if edit is not None:
            edit(model)
        logits = model.logits.save()
    return logits.reshape(-1).cpu()


def difference_of(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``|got - want|`` in float32 on the CPU, whatever device and dtype each came in."""
    return (got.detach().to("cpu", torch.float32) - want.detach().to("cpu", torch.float32)).abs()


def check_edit(subject, label: str, got: torch.Tensor, want: torch.Tensor, baseline: torch.Tensor) -> None:
    """The same edit on both engines gives the same logits, and it changed something."""
    difference = difference_of(got, want).max().item()
    record(subject.name, f"edit: {label}", difference)
    assert difference <= subject.tolerance * max(1.0, want.detach().float().abs().max().item())
    assert difference_of(got, baseline).max() > 1e-4, "the edit changed nothing, so the comparison proves nothing"


def close(subject, label: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    """Record the largest difference and say whether it is within the oracle's tolerance."""
    difference = difference_of(got, want)
    scale = want.detach().to("cpu", torch.float32).abs().amax(-1, keepdim=True).clamp(min=1.0)
    record(subject.name, label, difference.max().item())
    relative = (difference / scale).max().item()
    if relative > RELATIVE.get(subject.name, (-1.0,))[0]:
        RELATIVE[subject.name] = (relative, label, subject.tolerance)
    return relative <= subject.tolerance


def served(model) -> list[tuple[str, str]]:
    """The (owner, value) pairs this model serves, in forward order."""
    support = vlenvoys.support(model)
    kinds = {"layer": "layer", "self_attn": "attention", "mlp": "mlp"}
    return [(owner, name) for owner, name in VALUES if support[kinds[owner], name].available]


def read_all(model, prompts: list[list[int]]) -> list[dict]:
    """Every value of every block for each prompt, one invoke per prompt, in one trace."""
    values = served(model)
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        results = dict().save()
        for number, prompt in enumerate(prompts):
            with tracer.invoke(prompt):
                saved = {"token_embeddings": model.token_embeddings.save()}
                for index, layer in enumerate(model.layers):
                    for owner, name in values:
                        envoy = layer if owner == "layer" else getattr(layer, owner)
                        saved[(name, index)] = getattr(envoy, name).save()
                saved["logits"] = model.logits.save()
                results[number] = saved
    return [host(results[number]) for number in range(len(prompts))]


def compare(subject, saved: dict, index: int) -> None:
    expected = subject.expected(index)
    layers = len(expected["values"]["layer_input"])
    tokens = len(subject.prompts[index])
    embeddings = saved["token_embeddings"]
    assert embeddings.shape == (1, tokens, expected["values"]["layer_input"][0].shape[-1])
    assert close(subject, "token_embeddings", embeddings, expected["values"]["layer_input"][0])
    for _, name in served(subject.model):
        for layer in range(layers):
            got, want = saved[(name, layer)], expected["values"][name][layer]
            assert got.shape == want.shape, (name, layer, got.shape, want.shape)
            if name == "attention_probabilities":
                difference = difference_of(got, want).max().item()
                record(subject.name, name, difference)
                assert difference <= subject.pattern_tolerance, (name, layer)
            elif name == "attention_scores":
                masked = torch.isinf(want)
                assert torch.equal(torch.isinf(got), masked), (name, layer)
                assert close(subject, name, got[~masked], want[~masked]), (name, layer)
            elif name == "mlp_router_experts":
                same_experts(subject, got, want, (name, layer))
            else:
                assert close(subject, name, got, want), (name, layer)
    assert close(subject, "logits", saved["logits"].reshape(-1), expected["logits"])


def same_experts(subject, got: torch.Tensor, want: torch.Tensor, where: object) -> None:
    """Each token's chosen experts are transformers' exactly, in its order (by weight, highest first), as int64."""
    assert got.dtype == torch.int64, (where, got.dtype)
    differ = (got.cpu() != want).any(-1)
    record(subject.name, "mlp_router_experts: tokens routed otherwise", float(differ.sum()))
    assert not differ.any(), (where, got, want)


def test_each_prompt_alone(subject):
    for index, prompt in enumerate(subject.prompts):
        (saved,) = read_all(subject.model, [prompt])
        compare(subject, saved, index)


def test_two_prompts_in_one_trace(subject):
    """Two requests of different lengths in one step: each reads only its own rows."""
    first, second = 0, len(subject.prompts) - 1
    saved = read_all(subject.model, [subject.prompts[first], subject.prompts[second]])
    compare(subject, saved[0], first)
    compare(subject, saved[1], second)


def test_tensor_parallel_matches_one_rank(subject):
    """Split across ranks, every value of every prompt equals the one-rank engine's (float32 rounding)."""
    if subject.one_rank is None:
        pytest.skip("this engine runs on one rank")
    for number, (split, whole) in enumerate(zip(read_all(subject.model, subject.prompts), subject.one_rank)):
        assert split.keys() == whole.keys()
        for key, value in whole.items():
            assert split[key].shape == value.shape, (number, key)
            finite = torch.isfinite(value)
            assert torch.equal(finite, torch.isfinite(split[key])), (number, key)
            difference = difference_of(split[key][finite], value[finite]).max().item() if finite.any() else 0.0
            record(subject.name, f"vs one rank: {key[0] if isinstance(key, tuple) else key}", difference)
            assert difference <= subject.tolerance * max(1.0, value[finite].float().abs().max().item()), (number, key)


def test_stream_identities(subject):
    """layer_input + attention_output == layer_mid and layer_mid + mlp_output == layer_output.

    A parallel block (``Layer.PARALLEL``) adds both to its input at once:
    layer_input + attention_output + mlp_output == layer_output, and its
    layer_mid is refused by name (`vlenvoys.PARALLEL`).
    """
    if subject.parallel:
        return parallel_identity(subject)
    model = subject.model
    with model.trace(subject.prompts[-1], temperature=0.0):
        parts = list().save()
        for layer in model.layers:
            parts.append(
                (
                    layer.layer_input.save(),
                    layer.self_attn.attention_output.save(),
                    layer.layer_mid.save(),
                    layer.mlp.mlp_output.save(),
                    layer.layer_output.save(),
                )
            )
    bound = subject.identity_tolerance
    for entering, attention, mid, mlp, leaving in parts:
        assert (entering + attention - mid).abs().max() <= bound * max(1.0, mid.abs().max().item())
        assert (mid + mlp - leaving).abs().max() <= bound * max(1.0, leaving.abs().max().item())


def parallel_identity(subject) -> None:
    """A parallel block: layer_input + attention_output + mlp_output == layer_output; layer_mid refused (PARALLEL)."""
    model = subject.model
    with model.trace(subject.prompts[-1], temperature=0.0):
        parts = list().save()
        for layer in model.layers:
            parts.append(
                (
                    layer.layer_input.save(),
                    layer.self_attn.attention_output.save(),
                    layer.mlp.mlp_output.save(),
                    layer.layer_output.save(),
                )
            )
    bound = subject.identity_tolerance
    for entering, attention, mlp, leaving in parts:
        # Two roundings of the sums (the block adds three terms), in either order.
        assert (entering + attention + mlp - leaving).abs().max() <= 2 * bound * max(1.0, leaving.abs().max().item())
        # A sequential reading would miss the MLP's part: the identity tells the two apart.
        assert (entering + attention - leaving).abs().max() > 2 * bound * max(1.0, leaving.abs().max().item())
    with pytest.raises(vlenvoys.Unavailable) as raised:
        logits_of(model, subject.prompts[0], lambda m: m.layers[0].layer_mid.save())
    assert raised.value.reason == vlenvoys.PARALLEL
    assert raised.value.value == "layer_mid"
    assert not vlenvoys.support(model)["layer", "layer_mid"].available
    assert vlenvoys.support(model)["layer", "layer_mid"].note == vlenvoys.PARALLEL


def test_texts_sent_together_get_the_ids_vllm_gives_each_alone(subject):
    """A trace's invokes, a collection's and `vlenvoys.generate`'s texts are tokenized in one call of the tokenizer
    (`vlenvoys.engine.requests.tokenized_together`): each text gets the ids vLLM's own tokenizing of it alone gives."""
    from vllm import SamplingParams

    dtype_independent(subject)
    model = subject.model
    texts = [*PROMPTS, "  two leading spaces", "Ünïcödé, an emoji 🙂 and a\nnew line", "<s> and </s> as text", "xyz " * 20]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm = model.vllm_entrypoint
    alone = [llm.generate([text], one, use_tqdm=False)[0].prompt_token_ids for text in texts]  # vLLM tokenizes it
    generated = vlenvoys.generate(model, texts, one, progress=False)
    assert [list(output.prompt_token_ids) for output in generated] == alone
    assert [output.prompt for output in generated] == texts
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        read = dict().save()
        for number, text in enumerate(texts):
            with tracer.invoke(text):
                read[number] = model.input_ids
    assert [host(read[number]).flatten().tolist() for number in range(len(texts))] == alone
    collected = vlenvoys.collect(model, texts, "layer_output", [0], batch_size=3)["layer_output.0"]
    assert [rows.shape[-2] for rows in collected] == [len(ids) for ids in alone]


def test_saved_values_are_private_copies(subject):
    """A saved block-0 stream is not overwritten by later kernels (vLLM reuses its buffers)."""
    dtype_independent(subject)
    model = subject.model
    with model.trace(subject.prompts[1], temperature=0.0):
        early = model.layers[0].layer_output.save()
        again = model.layers[0].layer_output.clone().save()
    expected = subject.expected(1)["values"]["layer_output"][0]
    assert torch.equal(early, again)
    assert early.device.type == subject.device_type
    assert close(subject, "layer_output", early, expected)


def test_decode_steps_have_one_row(subject):
    """Generating three tokens: the prefill serves every prompt token, each decode step one row."""
    dtype_independent(subject)
    model = subject.model
    prompt = subject.prompts[1]
    with model.trace(prompt, temperature=0.0, max_tokens=3) as tracer:
        shapes = list().save()
        for _ in tracer.iter[0:3]:
            shapes.append(tuple(model.layers[1].mlp.mlp_output.shape))
            shapes.append(tuple(model.layers[1].layer_output.shape))
    hidden = subject.hidden_size
    assert shapes == [(1, len(prompt), hidden)] * 2 + [(1, 1, hidden)] * 4


def test_unknown_value_name_is_an_attribute_error(subject):
    dtype_independent(subject)
    with pytest.raises(AttributeError, match="no_such_value"):
        with subject.model.trace(subject.prompts[0], temperature=0.0):
            subject.model.layers[0].no_such_value.save()




def test_an_empty_prompt_is_refused_by_name_and_the_engine_goes_on(subject):
    """No tokens is a ValueError naming the invoke; an empty text is what its tokenizer makes of it (a BOS, or none)."""
    dtype_independent(subject)
    model, prompt = subject.model, subject.prompts[0]
    baseline = logits_of(model, prompt)
    said = r"invoke {}'s prompt is empty \(no tokens\): a trace reads at least one token".format
    for empty in ([], {"prompt_token_ids": []}):
        with pytest.raises(ValueError, match=said(1)):
            with model.trace(temperature=0.0) as tracer:
                with tracer.invoke(prompt):
                    pass
                with tracer.invoke(empty):
                    model.layers[0].layer_output.save()
    ids = model.tokenizer("")["input_ids"]
    if ids:  # as transformers reads it: the tokenizer's special tokens alone
        with model.trace("", temperature=0.0):
            stream = model.layers[0].layer_output.save()
        assert tuple(stream.shape) == (1, len(ids), subject.hidden_size)
    else:
        with pytest.raises(ValueError, match=said(0)):
            with model.trace("", temperature=0.0):
                model.layers[0].layer_output.save()
    assert torch.equal(logits_of(model, prompt), baseline)


def steering_vector(subject) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return 4 * torch.randn(subject.hidden_size, generator=generator)


def test_add_to_layer_mid_in_place(subject):
    """Add a vector at one position of layer 1's mid stream, in place.

    A parallel block has no mid stream: the vector is added to the
    attention's contribution, which is what an add after the attention is there.
    """
    prompt, vector = subject.prompts[2], steering_vector(subject)
    position = len(prompt) - 2  # inside every sliding window of the last token

    def edit(model):
        mid = model.layers[1].self_attn.attention_output if subject.parallel else model.layers[1].layer_mid
        mid[:, position] += vector.to(mid.device, mid.dtype)  # in place: torch wants one device

    def on_reference(output):
        output = output.clone()
        output[:, position] += (vector / subject.multiplier("attention_output")).to(output.dtype)
        return output

    # On transformers the mid stream is the block input plus the attention
    # output, so adding to the attention output adds to it.
    want = subject.edited(prompt, [(1, subject.place("attention_output"), "output", on_reference)])
    label = "attention_output += v (parallel)" if subject.parallel else "layer_mid += v"
    check_edit(subject, label, logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_zero_mlp_output(subject):
    prompt = subject.prompts[2]

    def edit(model):
        model.layers[1].mlp.mlp_output[:] = 0

    want = subject.edited(prompt, [(1, subject.place("mlp_output"), "output", torch.zeros_like)])
    check_edit(subject, "mlp_output = 0", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_assign_layer_output(subject):
    """Assign a new stream to layer 1's output: half of what it was."""
    prompt = subject.prompts[3]

    def edit(model):
        model.layers[1].layer_output = model.layers[1].layer_output * 0.5

    want = subject.edited(prompt, [(1, "", "output", lambda output: output * 0.5)])
    check_edit(subject, "layer_output = x/2", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_assign_token_embeddings(subject):
    prompt = subject.prompts[1]

    def edit(model):
        model.token_embeddings = model.token_embeddings.flip(1)

    want = subject.edited(prompt, [(0, "", "input", lambda hidden: hidden.flip(1))])
    check_edit(subject, "token_embeddings flipped", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_unedited_reads_leave_logits_bit_identical(subject):
    prompt = subject.prompts[2]
    baseline = logits_of(subject.model, prompt)

    values = served(subject.model)

    def read_everything(model):
        for layer in model.layers:
            for owner, name in values:
                getattr(layer if owner == "layer" else getattr(layer, owner), name).save()

    assert torch.equal(logits_of(subject.model, prompt, read_everything), baseline)


@pytest.mark.parametrize("extra", [1, -1])
def test_wrong_token_count_is_refused_and_engine_goes_on(subject, extra):
    dtype_independent(subject)
    prompt = subject.prompts[1]
    baseline = logits_of(subject.model, prompt)
    hidden = subject.hidden_size

    def edit(model):
        model.layers[1].layer_output = torch.zeros(1, len(prompt) + extra, hidden)

    with pytest.raises(vlenvoys.InvalidWrite, match=rf"layer_output: expected shape \[1, {len(prompt)}, {hidden}\]"):
        logits_of(subject.model, prompt, edit)
    assert torch.equal(logits_of(subject.model, prompt), baseline)


def test_cpu_tensors_written_into_values(subject):
    """What a caller makes on the CPU reaches the engine's values wherever they live.

    An assignment and `steer` move a CPU tensor to the engine's device (steer
    also to its dtype); an in-place operation is torch's, which wants one device:
    on a GPU engine it is refused as `InvalidWrite`, saying how to move it, and
    the engine goes on.
    """
    model, prompt = subject.model, subject.prompts[1]
    dtype, tokens = subject.dtype, len(subject.prompts[1])
    zeros = torch.zeros(1, tokens, subject.hidden_size, dtype=dtype)  # on the CPU
    vector = steering_vector(subject)  # float32, on the CPU

    def zeroed_in_place(model):
        model.layers[1].layer_output[:] = 0

    def assigned(model):
        model.layers[1].layer_output = zeros

    assert torch.equal(logits_of(model, prompt, assigned), logits_of(model, prompt, zeroed_in_place))

    def by_hand(model):
        stream = model.layers[1].layer_output
        stream[:] += vector.to(stream.device, stream.dtype)

    steered = logits_of(model, prompt, lambda m: m.steer(1, vector))
    assert torch.equal(steered, logits_of(model, prompt, by_hand))

    def in_place(model):
        model.layers[1].layer_output[:, -1] += vector.to(dtype)

    if subject.device_type == "cpu":
        assert torch.equal(logits_of(model, prompt, in_place), logits_of(model, prompt, lambda m: m.steer(1, vector, token_positions=-1)))
    else:
        with pytest.raises(vlenvoys.InvalidWrite, match=r"x\.to\(value\.device\)"):
            logits_of(model, prompt, in_place)
    assert torch.equal(logits_of(model, prompt, lambda m: m.steer(1, vector)), steered)


def steered_in_a_trace(model, prompts, steered: list[bool], vector, factor: float, steps: int) -> list[list]:
    """Each prompt's logits at each of ``steps`` generation steps, ``model.steer(1, ...)`` at every step of those steered."""
    with model.trace(temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        results = dict().save()
        for number, (prompt, steer) in enumerate(zip(prompts, steered, strict=True)):
            with tracer.invoke(prompt):
                logits = []
                for _ in tracer.iter[0:steps]:
                    if steer:
                        model.steer(1, vector, factor)
                    logits.append(model.logits)
                results[number] = logits
    return [[host(step).reshape(-1, step.shape[-1])[-1] for step in results[number]] for number in range(len(prompts))]


def test_steered_generation_equals_steering_in_a_trace(subject):
    """`vlenvoys.generate`: the worker's batched steering gives a trace's tokens and log-probabilities.

    Two requests in one call, one steered at every position of block 1, one
    not, against the same two steered (and not) by ``model.steer`` at every
    step of one trace; a bad `Steering` is refused before anything runs.
    """
    from vllm import SamplingParams

    model, prompts, steps, factor = subject.model, subject.prompts[:2], 3, 2.0
    vector = steering_vector(subject)
    steering = [vlenvoys.Steering(1, vector, factor), None]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=1)
    if unsteerable(model) is not None:
        with pytest.raises(NotImplementedError, match="steered generation"):
            vlenvoys.generate(model, prompts, params, steering=steering)
        # Unsteered, the same call generates.
        plain = vlenvoys.generate(model, prompts, params)
        assert [len(output.outputs[0].token_ids) for output in plain] == [params.max_tokens] * len(prompts)
        return
    with pytest.raises(ValueError, match=r"expected shape"):
        vlenvoys.generate(model, prompts, params, steering=vlenvoys.Steering(1, vector[:-1]))
    with pytest.raises(IndexError):
        vlenvoys.generate(model, prompts, params, steering=vlenvoys.Steering(99, vector))
    with pytest.raises(ValueError, match="the next norm would overflow"):
        vlenvoys.generate(model, prompts, params, steering=vlenvoys.Steering(1, vector, 1e30))
    outputs = vlenvoys.generate(model, prompts, params, steering=steering)
    traced = steered_in_a_trace(model, prompts, [True, False], vector, factor, steps)
    unsteered = vlenvoys.generate(model, prompts[:1], params)[0].outputs[0].token_ids
    same_generations(subject, "steered generation vs a trace: log-probability", outputs, traced)
    assert list(outputs[0].outputs[0].token_ids) != list(unsteered), "the steering must change the steered request"


def same_generations(subject, what: str, outputs: list, traced: list) -> None:
    """Each output's greedy tokens are its trace's argmaxes, and their log-probabilities the trace's, within the bound."""
    for number, (output, logits) in enumerate(zip(outputs, traced, strict=True)):
        generated = output.outputs[0]
        assert list(generated.token_ids) == [int(step.argmax()) for step in logits], number
        for token, offered, step in zip(generated.token_ids, generated.logprobs, logits, strict=True):
            want = step.float().log_softmax(-1)[token]
            assert close(subject, what, torch.tensor([offered[token].logprob]), want[None])


def test_collect_equals_a_trace(subject):
    """`vlenvoys.collect` (each module read once per step for every request) gives each prompt a trace's values.

    Three prompts, three values at the first and last block, against one
    trace per value with an invoke per prompt; bit-identical on the CPU
    engine, within the oracle's bound where the GPU tiles by the step's shape.
    """
    layers = [0, subject.model.num_layers - 1]
    for owner, value in (("self_attn", "attention_output"), ("mlp", "mlp_output"), (None, "layer_output")):
        assert_collect_equals_a_trace(subject, subject.prompts[:3], owner, value, layers)


def assert_collect_equals_a_trace(subject, prompts, owner: str | None, value: str, layers: list[int], same_dtype: bool = False) -> None:
    """`vlenvoys.collect` of ``value`` (of each block's ``owner`` child, or the block) at ``layers`` against one trace
    with an invoke per prompt: every prompt's rows of the same shape (and dtype, with ``same_dtype``) and within
    `same_rows`."""
    model = subject.model
    collected = vlenvoys.collect(model, prompts, value, layers)
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        traced = dict().save()
        for number, prompt in enumerate(prompts):
            with tracer.invoke(prompt):
                for layer in layers:
                    block = model.layers[layer]
                    traced[number, layer] = getattr(block if owner is None else getattr(block, owner), value).save()
    for layer in layers:
        rows = collected[f"{value}.{layer}"]
        assert len(rows) == len(prompts), value
        for number, got in enumerate(rows):
            want = traced[number, layer]
            assert tuple(got.shape) == tuple(want.shape), (value, layer, number)
            assert not same_dtype or got.dtype == want.dtype, (value, layer, number, got.dtype, want.dtype)
            assert same_rows(got.to(want.device), want, subject), (value, layer, number)


def test_graph_engine_steers_as_a_trace(subject):
    """On a GPU, an engine replaying CUDA graphs (``load(cuda_graphs=True)``) of the same weights steers as a trace does.

    Its decode steps replay graphs captured with the steering hooks of every
    block; four steps of two requests, one steered at block 1, one not.
    """
    from vllm import SamplingParams

    if subject.device_type != "cuda":
        pytest.skip("the CPU engine has no CUDA graphs (vlenvoys-llama's test_llama_graphs runs the same hooks eagerly)")
    if unsteerable(subject.model) is not None or subject.one_rank is not None:
        pytest.skip("steered generation is not served for this subject (see test_steered_generation_equals_steering_in_a_trace)")
    model, prompts, steps, factor = subject.model, subject.prompts[:2], 4, 2.0
    vector = steering_vector(subject)
    steering = [vlenvoys.Steering(1, vector, factor), None]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=1)
    config = model.vllm_entrypoint.llm_engine.model_config
    with oracle.engine(config.model, dtype=config.dtype, max_model_len=config.max_model_len, cuda_graphs=True) as graphs:
        outputs = vlenvoys.generate(graphs, prompts, params, steering=steering)
    traced = steered_in_a_trace(model, prompts, [True, False], vector, factor, steps)
    same_generations(subject, "graph engine: steered generation vs a trace", outputs, traced)


def test_wrong_dtype_is_refused(subject):
    prompt = subject.prompts[1]

    def edit(model):
        if subject.parallel:  # no layer_mid (PARALLEL)
            model.layers[0].layer_output = model.layers[0].layer_output.double()
        else:
            model.layers[0].layer_mid = model.layers[0].layer_mid.double()

    with pytest.raises(vlenvoys.InvalidWrite, match="dtype"):
        logits_of(subject.model, prompt, edit)


def test_non_finite_write_is_refused_and_later_requests_stay_clean(subject):
    # A NaN that reached the cached keys and values would turn later requests' logits NaN.
    prompt, later = subject.prompts[1], subject.prompts[2]
    baseline = logits_of(subject.model, later)

    def edit(model):
        model.layers[0].layer_output[:, -1] = float("nan")

    with pytest.raises(vlenvoys.InvalidWrite, match="NaN or infinite"):
        logits_of(subject.model, prompt, edit)
    assert torch.equal(logits_of(subject.model, later), baseline)




def test_zero_one_heads_output_at_one_position(subject):
    prompt = subject.prompts[2]
    head, position, layer = 1, len(prompt) - 1, 0
    head_dim = subject.model.layers[0].self_attn.head_dim

    def edit(model):
        model.layers[layer].self_attn.attention_head_outputs[:, position, head] = 0

    def on_reference(mixed):
        mixed = mixed.clone()
        mixed[:, position, head * head_dim : (head + 1) * head_dim] = 0
        return mixed

    want = subject.edited(prompt, [(layer, subject.place("attention_premix"), "input", on_reference)])
    check_edit(subject, "head output zeroed", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_replace_a_key_row(subject):
    """Give the second-to-last token the last token's keys (rotated, as the kernel receives them).

    A token near the end, so that it is inside every sliding window.
    """
    prompt = subject.prompts[2]
    layer, target = 0, len(prompt) - 2

    def edit(model):
        keys = model.layers[layer].self_attn.attention_keys
        keys[:, target] = keys[:, -1]

    def on_reference(keys):  # [1, kv_heads, tokens, head_dim]
        keys = keys.clone()
        keys[:, :, target] = keys[:, :, -1]
        return keys

    want = subject.edited(prompt, key_edits={layer: on_reference})
    check_edit(subject, "key row replaced", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_assign_queries_reaches_the_model(subject):
    prompt = subject.prompts[1]
    baseline = logits_of(subject.model, prompt)

    def edit(model):
        attention = model.layers[0].self_attn
        attention.attention_queries = torch.zeros_like(attention.attention_queries)

    assert not torch.equal(logits_of(subject.model, prompt, edit), baseline)


def test_pattern_is_read_only(subject):
    dtype_independent(subject)
    def assign(model):
        model.layers[0].self_attn.attention_probabilities = torch.zeros(1)

    def edit_in_place(model):
        model.layers[0].self_attn.attention_scores[:] = -1e9

    for edit in (assign, edit_in_place):
        with pytest.raises(vlenvoys.ReadOnly, match="edit attention_queries or attention_keys"):
            logits_of(subject.model, subject.prompts[0], edit)
    # Reading it, unedited, is fine and leaves the logits as they were.
    baseline = logits_of(subject.model, subject.prompts[0])
    read = logits_of(subject.model, subject.prompts[0], lambda m: m.layers[0].self_attn.attention_scores.save())
    assert torch.equal(read, baseline)


def test_pattern_rows_sum_to_one_and_respect_the_causal_mask_and_window(subject):
    model = subject.model
    prompt = subject.prompts[-1]
    with model.trace(prompt, temperature=0.0):
        patterns = list().save()
        for layer in model.layers:
            patterns.append(layer.self_attn.attention_probabilities)
    patterns = host(patterns)
    tokens = len(prompt)
    distance = torch.arange(tokens)[:, None] - torch.arange(tokens)[None, :]
    for layer, pattern in enumerate(patterns):
        outside = distance < 0
        window = subject.window(layer)
        if window:
            outside |= distance >= window
            assert window < tokens, "the window must be shorter than the prompt to be tested"
        assert pattern.shape == (1, subject.heads[0], tokens, tokens)
        assert torch.allclose(pattern.sum(-1), torch.ones(()), atol=1e-5)
        assert torch.all(pattern[..., outside] == 0)


def test_scores_on_a_decode_step_are_refused_by_name(subject):
    dtype_independent(subject)
    model = subject.model
    with pytest.raises(vlenvoys.Unavailable, match="read it on the prefill") as raised:
        with model.trace(subject.prompts[0], temperature=0.0, max_tokens=2) as tracer:
            for step in tracer.iter[0:2]:
                model.layers[0].self_attn.attention_scores.save()
    assert raised.value.reason == vlenvoys.DECODE_STEP
    assert raised.value.value == "attention_scores"
    # The engine goes on serving.
    assert logits_of(model, subject.prompts[0]).shape[-1] == subject.reference.config.vocab_size


def test_decode_steps_serve_one_row_of_queries_keys_values(subject):
    model = subject.model
    prompt = subject.prompts[1]
    with model.trace(prompt, temperature=0.0, max_tokens=3) as tracer:
        shapes = list().save()
        for _ in tracer.iter[0:3]:
            attention = model.layers[1].self_attn
            shapes.append(
                (
                    tuple(attention.attention_queries.shape),
                    tuple(attention.attention_keys.shape),
                    tuple(attention.attention_head_outputs.shape),
                )
            )
    head_dim = model.layers[1].self_attn.head_dim
    for step, (queries, keys, outputs) in enumerate(shapes):
        rows = len(prompt) if step == 0 else 1
        assert queries == outputs == (1, rows, subject.heads[0], head_dim)
        assert keys == (1, rows, subject.heads[1], head_dim)


def test_zero_one_neuron_at_one_position(subject):
    if subject.routed:  # nothing to zero; the refusal is tested in test_neurons_by_mlp_kind
        assert not vlenvoys.support(subject.model)["mlp", "mlp_neurons"].available
        return
    prompt = subject.prompts[2]
    layer, position = 1, len(prompt) - 2
    # The neuron with the largest activation there, so zeroing it matters.
    with subject.model.trace(prompt, temperature=0.0):
        neurons = subject.model.layers[layer].mlp.mlp_neurons.save()
    neuron = int(neurons[0, position].abs().argmax())

    def edit(model):
        model.layers[layer].mlp.mlp_neurons[:, position, neuron] = 0

    def on_reference(hidden):
        hidden = hidden.clone()
        hidden[:, position, neuron] = 0
        return hidden

    want = subject.edited(prompt, [(layer, subject.place("mlp_neurons"), "input", on_reference)])
    got = logits_of(subject.model, prompt, edit)
    difference = difference_of(got, want).max().item()
    record(subject.name, "edit: one neuron zeroed", difference)
    assert difference <= subject.tolerance * max(1.0, want.float().abs().max().item())
    assert not torch.equal(got, logits_of(subject.model, prompt))


def test_neurons_by_mlp_kind(subject):
    """Gated and plain: neurons are [1, tokens, intermediate]. Routed (mixture of experts): refused (ROUTED)."""
    dtype_independent(subject)
    if subject.routed:
        with pytest.raises(vlenvoys.Unavailable, match="mlp_output") as raised:
            logits_of(subject.model, subject.prompts[0], lambda model: model.layers[0].mlp.mlp_neurons.save())
        assert raised.value.reason == vlenvoys.ROUTED
        return
    with subject.model.trace(subject.prompts[1], temperature=0.0):
        neurons = subject.model.layers[0].mlp.mlp_neurons.save()
    intermediate = subject.expected(1)["values"]["mlp_neurons"][0].shape[-1]
    assert neurons.shape == (1, len(subject.prompts[1]), intermediate)


def test_activation_by_mlp_kind(subject):
    """Plain: the activation is the neurons, read per block. Gated/routed: refused by name."""
    dtype_independent(subject)
    model = subject.model
    if subject.mlp_kind == "plain":
        with model.trace(subject.prompts[1], temperature=0.0):
            activations = list().save()
            for layer in model.layers:
                activations.append(layer.mlp.mlp_activation)
        # vLLM shares one activation module between blocks: each block's must be its own.
        for layer, activation in enumerate(activations):
            assert close(subject, "mlp_activation", activation, subject.expected(1)["values"]["mlp_activation"][layer])
        assert not torch.equal(activations[0], activations[-1])
        return
    reason = vlenvoys.ROUTED if subject.routed else vlenvoys.GATED
    with pytest.raises(vlenvoys.Unavailable, match="instead") as raised:
        logits_of(model, subject.prompts[0], lambda model: model.layers[0].mlp.mlp_activation.save())
    assert raised.value.reason == reason
    assert raised.value.value == "mlp_activation"


def test_support_lists_every_value_with_its_reason(subject):
    dtype_independent(subject)
    support = vlenvoys.support(subject.model)
    # The checkpoint's own name, though several architectures share a declaration (Llama, Mistral).
    checkpoint = subject.model.vllm_entrypoint.llm_engine.model_config.model
    assert support.architecture == architectures_of(checkpoint)[0]
    kind = subject.mlp_kind
    assert support["mlp", "mlp_activation"].available is (kind == "plain")
    if kind != "plain":
        assert support["mlp", "mlp_activation"].note == (vlenvoys.ROUTED if subject.routed else vlenvoys.GATED)
    assert support["mlp", "mlp_neurons"].available is not subject.routed
    assert support["attention", "attention_probabilities"].available
    assert "prefill only" in support["attention", "attention_probabilities"].note
    assert all(row.available or row.note for row in support), "every unavailable value says why"
    assert "mlp_neurons" in str(support)


def test_project_on_vocab_of_the_last_layer_is_the_logits(subject):
    """The logit lens's last row: final norm, unembedding, final soft cap and scale, as the engine's logits."""
    model, prompt = subject.model, subject.prompts[1]
    with model.trace(prompt, temperature=0.0):
        lens = model.project_on_vocab(model.layers_output[model.num_layers - 1]).save()
        logits = model.logits.save()
    assert lens.shape == (1, len(prompt), logits.shape[-1])
    difference = difference_of(lens[0, -1], logits.reshape(-1)).max().item()
    record(subject.name, "project_on_vocab(last layer) vs logits", difference)
    assert difference <= subject.tolerance * max(1.0, logits.float().abs().max().item())


def test_router_values_by_mlp_kind(subject):
    """Routed: the router's logits ([1, tokens, num_experts]), each token's chosen experts and their weights
    ([1, tokens, experts_per_token], by weight, highest first) on every block, the prefill's and a decode
    step's, equal to transformers' on the prompt and on the prompt with its generated token; where vLLM's
    kernel is monolithic the choice is refused by name (FUSED_ROUTING). Dense: all three refused (NOT_ROUTED)."""
    dtype_independent(subject)
    model, prompt = subject.model, subject.prompts[1]
    support = vlenvoys.support(model)
    choices = ("mlp_router_experts", "mlp_router_weights")
    if not subject.routed:
        for name in ("mlp_router_logits", *choices):
            assert support["mlp", name].code == "NOT_ROUTED"
            with pytest.raises(vlenvoys.Unavailable, match="no router") as raised:
                logits_of(model, prompt, _reading(name))
            assert raised.value.reason == vlenvoys.NOT_ROUTED
            assert raised.value.value == name
        return
    assert support["mlp", "mlp_router_logits"].available
    assert support["mlp", "mlp_router_logits"].shape == "[1, T, E]"
    for name in choices:
        assert support["mlp", name].shape == "[1, T, K]"
        if support["mlp", name].available:  # vLLM's router chooses them: read below and in the value comparison
            continue
        assert support["mlp", name].code == "FUSED_ROUTING"
        with pytest.raises(vlenvoys.Unavailable, match="mlp_router_logits") as raised:
            logits_of(model, prompt, _reading(name))
        assert raised.value.reason == vlenvoys.FUSED_ROUTING
    chosen = [name for name in choices if support["mlp", name].available]
    experts = subject.expected(1)["values"]["mlp_router_logits"][0].shape[-1]
    per_token = subject.reference.config.num_experts_per_tok
    layers = model.num_layers
    with model.trace(prompt, temperature=0.0, max_tokens=2) as tracer:
        shapes, read = list().save(), dict().save()
        for step in tracer.iter[0:2]:
            for index, layer in enumerate(model.layers):
                shapes.append(tuple(layer.mlp.mlp_router_logits.shape))
                for name in chosen:
                    read[name, index, step] = getattr(layer.mlp, name).save()
            if step == 0:
                read["token"] = model.logits.argmax(-1).reshape(-1).save()
    assert shapes == [(1, len(prompt), experts)] * layers + [(1, 1, experts)] * layers
    read = host(read)
    # The decode step's row is the generated token's: transformers' last row on the prompt and that token.
    decoded = oracle.reference(subject.reference, [*prompt, int(read["token"][-1])], subject.layout)["values"]
    for name in chosen:
        for index in range(layers):
            prefill, step = read[name, index, 0], read[name, index, 1]
            assert prefill.shape == (1, len(prompt), per_token) and step.shape == (1, 1, per_token), (name, index)
            want = subject.expected(1)["values"][name][index]
            if name == "mlp_router_experts":
                same_experts(subject, prefill, want, (name, index, "prefill"))
                same_experts(subject, step, decoded[name][index][:, -1:], (name, index, "decode step"))
                assert bool(((prefill >= 0) & (prefill < experts)).all())
            else:
                assert prefill.dtype == torch.float32, prefill.dtype
                assert close(subject, name, prefill, want), (name, index)
                assert close(subject, name, step, decoded[name][index][:, -1:]), (name, index, "decode step")
                assert bool((prefill[..., :-1] >= prefill[..., 1:]).all()), "highest weight first"


def _reading(name: str) -> Callable:
    """An edit for `logits_of` that reads block 0's MLP value ``name``."""

    def read(model):
        getattr(model.layers[0].mlp, name).save()

    return read


def _routed_only(subject) -> None:
    if not subject.routed:
        pytest.skip("a dense MLP has no router (test_router_values_by_mlp_kind checks the refusal)")


def test_router_logits_edit_reroutes(subject):
    """Take away each token's favourite expert at block 1 (its logit lowered below every other): the next
    expert is chosen in its place and the weights renormalized, on both engines alike."""
    _routed_only(subject)
    prompt = subject.prompts[2]

    def demote(logits):  # [1, tokens, experts]
        logits = logits.clone()
        top = logits.argmax(-1, keepdim=True)
        return logits.scatter(-1, top, logits.amin(-1, keepdim=True) - 1.0)

    def edit(model):
        logits = model.layers[1].mlp.mlp_router_logits
        top = logits.argmax(-1, keepdim=True)
        model.layers[1].mlp.mlp_router_logits = logits.scatter(-1, top, logits.amin(-1, keepdim=True) - 1.0)

    want = subject.edited(prompt, router_edits={1: demote})
    check_edit(subject, "router: top expert demoted", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_router_logits_in_place_edit(subject):
    """Add to one expert's logit at every position of block 0, in place: that expert is routed to more."""
    _routed_only(subject)
    prompt, expert = subject.prompts[3], 1

    def edit(model):
        model.layers[0].mlp.mlp_router_logits[:, :, expert] += 4.0

    def boost(logits):
        logits = logits.clone()
        logits[:, :, expert] += 4.0
        return logits

    want = subject.edited(prompt, router_edits={0: boost})
    check_edit(subject, "router: logit += 4", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_router_logits_ban_experts_with_minus_inf(subject):
    """Ban experts at block 1 by writing -inf into their logits (each token's favourite, and the last token's
    favourite for every token: a token keeps top-k finite logits or more): the softmax gives them weight 0 and
    the top-k picks among the others, on both engines alike. NaN, +inf, or a token left with fewer than top-k
    finite logits is refused in the block (InvalidWrite, naming the value) and the engine goes on serving."""
    _routed_only(subject)
    prompt, later = subject.prompts[2], subject.prompts[1]
    experts = subject.expected(1)["values"]["mlp_router_logits"][0].shape[-1]
    per_token = subject.reference.config.num_experts_per_tok

    def ban(logits):  # [1, tokens, experts]
        banned = logits.scatter(-1, logits.argmax(-1, keepdim=True), -torch.inf)
        banned[:, :, logits[0, -1].argmax()] = -torch.inf
        return banned

    def edit(model):
        model.layers[1].mlp.mlp_router_logits = ban(model.layers[1].mlp.mlp_router_logits)

    baseline, later_baseline = logits_of(subject.model, prompt), logits_of(subject.model, later)
    want = subject.edited(prompt, router_edits={1: ban})
    check_edit(subject, "router: experts banned with -inf", logits_of(subject.model, prompt, edit), want, baseline)

    def nan(model):
        model.layers[1].mlp.mlp_router_logits[:, 0, 0] = float("nan")

    def plus_inf(model):
        logits = model.layers[1].mlp.mlp_router_logits.clone()
        logits[:, -1, 0] = torch.inf
        model.layers[1].mlp.mlp_router_logits = logits

    def too_few(model):  # token 0 keeps top-k - 1 finite logits
        model.layers[1].mlp.mlp_router_logits[:, 0, : experts - per_token + 1] = -torch.inf

    refusals = (
        (nan, "mlp_router_logits: the written value has NaN entries"),
        (plus_inf, r"mlp_router_logits: the written value has \+inf entries"),
        (too_few, f"mlp_router_logits: token 0 keeps {per_token - 1} of its {experts} entries finite"),
    )
    for refused, match in refusals:
        with pytest.raises(vlenvoys.InvalidWrite, match=match):
            logits_of(subject.model, prompt, refused)
    assert torch.equal(logits_of(subject.model, prompt), baseline)
    assert torch.equal(logits_of(subject.model, later), later_baseline)


def _routes_served(subject) -> None:
    _routed_only(subject)
    if not vlenvoys.support(subject.model)["mlp", "mlp_router_experts"].available:
        pytest.skip("vLLM's experts' kernel routes inside itself here (FUSED_ROUTING): no routing to edit")


def test_router_weights_edit(subject):
    """Swap the weights of each token's experts at block 1 (its favourite gets the least weight), by assignment:
    both engines' experts' outputs are summed with the new weights alike."""
    _routes_served(subject)
    prompt = subject.prompts[2]

    def swap(weights, experts):
        return weights.flip(-1), experts

    def edit(model):
        model.layers[1].mlp.mlp_router_weights = model.layers[1].mlp.mlp_router_weights.flip(-1)

    want = subject.edited(prompt, route_edits={1: swap})
    check_edit(subject, "router: weights swapped", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_router_experts_edit(subject):
    """Send each token's favourite expert's share at block 0 to the lowest-numbered expert it was not routed
    to, in place: both engines route alike. An index outside the experts, or one repeated, is refused in the
    block (InvalidWrite) and the engine goes on."""
    _routes_served(subject)
    prompt = subject.prompts[3]
    count = subject.expected(1)["values"]["mlp_router_logits"][0].shape[-1]

    def spare(experts):  # each token's lowest-numbered expert not among its choices
        taken = torch.zeros(*experts.shape[:-1], count, dtype=torch.bool, device=experts.device)
        return (~taken.scatter(-1, experts, True)).to(torch.int8).argmax(-1)

    def reroute(weights, experts):
        experts = experts.clone()
        experts[..., 0] = spare(experts)
        return weights, experts

    def edit(model):
        experts = model.layers[0].mlp.mlp_router_experts
        taken = torch.zeros(*experts.shape[:-1], count, dtype=torch.bool, device=experts.device)
        experts[..., 0] = (~taken.scatter(-1, experts, True)).to(torch.int8).argmax(-1)

    baseline = logits_of(subject.model, prompt)
    want = subject.edited(prompt, route_edits={0: reroute})
    check_edit(subject, "router: favourite expert replaced", logits_of(subject.model, prompt, edit), want, baseline)

    def outside(model):
        model.layers[0].mlp.mlp_router_experts[..., 0] = count

    def repeated(model):
        experts = model.layers[0].mlp.mlp_router_experts
        experts[..., 1] = experts[..., 0]

    with pytest.raises(vlenvoys.InvalidWrite, match=rf"expert indices must lie in \[0, {count}\)"):
        logits_of(subject.model, prompt, outside)
    with pytest.raises(vlenvoys.InvalidWrite, match="must be distinct"):
        logits_of(subject.model, prompt, repeated)
    assert torch.equal(logits_of(subject.model, prompt), baseline)


def test_collect_router_choice_equals_a_trace(subject):
    """`vlenvoys.collect` reads each token's experts and weights, one hook per step, as a trace does."""
    _routes_served(subject)
    layers = [0, subject.model.num_layers - 1]
    for value in ("mlp_router_experts", "mlp_router_weights"):
        assert_collect_equals_a_trace(subject, subject.prompts[:2], "mlp", value, layers, same_dtype=True)


def greedy_steps(model, ids: list[int], steps: int, steering=None) -> list[tuple[int, float]]:
    """``steps`` greedy tokens after ``ids`` from `vlenvoys.generate` (optionally steered): each step's (token id, log-probability)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=1)
    (output,) = vlenvoys.generate(model, [ids], params, steering=steering)
    done = output.outputs[0]
    return [(token, step[token].logprob) for token, step in zip(done.token_ids, done.logprobs, strict=True)]


def same_steps(got: list[tuple[int, float]], want: list[tuple[int, float]], name: str, what: str) -> bool:
    """Whether two runs' steps agree: the same tokens, and log-probabilities bit-identical on the CPU engine or,
    on a GPU (whose kernels tile by the step's shape), within `TOLERANCE` relative, recorded as ``what`` under ``name``."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() or got == want:
        return got == want
    if [token for token, _ in got] != [token for token, _ in want]:
        return False
    difference = max(abs(a - b) / max(1.0, abs(b)) for (_, a), (_, b) in zip(got, want, strict=True))
    record(name, f"{what} (relative)", difference)
    return difference <= TOLERANCE
