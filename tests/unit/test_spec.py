"""The one spec grammar and the registries (isthmus.spec), and the declared settings
(isthmus.settings): pure, no torch needed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import pytest

from isthmus.settings import Checked, check_keys, setting
from isthmus.spec import (
    Registry,
    SpecError,
    coerce,
    config_from,
    format_spec,
    parse,
    parse_assignment,
)


def test_parse_parts_positional_named_and_at() -> None:
    parts = parse(" TopK : 0.01 + EF21 ")
    assert [p.name for p in parts] == ["topk", "ef21"]
    assert parts[0].positional == ("0.01",)
    assert parts[1].positional == () and dict(parts[1].named) == {}
    (p,) = parse("kill@collective:step=20")
    assert (p.name, p.at, dict(p.named)) == ("kill", "collective", {"step": "20"})
    (p,) = parse("late-heavy:start-every=8,Shape=Linear")
    assert p.name == "late_heavy"
    assert dict(p.named) == {"start_every": "8", "shape": "Linear"}  # values keep their case


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "non-empty"),
        ("a++b", "empty part"),
        ("a:1,,2", "empty argument"),
        ("a:k=1,k=2", "given twice"),
        ("a:k=1,2", "after named"),
        ("a@", "nothing after '@'"),
        (":x=1", "no name"),
        ("a:=1", "no key"),
    ],
)
def test_parse_errors_say_what(text: str, problem: str) -> None:
    with pytest.raises(SpecError, match=problem):
        parse(text)


def test_coerce_through_type_hints() -> None:
    assert coerce("3", int) == 3 and coerce(3.0, int) == 3
    assert coerce("0.5", float) == 0.5 and coerce(2, float) == 2.0
    assert coerce("on", bool) is True and coerce("0", bool) is False and coerce(1, bool) is True
    assert coerce("none", int | None) is None and coerce("4", int | None) == 4
    assert coerce("Linear", Literal["linear", "geometric"]) == "linear"
    assert coerce("1|2", tuple[int, ...]) == (1, 2)
    assert coerce([1, "2"], list[float]) == [1.0, 2.0]
    with pytest.raises(SpecError, match="must be an integer"):
        coerce("1.5", int, key="k")
    with pytest.raises(SpecError, match="must be an integer"):
        coerce(True, int)
    with pytest.raises(SpecError, match="must be a number"):
        coerce("nan", float)
    with pytest.raises(SpecError, match="true or false"):
        coerce("maybe", bool)
    with pytest.raises(SpecError, match="did you mean 'linear'"):
        coerce("liner", Literal["linear", "geometric"])


@dataclass(kw_only=True)
class _Cfg:
    ratio: float = 0.1
    rounds: int = 1
    mode: Literal["a", "b"] = "a"
    lam: float = 0.0
    _internal: int = 0
    built: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")


def test_config_from_coerces_and_names_bad_keys() -> None:
    c = config_from(
        _Cfg, {"ratio": "0.5", "rounds": "3", "mode": "B", "lambda": 2}, aliases={"lambda": "lam"}
    )
    assert (c.ratio, c.rounds, c.mode, c.lam) == (0.5, 3, "b", 2.0)
    with pytest.raises(
        SpecError,
        match=r"unknown option 'ratoi'.*did you mean 'ratio'.*valid: ratio, rounds, mode, lam",
    ):
        config_from(_Cfg, {"ratoi": 1})
    with pytest.raises(SpecError, match="built"):  # init=False fields are not options
        config_from(_Cfg, {"built": 1})
    with pytest.raises(SpecError, match=r"rounds: must be an integer"):
        config_from(_Cfg, {"rounds": "x"})
    with pytest.raises(SpecError, match=r"_Cfg: ratio must be in \(0, 1\]"):
        config_from(_Cfg, {"ratio": 2})


def _registry() -> Registry[str]:
    r: Registry[str] = Registry("widget")
    r.add(
        "topk",
        config=_Cfg,
        build=lambda c, **kw: f"topk {c.ratio} {kw}",
        positional=("ratio",),
        aliases=("top_k",),
    )
    r.add("none", build=lambda **kw: "none")
    return r


def test_registry_resolves_builds_and_suggests() -> None:
    r = _registry()
    entry, cfg = r.resolve("top-k:0.25,rounds=2")
    assert entry.name == "topk" and (cfg.ratio, cfg.rounds) == (0.25, 2)
    assert r.build("topk:0.5", world=2) == "topk 0.5 {'world': 2}"
    assert r.build("none") == "none"
    assert "TOPK" in r and "top_k" in r and "topq" not in r
    assert r.names() == ["topk", "none"]
    with pytest.raises(
        SpecError,
        match=r"unknown widget 'topq' \(did you mean 'topk'\?\); choose one of topk, none",
    ):
        r.resolve("topq:0.1")
    with pytest.raises(SpecError, match="at most 1"):
        r.resolve("topk:0.1,0.2")
    with pytest.raises(SpecError, match="takes no options"):
        r.resolve("none:x=1")
    with pytest.raises(SpecError, match=r"'topk:0\.1,ratio=0\.2'.*given twice"):
        r.resolve("topk:0.1,ratio=0.2")
    with pytest.raises(SpecError, match="expected one widget"):
        r.resolve("topk+none")
    with pytest.raises(ValueError, match="registered twice"):
        r.add("top_k")


def test_errors_carry_a_key_path() -> None:
    err = SpecError("must be a number, got 'x'", key="outer_lr").within("strategy.options")
    assert str(err) == "strategy.options.outer_lr: must be a number, got 'x'"
    assert str(SpecError("bad", spec="int9")) == "'int9': bad"


def test_assignment_and_format() -> None:
    assert parse_assignment("Outer-LR = 0.5") == ("outer_lr", "0.5")
    with pytest.raises(SpecError, match="KEY=VALUE"):
        parse_assignment("outer_lr")
    assert format_spec("alie") == "alie"
    assert format_spec("alie", {"tau": 1.5, "seeded": True}) == "alie:tau=1.5,seeded=true"


def test_declared_settings_are_checked_by_one_function() -> None:
    @dataclasses.dataclass(kw_only=True)
    class _Sec(Checked):
        SECTION = "sec"

        n: int = setting(1, ge=1, help="A count.")
        x: float = setting(0.5, gt=0, help="A rate.")
        y: float | None = setting(None, ge=0, help="An optional bound.")
        mode: Literal["a", "b"] = setting("a", help="A choice.")

    assert dataclasses.fields(_Sec)[0].metadata["help"] == "A count."
    _Sec(n=3, x=1e-9, y=0.0, mode="b")
    with pytest.raises(SpecError, match=r"^sec.n: must be an integer >= 1, got 0$"):
        _Sec(n=0)
    with pytest.raises(SpecError, match=r"^sec.n: must be an integer >= 1, got True$"):
        _Sec(n=True)
    with pytest.raises(SpecError, match=r"^sec.x: must be a positive number, got 0$"):
        _Sec(x=0)
    with pytest.raises(SpecError, match=r"^sec.x: must be a positive number, got nan$"):
        _Sec(x=float("nan"))
    with pytest.raises(SpecError, match=r"^sec.y: must be a number >= 0, got -1$"):
        _Sec(y=-1)
    with pytest.raises(SpecError, match=r"^sec.mode: must be one of 'a', 'b', got 'c'"):
        _Sec(mode="c")  # type: ignore[arg-type]


def test_strict_coercion_takes_typed_values_only() -> None:
    assert coerce("8", int) == 8 and coerce(8.0, int) == 8 and coerce(1, bool) is True
    with pytest.raises(SpecError, match=r"k: must be an integer, got '8'"):
        coerce("8", int, key="k", strict=True)
    with pytest.raises(SpecError, match=r"must be an integer, got 8\.0"):
        coerce(8.0, int, strict=True)
    with pytest.raises(SpecError, match="must be true or false, got 1"):
        coerce(1, bool, strict=True)
    with pytest.raises(SpecError, match="must be finite"):
        coerce(float("inf"), float, strict=True)
    assert coerce(3, float, strict=True) == 3.0 and coerce(None, int | None, strict=True) is None
    assert coerce("none", str | None, strict=True) == "none"


def test_a_file_error_names_the_file_first() -> None:
    err = SpecError("must be an integer", key="batch_size").within("data", "run.toml")
    assert str(err) == "run.toml: data.batch_size: must be an integer"
    assert SpecError("x", key="[2].peer").within("churn").key == "churn[2].peer"
    assert str(check_error(lambda: check_keys({"stpes": 1}, "run", ["steps"]))) == (
        "run.stpes: unknown key (did you mean 'steps'?); known keys: steps"
    )


def check_error(fn: Callable[[], object]) -> SpecError:
    with pytest.raises(SpecError) as info:
        fn()
    return info.value
