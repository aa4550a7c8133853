"""Every compressor in one process: the spec grammar and its registry, state that refuses another
compressor's, and the payload-size helper."""

from __future__ import annotations

import pytest

from isthmus.reduce.compress import (
    COMPRESSOR_NAMES,
    make_compressor,
    payload_bytes,
)
from support.compress import SPECS


def test_every_base_name_is_covered():
    assert {s.split(":")[0].split("+")[0] for s in SPECS} == set(COMPRESSOR_NAMES)


def test_load_state_dict_refuses_another_compressor():
    with pytest.raises(ValueError, match="topk"):
        make_compressor("sign").load_state_dict(make_compressor("topk:0.1+ef").state_dict())


@pytest.mark.parametrize("spec", SPECS)
def test_spec_names_round_trip(spec):
    c = make_compressor(spec)
    assert make_compressor(c.name).name == c.name


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("zstd", "unknown compression 'zstd'"),
        ("int8:blok=3", "unknown option"),
        ("topk", "needs a ratio"),
        ("topk:1.5", "ratio must be in"),
        ("topk:0.1+ef3", "unknown feedback"),
        ("int4+ef", "applies to topk and randk only"),
        ("powersgd:rank=two", "rank: 'powersgd:rank=two': must be an integer"),
        ("int4:block=7", "even"),
        ("sketch:0.1,k=0.2", "option 'k' given twice"),
        ("topk:0.1+ef21:eta=0.1", "ef21 takes no options"),
        ("int8:blok=3", r"unknown option 'blok' for int8 \(did you mean 'block'\?\); valid: block"),
        ("powersgd:min_rat=2", r"did you mean 'min_rate'\?"),
        ("topk:0.1+ef3", r"unknown feedback 'ef3' \(did you mean 'ef'\?\)"),
        ("topk:0.1,0.2", "write '0.2' as KEY=VALUE"),
        ("randk:0.1+ef+ef21", "one error feedback"),
        ("sign:server_error=maybe", "server_error: .* must be true or false"),
        ("", "non-empty"),
    ],
)
def test_spec_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        make_compressor(spec)


def test_spec_is_case_and_space_insensitive():
    assert make_compressor(" TopK: 0.01 + EF21 ").name == "topk:0.01+ef21"
    assert make_compressor("powersgd:seeds=TORCH").name == "powersgd:rank=1,seeds=torch"


def test_registry_entries_are_the_options_dataclasses():
    from isthmus.reduce.compress import COMPRESSORS, ERROR_FEEDBACKS, QuantConfig, TopKConfig

    assert COMPRESSORS.names()[:2] == ["none", "uint8"]
    entry, config = COMPRESSORS.resolve("int4:block=64")
    assert entry.config_cls is QuantConfig and config == QuantConfig(block=64)
    _, config = COMPRESSORS.resolve("topk:ratio=0.5")
    assert config == TopKConfig(ratio=0.5)
    _, config = COMPRESSORS.resolve("powersgd:warm=off,min_rate=3")
    assert (config.warm_start, config.min_compression_rate) == (False, 3.0)
    assert ERROR_FEEDBACKS.names() == ["ef", "ef21", "econtrol"]
    assert make_compressor("randk:0.5,seed=3+econtrol:eta=0.1").name == (
        "randk:0.5,seed=3+econtrol:eta=0.1"
    )


def test_payload_bytes_helper_compares_formats():
    d, world = 1 << 20, 4
    dense = payload_bytes("none", d, world)
    assert dense == 2 * 3 * d * 4 // 4
    assert payload_bytes("int8", d, world) < dense / 3.5
    assert payload_bytes("int4", d, world) < dense / 7
    assert payload_bytes("sign", d, world) < dense / 25
    assert payload_bytes("topk:0.01", d, world) == 3 * 8 * 10486
    assert payload_bytes("powersgd:rank=4", (1024, 1024), world) < dense / 50


def test_a_compressor_that_reduces_nothing_is_refused_when_defined():
    from isthmus.reduce.compress import Compressor

    with pytest.raises(TypeError, match="must define _reduce_one or _reduce_many"):

        class Nothing(Compressor):  # neither reduction: each would call the other forever
            def predict_bytes(self, shape, world):
                return 0
