"""What vlenvoys tells a user whose nnsight habits fall into vLLM's traps, and what it keeps quiet (#49); no engine."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import vlenvoys
from vlenvoys.values.envoys import Layer, Mlp


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Linear(2, 2)


def test_a_misspelt_value_name_names_the_standard_name_it_is_close_to():
    block = Layer(Block())
    with pytest.raises(AttributeError, match=r"'layer_ouput'.*did you mean 'layer_output'\?"):
        getattr(block, "layer_ouput")
    with pytest.raises(AttributeError, match=r"did you mean 'mlp_neurons'\?"):
        getattr(Mlp(torch.nn.Linear(2, 2)), "mlp_neuron")
    # A standard value asked of the wrong envoy: where it is served.
    served = r"'mlp_output' is served by the block's mlp: model\.layers\[i\]\.mlp\.mlp_output"
    with pytest.raises(AttributeError, match=served):
        getattr(block, "mlp_output")
    with pytest.raises(AttributeError, match=r"'layer_output' is served by the block: model\.layers\[i\]\.layer_outp"):
        getattr(Mlp(torch.nn.Linear(2, 2)), "layer_output")
    # Nothing close: nnsight's message alone; private names are looked up as before (hasattr stays cheap).
    with pytest.raises(AttributeError) as raised:
        getattr(block, "something_else")
    assert "did you mean" not in str(raised.value)
    assert not hasattr(block, "_persistent_id")
    assert block.mlp is not None  # children still resolve


def test_vllms_info_log_is_quiet_unless_asked_and_the_users_level_is_kept(monkeypatch):
    import os

    from vlenvoys.engine import logs

    logger = logging.getLogger("vllm")
    monkeypatch.setattr(logger, "level", logger.level)  # each restored afterwards
    monkeypatch.setattr(logs, "_set", None)
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    vllm_logging = logs.vllm_logging
    vllm_logging()  # quiet at first
    assert logger.level == logging.WARNING
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING", "the engine's processes inherit it"
    vllm_logging(verbose=True)  # a later load(verbose=True) undoes what an earlier one set
    assert logger.level == logging.INFO and os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    vllm_logging()  # load()'s default keeps the choice made before (the command's --verbose)
    assert logger.level == logging.INFO and os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "debug")  # the user's own choice wins either way
    vllm_logging(verbose=False)
    assert logger.level == logging.DEBUG and os.environ["VLLM_LOGGING_LEVEL"] == "debug"


def test_raw_output_warning_is_a_user_warning_of_its_own():
    assert issubclass(vlenvoys.RawOutputWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vlenvoys.RawOutputWarning)  # the way to silence it, as its message says


def test_a_misspelt_name_on_the_model_names_the_one_it_is_close_to():
    """The model's own names first (nnterp's ``layers_output``), then a block's value asked of the model."""
    from vlenvoys.engine.model import StandardizedVLLM

    model = StandardizedVLLM.__new__(StandardizedVLLM)  # no engine: only the lookup's miss is exercised
    model.__dict__["_module"] = torch.nn.Module()
    with pytest.raises(AttributeError, match=r"did you mean 'layers_output'\?"):
        getattr(model, "layers_ouput")
    with pytest.raises(AttributeError, match=r"'layer_output' is served by the block: model\.layers\[i\]\.layer_outp"):
        getattr(model, "layer_output")


def with_block(source: str):
    """The ``with`` statement of ``source``, as nnsight captures a trace's block."""
    import ast
    import textwrap

    return ast.parse(textwrap.dedent(source)).body[0]


def test_a_trace_steps_through_its_generation_only_through_the_tracer():
    from vlenvoys.engine.traces import steps_through

    assert steps_through(with_block("""
        with model.trace(prompt) as tracer:
            for _ in tracer.iter[0:3]:
                model.logits.save()
    """))
    assert steps_through(with_block("""
        with model.trace() as t:
            with t.invoke(prompt):
                for _ in t.all():
                    model.logits.save()
    """))
    # A tensor's .all() is no step; nor is a trace without a loop.
    assert not steps_through(with_block("""
        with model.trace(prompt) as tracer:
            finite = model.layers[0].layer_output.isfinite().all().save()
            logits = model.logits.save()
    """))


def test_raw_reads_are_a_blocks_output_and_inputs_not_a_sublayers():
    from vlenvoys.engine.traces import raw_reads

    block = with_block("""
        with model.trace(prompt):
            hidden = model.layers[3].output[0].save()
            mlp = model.layers[3].mlp.output.save()
            own = model.model.h[-1].output
            model.layers[0].output = hidden
            positions = model.layers[1].input.save()
            everything = model.layers[1].inputs.save()
            attention = model.layers[1].self_attn.input.save()
    """)
    reads = raw_reads(block, {"layers", "h"})
    assert [(each.lineno, each.attr) for each in reads] == [(3, "output"), (5, "output"), (6, "output"), (7, "input"),
                                                            (8, "inputs")]
    assert raw_reads(block, {"blocks"}) == []
