"""One device-list parser for every command (issue 29 §13).

On main `serve --devices 0,,1` started vLLM on devices 0 and 1 while `doctor --device 0,,1`
refused the same list ("unknown device ''"). Now every device option of every command (found
by walking the click tree, so a new one is covered) is of one type, `paramtypes.DeviceList`
over `parse.devspec.split_devices`, refuses the same lists with the same line, and resolves
the devices through the same function, with the same "unknown device" line.
"""

from __future__ import annotations

import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.cli.group import COMMANDS
from xpuctl.cli.paramtypes import DeviceList
from xpuctl.parse.devspec import split_devices

runner = CliRunner()
BAD = {  # value: what the line says
    "0,,1": "has an empty item",
    ",0": "has an empty item",
    "0,": "has an empty item",
    " ": "has an empty item",
    "": "has an empty item",
    "0,0": "device '0' is named twice",
    "0, 0": "device '0' is named twice",
    "0;1": "is not a device",
    "0 1": "is not a device",
    "0\x1b[2J": "is not a device",
}


def _device_options() -> list[tuple[str, object]]:
    group = typer.main.get_command(app)
    out = []
    for name in COMMANDS:
        for p in group.get_command(None, name).params:
            if p.param_type_name == "option" and {"--device", "--devices", "-d"} & set(p.opts):
                out.append((name, p))
    return out


OPTIONS = _device_options()
IDS = [f"{name}{p.opts[0]}" for name, p in OPTIONS]


def _args(command: str, opt: str, value: str, *extra: str) -> list[str]:
    tail = ["MODEL"] if command == "serve" else []
    return [*extra, command, f"{opt}={value}", *tail]


def test_every_device_option_is_the_one_list_type():
    assert {name for name, _ in OPTIONS} == {"doctor", "ps", "reset", "shutdown", "serve"}
    for name, p in OPTIONS:
        assert isinstance(p.type, DeviceList), (name, p.opts)


@pytest.mark.parametrize("command,param", OPTIONS, ids=IDS)
def test_bad_lists_are_refused_alike(command, param):
    for value, why in BAD.items():
        result = runner.invoke(app, _args(command, param.opts[0], value))
        err = result.stderr
        assert result.exit_code == 2, (command, value, result.output)
        assert err.count("\n") == 1 and why in err and param.opts[0] in err, (command, value, err)
        assert "\x1b" not in err


@pytest.mark.parametrize("command,param", OPTIONS, ids=IDS)
def test_repeated_option_naming_a_device_twice_is_refused(command, param, standin_root):
    opt = param.opts[0]
    extra = ["--vllm", "/bin/true"] if command == "serve" else []
    args = ["--root", standin_root.root, command, f"{opt}=0", f"{opt}=1,0", *extra]
    result = runner.invoke(app, args + (["MODEL"] if command == "serve" else []))
    assert result.exit_code == 2, result.output
    assert "device '0' is named twice" in result.stderr, result.stderr


@pytest.mark.parametrize("command,param", OPTIONS, ids=IDS)
def test_unknown_device_is_the_same_line_everywhere(command, param, standin_root, tmp_path):
    extra = {"serve": ["--state-dir", str(tmp_path / "s"), "--vllm", "/bin/true"],
             "reset": ["--dry-run"], "shutdown": ["--all"]}.get(command, [])
    args = ["--root", standin_root.root, command, *extra, f"{param.opts[0]}=0,7"]
    result = runner.invoke(app, args + (["MODEL"] if command == "serve" else []))
    assert result.exit_code == 2, result.output
    assert result.stderr == ("xpuctl: error: unknown device '7'; devices here: "
                             "0=0000:03:00.0(renderD128), 1=0000:04:00.0(renderD129)\n")


def test_good_lists():
    assert split_devices(["0"]) == ["0"]
    assert split_devices(["0,1", "renderD130"]) == ["0", "1", "renderD130"]
    assert split_devices([" 0 , 0000:03:00.0 ", "/dev/dri/card1"]) == [
        "0", "0000:03:00.0", "/dev/dri/card1"]
    assert split_devices([]) == []


@given(st.lists(st.text(max_size=12), max_size=4))
def test_split_devices_gives_clean_unique_specs_or_a_value_error(values):
    try:
        specs = split_devices(values)
    except ValueError:
        return
    assert len(set(specs)) == len(specs)
    assert all(s and s == s.strip() and "," not in s for s in specs)
