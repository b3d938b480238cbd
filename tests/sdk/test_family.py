"""dspark.sdk.family: the one decoder definition's requirements and the reasons ops decline."""

from __future__ import annotations

import dataclasses

import pytest

from dspark.sdk.family import VARIANTS, decline, requirements
from dspark.testing import decoder_spec, tiny_checkpoint


@pytest.fixture(scope="module")
def specs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("families")
    return {v: decoder_spec(tiny_checkpoint(root / v, v)) for v in ("llama", "gemma2", "phi4_mini", "smollm3")}


def test_a_plain_llama_needs_no_variant(specs: dict) -> None:
    assert requirements(specs["llama"]) == {}
    assert decline(specs["llama"], frozenset()) is None


def test_each_family_names_the_variants_it_needs(specs: dict) -> None:
    assert set(requirements(specs["gemma2"])) == {"activation.gelu_tanh", "attention.window", "attention.softcap",
                                                  "softcap"}
    assert set(requirements(specs["phi4_mini"])) == {"rope.partial"}
    assert set(requirements(specs["smollm3"])) == {"attention.window"}
    assert set().union(*(requirements(s) for s in specs.values())) <= set(VARIANTS)


def test_ops_lacking_a_variant_decline_naming_it_and_what_needs_it(specs: dict) -> None:
    why = decline(specs["gemma2"], frozenset(VARIANTS) - {"attention.softcap"})
    assert why is not None and "attention.softcap" in why and "soft-cap 2.0" in why, why
    assert "attention.window" not in why
    stored = dataclasses.replace(specs["llama"], features=specs["llama"].features | {"gguf_stored"})
    assert decline(stored, frozenset(VARIANTS)) is None  # ops holding a GGUF file's blocks run it as stored
    why = decline(stored, frozenset(VARIANTS) - {"linear.blocks"})
    assert why is not None and "linear.blocks" in why and "gguf_stored" in why, why


def test_gemma_spells_out_its_scales_norms_and_tables(specs: dict) -> None:
    g = specs["gemma2"]
    assert g.embed_scale == pytest.approx(64 ** 0.5) and g.attn_scale == pytest.approx(24 ** -0.5)
    assert g.windows == (8, None, 8) and g.attn_softcap == 2.0 and g.final_softcap == 3.0
    w = g.weights().layers[0]
    assert w.attn_out_norm is not None and w.mlp_out_norm is not None
    s = specs["smollm3"]
    assert [s.rope_of(i) for i in range(4)] == [0, None, 0, None]
    assert specs["phi4_mini"].rotary == 12 and specs["phi4_mini"].rope_at(0, 5)[0].shape == (5, 12)
