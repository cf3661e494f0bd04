"""The oracle suite on EXAONE 3 (``ExaoneForCausalLM``), against a reference computed from its weights.

transformers has no EXAONE 3 class, and EXAONE 3 checkpoints bring their config
class as remote code (model_type ``exaone``), which vLLM refuses without
``trust_remote_code``. Its computation is Llama's (RMSNorm, rotary, SwiGLU,
grouped-query attention) under other names, so the reference is a tiny
transformers Llama, and the checkpoint vLLM runs holds that model's weights under
EXAONE 3's names with a plain Llama config naming ``ExaoneForCausalLM`` and
adding the attribute names vLLM's EXAONE 3 reads.
"""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

import vlenvoys
import vlenvoys_testing as testing
from vlenvoys_testing import conformance, oracle
from vlenvoys_testing.conformance import *  # noqa: F403  (the suite's tests, collected here)
from vlenvoys_testing.conformance import close

#: transformers Llama weight names -> EXAONE 3's.
NAMES = (
    (r"^model\.embed_tokens\.", "transformer.wte."),
    (r"^model\.norm\.", "transformer.ln_f."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"transformer.h.\1.ln_1."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"transformer.h.\1.ln_2."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"transformer.h.\1.attn.attention.out_proj."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"transformer.h.\1.attn.attention."),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.", r"transformer.h.\1.mlp.c_fc_0."),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.", r"transformer.h.\1.mlp.c_fc_1."),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"transformer.h.\1.mlp.c_proj."),
)


def exaone3_name(name: str) -> str:
    for pattern, replacement in NAMES:
        renamed, count = re.subn(pattern, replacement, name)
        if count:
            return renamed
    return name  # lm_head


def exaone3_checkpoint(reference: torch.nn.Module, llama, target):
    """``reference``'s weights under EXAONE 3's names, with ``llama``'s tokenizer, in ``target``."""
    state = {exaone3_name(name): tensor.contiguous() for name, tensor in reference.state_dict().items()}
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((llama / "config.json").read_text())
    config |= {
        "architectures": ["ExaoneForCausalLM"],
        "activation_function": config["hidden_act"],
        "layer_norm_epsilon": config["rms_norm_eps"],
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(llama / name, target / name)
    return target


@pytest.fixture(scope="module")
def subject(tmp_path_factory):
    """This module's model: one engine, stopped when the module ends."""
    from transformers import AutoTokenizer

    llama = testing.tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), seed=2)
    reference = oracle.load_reference(llama)
    # Norm weights away from 1, so that a norm read or written under the wrong name shows.
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.2 * torch.randn(parameter.shape, generator=generator))
    path = exaone3_checkpoint(reference, llama, tmp_path_factory.mktemp("exaone3"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(text)["input_ids"] for text in testing.PROMPTS]
    with oracle.engine(str(path)) as model:
        yield conformance.Subject("ExaoneForCausalLM", model, reference, prompts, oracle.LLAMA_LAYOUT)


def test_standard_names_reach_exaone3_modules(subject):
    model = subject.model
    assert model.family.name == "exaone"
    assert model.layers[1].self_attn.path == "model.transformer.h.1.attn.attention"
    assert model.layers[1].mlp.path == "model.transformer.h.1.mlp"
    assert model.ln_final.path == "model.transformer.ln_f"
    unavailable = {row.value for row in vlenvoys.support(model) if not row.available}
    routes = {"mlp_router_logits", "mlp_router_experts", "mlp_router_weights"}  # a dense MLP (NOT_ROUTED)
    assert unavailable == {"mlp_activation", *routes}


def test_logit_lens_matches_transformers(subject):
    """project_on_vocab with the final norm ln_f (called with the stream alone) and lm_head."""
    model, index = subject.model, 3
    with model.trace(subject.prompts[index], temperature=0.0):
        lens = list().save()
        for layer in model.layers:
            lens.append(model.project_on_vocab(layer.layer_output))
    reference = subject.reference
    with torch.no_grad():
        for layer, got in enumerate(lens):
            stream = subject.expected(index)["values"]["layer_output"][layer]
            assert close(subject, "logit lens", got, reference.lm_head(reference.model.norm(stream))), layer
