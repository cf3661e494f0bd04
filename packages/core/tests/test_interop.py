"""Our value names beside TransformerLens' and SAELens' (#49 item 4): the table in code, and docs/interop.md's copy of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from vlenvoys.values.names import OWNERS, TRANSFORMER_LENS, TRANSFORMER_LENS_NOTES, standard_name, transformer_lens_name

ROOT = Path(__file__).resolve().parents[3]


def names_table() -> str:
    """docs/interop.md's table, made from `TRANSFORMER_LENS` and its notes."""
    lines = ["| vlenvoys value | TransformerLens hook (SAELens' `hook_name`) | note |", "| --- | --- | --- |"]
    for value in OWNERS:
        hook = TRANSFORMER_LENS[value]
        lines.append(f"| `{value}` | {f'`{hook}`' if hook else 'none'} | {TRANSFORMER_LENS_NOTES.get(value, '')} |")
    return "\n".join(lines) + "\n"


def test_every_value_has_a_row_and_a_reason_where_it_has_no_hook():
    assert list(TRANSFORMER_LENS) == list(OWNERS)
    assert set(TRANSFORMER_LENS_NOTES) <= set(OWNERS)
    for value, hook in TRANSFORMER_LENS.items():
        assert hook is None and value in TRANSFORMER_LENS_NOTES or hook and hook.startswith("blocks.{layer}."), value


def test_the_docs_table_is_the_codes():
    docs = (ROOT / "docs" / "interop.md").read_text()
    assert names_table() in docs, f"docs/interop.md's table of names is not the code's; it should read:\n{names_table()}"


def test_names_go_both_ways():
    assert transformer_lens_name("layer_output", 3) == "blocks.3.hook_resid_post"
    assert transformer_lens_name("attention_head_outputs", 0) == "blocks.0.attn.hook_z"
    assert transformer_lens_name("mlp_neurons", 11) == "blocks.11.mlp.hook_post"
    for value, hook in TRANSFORMER_LENS.items():
        if hook is None:
            with pytest.raises(ValueError, match=f"TransformerLens has no hook holding {value}"):
                transformer_lens_name(value, 0)
            continue
        back, layer = standard_name(transformer_lens_name(value, 7))
        assert layer == 7 and TRANSFORMER_LENS[back] == hook, value
    # Several of ours share a hook where they are one tensor: the hook reads as the value that always exists.
    assert standard_name("blocks.2.attn.hook_z") == ("attention_head_outputs", 2)
    assert standard_name("blocks.2.mlp.hook_post") == ("mlp_neurons", 2)
    # A model without rotary embeddings (GPT-2) holds the queries and keys at hook_q and hook_k.
    assert standard_name("blocks.1.attn.hook_q") == ("attention_queries", 1)
    assert standard_name("blocks.1.attn.hook_k") == ("attention_keys", 1)
    for hook in ("hook_embed", "blocks.1.ln1.hook_normalized", "blocks.x.hook_resid_post", "ln_final.hook_normalized"):
        with pytest.raises(ValueError, match="is not a TransformerLens hook of a block value"):
            standard_name(hook)
    with pytest.raises(ValueError, match="'residual' is not a block value"):
        transformer_lens_name("residual", 0)
