"""Declarations core offers families: parallel blocks and declarations chosen by the config (no engine)."""

from __future__ import annotations

import pytest

import vlenvoys
from vlenvoys import Architecture, ByConfig, Layer, ParallelLayer, TransformersLayer


class Sequential(Layer):
    MID = "source.hidden_states_1.output"


class Parallel(ParallelLayer):
    pass


class ParallelOnTransformers(ParallelLayer, TransformersLayer):
    pass


def test_a_parallel_block_refuses_layer_mid_by_name():
    assert Parallel.unavailable("layer_mid") == vlenvoys.PARALLEL
    assert ParallelOnTransformers.unavailable("layer_mid") == vlenvoys.PARALLEL
    assert Sequential.unavailable("layer_mid") is None
    # A block that declares no mid stream without being parallel gets the other reason.
    assert "declares no place" in Layer.unavailable("layer_mid")
    for value in ("layer_input", "attention_norm_output", "mlp_norm_output", "layer_output"):
        assert Parallel.unavailable(value) is None, value


def test_a_parallel_block_reads_the_mlp_norm_output_at_the_mlps_call():
    """After the attention's values in forward order, though one norm may feed both sublayers (GPT-J)."""
    assert Parallel.PARALLEL and not Sequential.PARALLEL
    assert Parallel.mlp_norm_output.located_key(Parallel) == "mlp.input"
    assert Sequential.mlp_norm_output.located_key(Sequential) == "post_attention_layernorm.output"
    # On the transformers backend the MLP's input carries the batch axis as the other values do.
    assert ParallelOnTransformers.BATCHED and ParallelOnTransformers.STREAM == (0, "hidden_states")


PARALLEL = Architecture(layer=Parallel)
SEQUENTIAL = Architecture(layer=Sequential)
CHOICE = ByConfig("use_parallel_residual", {True: PARALLEL, False: SEQUENTIAL}, default=True)


class Config:
    def __init__(self, **settings):
        self.__dict__.update(settings)


@pytest.mark.parametrize(
    "config, chosen",
    [
        ({"use_parallel_residual": False}, SEQUENTIAL),
        ({"use_parallel_residual": True}, PARALLEL),
        ({}, PARALLEL),  # the config class's default
        (Config(use_parallel_residual=False), SEQUENTIAL),
        (Config(), PARALLEL),
    ],
)
def test_by_config_chooses_by_the_attribute_of_a_dict_or_a_config(config, chosen):
    assert CHOICE.choose(config) is chosen


def test_by_config_refuses_a_value_it_does_not_declare():
    with pytest.raises(vlenvoys.UnknownArchitecture, match=r"use_parallel_residual has 'yes'.*True, False"):
        CHOICE.choose({"use_parallel_residual": "yes"})
    strict = ByConfig("use_parallel_residual", {True: PARALLEL})
    with pytest.raises(vlenvoys.UnknownArchitecture, match="has no value"):
        strict.choose({})
