"""docs/configuration.md is generated from the config structs and must stay up to date."""

from pathlib import Path

import msgspec

from pipeline.config import ConveyorConfig, RolloutConfig
from pipeline.config_doc import field_comments, render, type_name

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_committed_configuration_doc_is_up_to_date():
    assert DOC.read_text() == render(), (
        "docs/configuration.md is stale: run `python -m pipeline.config_doc > docs/configuration.md`")


def test_every_section_and_key_is_documented():
    text = render()
    # Every top-level section is a heading, and a few keys chosen by hand appear as rows.
    for f in msgspec.structs.fields(ConveyorConfig):
        assert f"## `{f.name}" in text
    assert "| `max_staleness` | int >= 0 \\| \"auto\" | `1` |" in text
    assert "## `algorithm (name: ppo)`" in text


def test_type_names_carry_bounds_and_choices():
    hints = {f.name: f.type for f in msgspec.structs.fields(RolloutConfig)}
    # top_p is Probability = Annotated[float, Meta(gt=0, le=1)]; engine_core a Literal.
    assert type_name(hints["top_p"]) == "float > 0 <= 1"
    assert type_name(hints["engine_core"]) == '"auto" | "subprocess" | "in_process"'
    assert type_name(hints["max_model_len"]) == "int >= 1 | null"


def test_field_comments_read_the_line_above_and_the_line_end():
    comments = field_comments(RolloutConfig)
    # max_inflight has a trailing comment; kv_cache_gib four comment lines above it.
    assert comments["max_inflight"] == "micro-batches generating concurrently per worker"
    assert comments["kv_cache_gib"].startswith("The vLLM engine's KV cache in GiB")
    assert comments["n"] == ""
