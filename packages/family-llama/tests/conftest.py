"""One vLLM engine per model for the whole session, beside the transformers model with the same weights."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from vlenvoys import oracle, testing, weights

#: Tiny random models, one per declared architecture (name: architecture, config
#: overrides), and the real SmolLM2. The windowed Mistral slides a 4-token window
#: over prompts of up to 24 tokens.
MODELS = {
    "LlamaForCausalLM": ("LlamaForCausalLM", {}),
    "MistralForCausalLM-window4": ("MistralForCausalLM", {"sliding_window": 4}),
    "Qwen2ForCausalLM": ("Qwen2ForCausalLM", {}),
    "Qwen3ForCausalLM": ("Qwen3ForCausalLM", {}),
    "Qwen2MoeForCausalLM": ("Qwen2MoeForCausalLM", {}),
    "MixtralForCausalLM": ("MixtralForCausalLM", {}),
    "SmolLM2": (None, {}),
}
REAL_PROMPTS = (
    "The Eiffel Tower is located in the city of",
    "def fibonacci(n):",
    "Once upon a time, a small fox found a golden key under the old oak tree and",
    "Water boils at",
)


@dataclass
class Subject:
    """A model served by vLLM and the same weights on transformers."""

    name: str
    model: object
    reference: torch.nn.Module
    prompts: list[list[int]]
    cache: dict = field(default_factory=dict)

    @property
    def routed(self) -> bool:
        """Whether the model's MLPs are mixtures of experts."""
        return self.model.architecture.mlp.KIND == "routed"

    def expected(self, index: int) -> dict:
        """transformers' values for prompt ``index``, computed once."""
        if index not in self.cache:
            self.cache[index] = oracle.reference(self.reference, self.prompts[index])
        return self.cache[index]


@pytest.fixture(scope="session", params=list(MODELS))
def subject(request, tmp_path_factory):
    from transformers import AutoTokenizer

    name = request.param
    architecture, overrides = MODELS[name]
    if architecture is None:
        path, texts = weights.smollm2_path(), REAL_PROMPTS
    else:
        path, texts = testing.tiny_model(architecture, tmp_path_factory.mktemp(name), **overrides), testing.PROMPTS
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    reference = oracle.load_reference(path)
    with oracle.engine(str(path)) as model:
        yield Subject(name, model, reference, prompts)


#: The largest difference to transformers seen per model and value, for the summary.
DIFFERENCES: dict[tuple[str, str], float] = {}


def record(model: str, value: str, difference: float) -> None:
    DIFFERENCES[(model, value)] = max(difference, DIFFERENCES.get((model, value), 0.0))


def pytest_terminal_summary(terminalreporter):
    if not DIFFERENCES:
        return
    terminalreporter.section("largest |vLLM - transformers| (float32)")
    for (model, value), difference in sorted(DIFFERENCES.items()):
        terminalreporter.write_line(f"{model:20s} {value:24s} {difference:.3g}")
