"""Every seconds option takes a finite number in its documented range (issue 29 §7).

On main, `--timeout nan` made reset and shutdown wait for ever, `--ready-timeout nan` never
gave up, and `--drain-timeout inf` or `--probe-timeout 1e20` ended in exit 70. The options
are found by walking the click command tree, so an option added later is covered without
touching this file: each must be of the one type (`cli.paramtypes.Seconds`), and each bad
value is a usage error (exit 2) on one line naming the option and the range.
"""

from __future__ import annotations

import math

import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st
from typer._click import types as click_types
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.cli.group import COMMANDS
from xpuctl.cli.paramtypes import Seconds
from xpuctl.parse.seconds import WEEK, Span, parse_seconds

runner = CliRunner()
BAD = ["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e308", "1e20", "-1", "-0.5", "0x10",
       "", " ", "1_0", " 5", "5s", "1,5", "٣", "1e", "."]


def _options() -> list[tuple[tuple[str, ...], object]]:
    """(command path, click option) of every option of the group and of every command."""
    group = typer.main.get_command(app)
    out = [((), p) for p in group.params]
    for name in COMMANDS:
        out += [((name,), p) for p in group.get_command(None, name).params]
    return out


OPTIONS = _options()
SECONDS = [(path, p) for path, p in OPTIONS if isinstance(p.type, Seconds)]
IDS = [f"{'/'.join(path) or 'xpuctl'}{p.opts[0]}" for path, p in SECONDS]


def _args(path: tuple[str, ...], opt: str, value: str) -> list[str]:
    """A command line whose only fault can be the value (serve needs its MODEL after it)."""
    cmd = path or ("doctor",)
    tail = ["MODEL"] if cmd == ("serve",) else []
    if not path:
        return [f"{opt}={value}", "doctor"]
    return [*cmd, f"{opt}={value}", *tail]


def test_every_number_option_with_seconds_is_of_the_one_type():
    assert len(SECONDS) >= 19  # the group's --read-timeout and every command's timeouts
    for path, p in OPTIONS:
        plain_float = (isinstance(p.type, click_types.FloatParamType)
                       and not isinstance(p.type, Seconds))
        looks_like_seconds = (p.metavar == "SECONDS" or "timeout" in p.name
                              or "seconds" in (p.help or "").lower())
        assert not plain_float, (path, p.opts, "a float option outside the seconds type")
        if looks_like_seconds and p.param_type_name == "option" and not p.is_flag:
            assert isinstance(p.type, Seconds), (path, p.opts)


@pytest.mark.parametrize("path,param", SECONDS, ids=IDS)
def test_bad_seconds_are_a_usage_error_naming_the_option_and_range(path, param):
    opt = param.opts[0]
    for value in BAD:
        result = runner.invoke(app, _args(path, opt, value))
        err = result.stderr
        assert result.exit_code == 2, (opt, value, result.exit_code, result.output)
        assert err.count("\n") == 1 and err.startswith("xpuctl: error:"), (opt, value, err)
        assert opt in err and param.type.span.describe() in err, (opt, value, err)
        assert "Traceback" not in result.output


@pytest.mark.parametrize("path,param", SECONDS, ids=IDS)
def test_help_shows_seconds_and_the_range(path, param):
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    line = next(x for x in result.stdout.splitlines() if x.strip().startswith(param.opts[0] + " "))
    assert f"{param.opts[0]} SECONDS" in line
    low = param.type.span
    assert f"{low.low:g}<{'' if low.low_open else '='}x<={low.high:g}" in result.stdout


def test_read_timeout_from_the_environment_goes_through_the_same_type():
    for value in ("nan", "inf", "0", "-1", "1e308"):
        result = runner.invoke(app, ["doctor", "--json"], env={"XPUCTL_READ_TIMEOUT": value})
        assert result.exit_code == 2, (value, result.output)
        assert "XPUCTL_READ_TIMEOUT" in result.stderr
        assert "above 0 and at most 3600" in result.stderr


def test_good_values_and_defaults():
    span = Span(0)
    for text, want in (("0", 0.0), ("1.5", 1.5), ("+2", 2.0), (".5", 0.5), ("3.", 3.0),
                       ("1e3", 1000.0), ("604800", WEEK)):
        assert parse_seconds(text, span) == want
    assert parse_seconds("0.1", Span(0, 1, low_open=True)) == 0.1
    with pytest.raises(ValueError, match="above 0 and at most 1"):
        parse_seconds("0", Span(0, 1, low_open=True))
    with pytest.raises(ValueError, match="from 0 to 604800"):
        parse_seconds("604800.5", span)
    for _, p in SECONDS:  # every default is within its own range
        assert p.default is None or p.type.span.holds(float(p.default)), p.opts


@given(st.text(max_size=30))
def test_parse_seconds_gives_a_finite_number_in_range_or_a_value_error(text):
    span = Span(0.5, 100.0)
    try:
        value = parse_seconds(text, span)
    except ValueError as exc:
        assert "from 0.5 to 100" in str(exc)
    else:
        assert math.isfinite(value) and 0.5 <= value <= 100.0
