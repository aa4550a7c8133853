"""What decoding and checking the coordinator's messages costs with the project's codec
(``isthmus.coordinator.wire``: ``json.loads`` and dataclasses), against msgspec and pydantic v2
describing the same messages, and against one HTTP round trip through aiohttp.

    python benchmarks/wire_codec.py [--tensors 100]

Messages: a heartbeat frame (a peer's usual ``info``), a begin with the hashes of ``--tensors``
shared tensors, a commit, and a go decision whose plan repairs one peer from another (every
tensor named, with its hash). Each figure is the best of 5 runs of 2,000 decodes of the raw
bytes into checked typed values, in microseconds per message. msgspec and pydantic are measured
when installed (``pip install msgspec pydantic`` into a throwaway venv, then run this script with
that venv's site-packages on PYTHONPATH), and left out otherwise. Pydantic runs in strict mode
(an int is not a bool, a string is not a number), as the project's codec does.
"""

# No ``from __future__ import annotations``: msgspec and pydantic resolve the annotations of the
# classes defined inside functions below, which they cannot do for strings.

import argparse
import asyncio
import json
import time
import timeit
from collections.abc import Callable
from typing import Any, Literal, Optional, Union

import aiohttp
from aiohttp import web

from isthmus.coordinator import protocol as p
from isthmus.coordinator.wire import decode


def messages(n: int) -> dict[str, dict[str, Any]]:
    hashes = {f"layers.{i}.weight": f"{i * 7919:016x}" for i in range(n)}
    info = {
        "revision": 1234,
        "bytes_sent": 123456789,
        "parked_groups": 0,
        "step": 5000,
        "loss": 3.21,
        "bytes_by_op": {"all_reduce": 1000, "all_gather": 2000, "send": 3, "exchange": 4},
        "timing": {"work_s": 0.5, "comm_s": 0.1, "rounds": 12},
    }
    plan = {
        "round": 1234,
        "epoch": 17,
        "members": [0, 1, 2, 3],
        "transfers": [{"src": 0, "dst": 3, "names": list(hashes)}],
        "expected": hashes,
        "new_epoch": True,
        "stale": [],
    }
    return {
        "heartbeat": {"type": "hb", "info": info},
        "begin": {
            "peer": 3,
            "run": "abcd1234",
            "nonce": "f" * 32,
            "revision": 1234,
            "hashes": hashes,
        },
        "commit": {
            "peer": 3,
            "run": "abcd1234",
            "epoch": 17,
            "round": 1234,
            "ok": True,
            "error": "",
        },
        "go": {"kind": "go", "reason": "", "plan": plan},
    }


STDLIB = {"heartbeat": p.Heartbeat, "begin": p.Begin, "commit": p.Commit, "go": p.Decision}


def msgspec_decoders() -> dict[str, Callable[[bytes], Any]] | None:
    try:
        import msgspec
    except ImportError:
        return None

    class Hb(msgspec.Struct, tag_field="type", tag="hb"):
        info: dict[str, Any] = {}

    class Begin(msgspec.Struct):
        peer: int
        nonce: str
        revision: int
        run: Optional[str] = None  # noqa: UP045 - msgspec reads the annotation at runtime
        hashes: Optional[dict[str, str]] = None  # noqa: UP045
        schema: Optional[list[tuple[str, list[int], str]]] = None  # noqa: UP045

    class Commit(msgspec.Struct):
        peer: int
        epoch: int
        round: int
        ok: bool
        run: Optional[str] = None  # noqa: UP045
        error: str = ""

    class Transfer(msgspec.Struct):
        src: int
        dst: int
        names: tuple[str, ...]

    class Plan(msgspec.Struct):
        round: int
        epoch: int
        members: tuple[int, ...]
        transfers: tuple[Transfer, ...]
        expected: dict[str, str]
        new_epoch: bool
        stale: tuple[int, ...] = ()

    class Go(msgspec.Struct, tag_field="kind", tag="go"):
        plan: Plan
        reason: str = ""

    class Wait(msgspec.Struct, tag_field="kind", tag="wait"):
        reason: str = ""

    decision = Union[Go, Wait]  # noqa: UP007
    types = {"heartbeat": Hb, "begin": Begin, "commit": Commit, "go": decision}
    return {k: msgspec.json.Decoder(t).decode for k, t in types.items()}


def pydantic_decoders() -> dict[str, Callable[[bytes], Any]] | None:
    try:
        import pydantic
    except ImportError:
        return None
    from typing import Annotated

    strict = pydantic.ConfigDict(strict=True, frozen=True)

    class Hb(pydantic.BaseModel):
        model_config = strict
        type: Literal["hb"]
        info: dict[str, Any] = {}

    class Begin(pydantic.BaseModel):
        model_config = strict
        peer: int
        nonce: str
        revision: int
        run: Optional[str] = None  # noqa: UP045
        hashes: Optional[dict[str, str]] = None  # noqa: UP045

    class Commit(pydantic.BaseModel):
        model_config = strict
        peer: int
        epoch: int
        round: int
        ok: bool
        run: Optional[str] = None  # noqa: UP045
        error: str = ""

    class Transfer(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(frozen=True)  # JSON lists into tuples: lax here
        src: pydantic.StrictInt
        dst: pydantic.StrictInt
        names: tuple[pydantic.StrictStr, ...]

    class Plan(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(frozen=True)
        round: pydantic.StrictInt
        epoch: pydantic.StrictInt
        members: tuple[pydantic.StrictInt, ...]
        transfers: tuple[Transfer, ...]
        expected: dict[str, pydantic.StrictStr]
        new_epoch: pydantic.StrictBool
        stale: tuple[pydantic.StrictInt, ...] = ()

    class Go(pydantic.BaseModel):
        model_config = strict
        kind: Literal["go"]
        plan: Plan
        reason: str = ""

    class Wait(pydantic.BaseModel):
        model_config = strict
        kind: Literal["wait"]
        reason: str = ""

    decision = pydantic.TypeAdapter(
        Annotated[Union[Go, Wait], pydantic.Field(discriminator="kind")]  # noqa: UP007
    )
    return {
        "heartbeat": Hb.model_validate_json,
        "begin": Begin.model_validate_json,
        "commit": Commit.model_validate_json,
        "go": decision.validate_json,
    }


def best_us(fn: Callable[[], Any], n: int = 2000) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def http_round_trip_us(body: dict[str, Any]) -> float:
    """One JSON POST and its JSON answer through aiohttp on localhost, best of 5 x 300."""

    async def main() -> float:
        async def handler(request: web.Request) -> web.Response:
            await request.json()
            return web.json_response({"kind": "committed", "reason": ""})

        app = web.Application()
        app.router.add_post("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        best = float("inf")
        async with aiohttp.ClientSession() as s:
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(300):
                    async with s.post(f"http://127.0.0.1:{port}/", json=body) as r:
                        await r.json()
                best = min(best, (time.perf_counter() - t0) / 300)
        await runner.cleanup()
        return best * 1e6

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=100)
    args = ap.parse_args()
    msgs = messages(args.tensors)
    raw = {k: json.dumps(v).encode() for k, v in msgs.items()}
    others = {"msgspec": msgspec_decoders(), "pydantic": pydantic_decoders()}
    cols = ["json.loads", "isthmus.wire"] + [k for k, v in others.items() if v is not None]
    print(f"| message | bytes | {' | '.join(cols)} |")
    print("|---|---:|" + "---:|" * len(cols))
    for k, body in raw.items():
        row = [
            best_us(lambda b=body: json.loads(b)),
            best_us(lambda b=body, t=STDLIB[k]: decode(t, json.loads(b))),
        ]
        for decoders in others.values():
            if decoders is not None:
                row.append(best_us(lambda b=body, d=decoders[k]: d(b)))
        print(f"| {k} | {len(body)} | " + " | ".join(f"{x:.1f}" for x in row) + " |")
    print(
        f"\naiohttp POST round trip (commit) on localhost: "
        f"{http_round_trip_us(msgs['commit']):.0f} us"
    )


if __name__ == "__main__":
    main()
