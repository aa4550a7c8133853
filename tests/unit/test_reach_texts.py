"""Reading the remote and the kind of failure out of Gloo's error texts (the texts are the ones
torch 2.13's Gloo gave in the lab)."""

from __future__ import annotations

import pytest

from isthmus.comm.reach import gloo_failure, probe
from isthmus.coordinator.partition import How

GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (
            GLOO + "pair.cc:537] Read error [10.77.0.2]:55500: Connection reset by peer. This is "
            "typically caused by a remote worker hanging",
            ("10.77.0.2:55500", How.RESET),
        ),
        (
            GLOO + "pair.cc:553] Connection closed by peer [10.78.0.2]:30378. This",
            ("10.78.0.2:30378", How.RESET),
        ),
        (
            GLOO + "pair.cc:1] connect [10.0.0.9]:4000: Connection refused",
            ("10.0.0.9:4000", How.REFUSED),
        ),
        (
            GLOO + "pair.cc:1] Write error [fd00::2]:41234: timed out",
            ("fd00::2:41234", How.TIMED_OUT),
        ),
    ],
)
def test_gloo_texts_that_name_the_remote(text: str, want: tuple[str, How]) -> None:
    assert gloo_failure(text) == want


@pytest.mark.parametrize(
    "text",
    [
        "Gloo connectFullMesh failed with " + GLOO + "pair.h:311] Connect timeout [none]",
        GLOO + "unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation to complete",
        "all_reduce did not complete within 30.0s (a peer is silent or the link is too slow)",
        "",
    ],
)
def test_gloo_texts_that_name_nobody(text: str) -> None:
    assert gloo_failure(text) is None


@pytest.mark.parametrize("bad", ["10.0.0.1", "10.0.0.1:", ":80", "host:http"])
def test_a_malformed_probe_address_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        probe(bad)
