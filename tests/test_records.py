"""Run records read as typed, bounded, regular files (issue 29 §8), and records whose run is
gone reported as stale (§13).

A record that is a FIFO used to hang `ps` (open for reading waits for a writer), one linked
to /dev/zero was read without end, a JSON list or a field of the wrong type ended in exit 70,
and an audit log that is a FIFO blocked reset for ever (open for writing waits for a
reader). Now each is a damaged record (or an unusable log) named with its path; every
command that meets one still ends, within a bound, with its documented exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import fakehost
import pytest
from serverig import XPUCTL

from xpuctl.state import runs

HANG = 60  # seconds: far more than any of these commands takes; a hang on main runs into it


def _record(name: str, **changes) -> dict:
    """A whole, well typed record (what serve writes), with `changes`."""
    rec = runs.RunRecord(name=name, run_id="0123456789abcdef", pid=None, start_ticks=None,
                         session=None, command=["vllm", "serve", "m"], devices=[], port=8000,
                         bind="127.0.0.1", shutdown_timeout=5, drain_timeout=30.0,
                         teardown_timeout=10.0, log_path=f"/nonexistent/{name}.log",
                         state="stopped")
    return {**rec.to_dict(), **changes}


def _state(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    for sub in ("runs", "locks", "logs"):
        (state / sub).mkdir(parents=True, mode=0o700)
    state.chmod(0o700)
    return state


# Each damaged shape: its file name, how it is made, and what the reader says it is.
def _fifo(p: Path) -> None:
    os.mkfifo(p, 0o600)  # no writer: open(2) for reading blocks (main hung here)


def _zero(p: Path) -> None:
    p.symlink_to("/dev/zero")  # read to its end: never


def _huge(p: Path) -> None:
    with open(p, "wb") as fh:  # 10 MiB: far past a record's 1 MiB bound
        fh.truncate(10 << 20)


def _text(data: bytes):
    return lambda p: p.write_bytes(data)


SHAPES = {
    "fifo": (_fifo, "a FIFO"),
    "zero": (_zero, "a symbolic link"),
    "huge": (_huge, "larger than 1.0 MiB"),
    "list": (_text(b"[]"), "not a JSON object but a list"),
    "pidonly": (_text(b'{"pid": "x"}'), "field 'name' is missing"),
    "pidstr": (_text(json.dumps(_record("pidstr", pid="x")).encode()),
               "field 'pid' is a string, not int | None"),
    "name5": (_text(b'{"name": 5}'), "field 'name' is an integer, not str"),
    "badutf8": (_text(b'{"name": "\xff\xfe"}'), "not UTF-8 text"),
    "notjson": (_text(b"{\"name\": "), "not JSON"),
    "nan": (_text(json.dumps(_record("nan", drain_timeout=float("nan"))).encode()),
            "field 'drain_timeout' is nan, not float"),
    "deep": (_text(b"[" * 100_000 + b"]" * 100_000), "nested too deep"),
    "other": (_text(json.dumps(_record("someone")).encode()), "it names the run 'someone'"),
    "negpid": (_text(json.dumps(_record("negpid", pid=-1)).encode()), "not a pid"),
}


def _damaged_state(tmp_path: Path) -> Path:
    state = _state(tmp_path)
    for name, (make, _) in SHAPES.items():
        make(state / "runs" / f"{name}.json")
    (state / "runs" / "good.json").write_text(json.dumps(_record("good")))
    return state


def test_every_damaged_shape_is_named_with_its_path_and_why(tmp_path):
    state = _damaged_state(tmp_path)
    found = runs.read_runs(str(state))
    assert [r.name for r in found.records] == ["good"]
    why = {u.name: u for u in found.unread}
    assert set(why) == set(SHAPES)
    for name, (_, said) in SHAPES.items():
        u = why[name]
        assert u.path == str(state / "runs" / f"{name}.json") and u.damaged, u
        assert said in u.why, (name, u.why)
    # the one reader of a named record says the same (exit 1: never "no such run")
    for name in SHAPES:
        with pytest.raises(runs.DamagedRecordError) as err:
            runs.load_record(str(state), name)
        assert f"run record {state}/runs/{name}.json is damaged" in str(err.value)
        assert runs.read_record(str(state), name) is None  # its quiet form
    assert runs.load_record(str(state), "good").name == "good"


def test_a_read_stops_at_the_bound(tmp_path, monkeypatch):
    """A record is read to at most RECORD_MAX_BYTES + 1 bytes, however big the file."""
    from xpuctl.state import regular

    state = _state(tmp_path)
    _huge(state / "runs" / "huge.json")
    got: list[int] = []
    real = os.read

    def counting(fd: int, n: int) -> bytes:
        data = real(fd, n)
        got.append(len(data))
        return data

    monkeypatch.setattr(regular.os, "read", counting)
    assert runs.read_runs(str(state)).unread[0].why == "larger than 1.0 MiB"
    assert sum(got) == runs.RECORD_MAX_BYTES + 1


def test_every_field_of_a_record_is_typed():
    """Every field of RunRecord is checked against its annotation: a field added with a
    default needs nothing else (and a type the reader cannot check fails here first)."""
    from xpuctl.state import fields

    assert fields.supported(runs.RunRecord) == []
    good = _record("r")
    assert runs.RunRecord.from_dict(good, "r").to_dict() == good
    for key in good:
        if key in runs.RunRecord.FIELD_READERS:  # read by its own reader (the watch's verdict)
            continue
        with pytest.raises(fields.FieldError, match=f"field {key!r} is an object"):
            runs.RunRecord.from_dict({**good, key: {"not": "this"}}, "r")
    # the watch's verdict is advice: a malformed one reads as unknown, the record stays whole
    assert runs.RunRecord.from_dict({**good, "health": {"not": "this"}}, "r").health is None
    # a newer xpuctl's extra field is left out; an older one's "host" is the bind address
    assert runs.RunRecord.from_dict({**good, "later": 1}).name == "r"
    old = {k: v for k, v in good.items() if k != "bind"} | {"host": "0.0.0.0"}
    assert runs.RunRecord.from_dict(old).bind == "0.0.0.0"


def _bounded_memory() -> None:
    """A read without end (main's, of a record linked to /dev/zero) fails in the child at
    2 GiB instead of taking the shared machine's memory."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def test_a_field_type_the_reader_cannot_check_is_named_and_never_a_crash():
    """A field typed with something `conforms` does not know (a set, a NamedTuple) is named by
    `supported` (the test above then fails first); read anyway, the record is refused with
    one line instead of an exception."""
    import dataclasses

    from xpuctl.state import fields

    @dataclasses.dataclass
    class Later:
        name: str
        tags: set[str] = dataclasses.field(default_factory=set)

    assert fields.supported(Later) == ["tags"]
    assert fields.typed_fields(Later, {"name": "x"}) == {"name": "x"}
    with pytest.raises(fields.FieldError, match="field 'tags' has a type this reader cannot"):
        fields.typed_fields(Later, {"name": "x", "tags": ["a"]})


def _xpuctl(*args: str, root: str | None = None, timeout: float = HANG, env=None):
    cmd = [*XPUCTL, *(["--root", root] if root else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=env, preexec_fn=_bounded_memory)


@pytest.mark.slow
def test_ps_lists_the_good_runs_and_names_every_damaged_record(tmp_path, standin_root):
    state = _damaged_state(tmp_path)
    # a good run that is alive (its supervisor: this test), so that ps lists it
    (state / "runs" / "good.json").write_text(json.dumps(
        _record("good", state="ready", supervisor_pid=os.getpid())))
    p = _xpuctl("ps", "--json", "--state-dir", str(state), root=standin_root.root)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert [r["name"] for r in doc["runs"]] == ["good"]
    unread = {u["name"]: u for u in doc["unread_runs"]}
    assert set(unread) == set(SHAPES)
    for name, (_, said) in SHAPES.items():
        assert unread[name]["path"] == str(state / "runs" / f"{name}.json")
        assert unread[name]["damaged"] is True and said in unread[name]["why"], unread[name]
    # the table: the same, one warning line on stderr per record
    p = _xpuctl("ps", "--state-dir", str(state), root=standin_root.root)
    assert p.returncode == 0, p.stderr
    for name in SHAPES:
        line = f"xpuctl: warning: run record {state}/runs/{name}.json is damaged: "
        assert p.stderr.count(line) == 1, p.stderr


@pytest.mark.parametrize("name", ["fifo", "list", "pidstr", "zero"])
def test_shutdown_and_logs_of_a_damaged_record_say_so_and_exit_1(tmp_path, standin_root, name):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "runs").mkdir(mode=0o700)
    SHAPES[name][0](state / "runs" / f"{name}.json")
    for args in (["shutdown", name], ["logs", name]):
        p = _xpuctl(*args, "--state-dir", str(state), root=standin_root.root)
        assert p.returncode == 1, (args, p.returncode, p.stderr)
        err = p.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"xpuctl: error: run '{name}': run record "
                                                   f"{state}/runs/{name}.json is damaged: "), err
        assert SHAPES[name][1] in err[0]


def test_doctor_warns_of_each_damaged_record(tmp_path):
    state = _damaged_state(tmp_path)
    host = fakehost.clean_host(tmp_path / "root")
    p = _xpuctl("doctor", "--json", "--state-dir", str(state), root=str(host.root))
    assert p.returncode == 0, p.stderr  # warnings: exit 0 (1 with --strict)
    found = [f for f in json.loads(p.stdout)["findings"] if f["check"] == "run-records"]
    assert {f["severity"] for f in found} == {"warn"}
    by_path = {f["paths"][0]: f["message"] for f in found}
    for name, (_, said) in SHAPES.items():
        msg = by_path[str(state / "runs" / f"{name}.json")]
        assert "is damaged" in msg and said in msg, msg


def test_a_runs_directory_that_is_a_file_is_reported(tmp_path, standin_root):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "runs").write_text("not a directory\n")
    runs_dir = str(state / "runs")
    root = standin_root.root
    p = _xpuctl("ps", "--json", "--state-dir", str(state), root=root)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["unread_runs"] == [
        {"path": runs_dir, "name": None, "damaged": True, "why": "a regular file, not a directory"}]
    p = _xpuctl("shutdown", "x", "--state-dir", str(state), root=root)
    assert p.returncode == 1 and f"the runs in {runs_dir} cannot be listed" in p.stderr, p.stderr
    host = fakehost.clean_host(tmp_path / "fake")
    p = _xpuctl("doctor", "--json", "--state-dir", str(state), root=str(host.root))
    assert p.returncode == 0, p.stderr
    assert [f["message"] for f in json.loads(p.stdout)["findings"] if f["check"] == "run-records"] \
        == [f"the runs in {runs_dir} cannot be listed: a regular file, not a directory"]
    # a logs/ that is a file: logs NAME says it cannot read the log, doctor names it
    (state / "runs").unlink()
    (state / "runs").mkdir(mode=0o700)
    rec = _record("r", log_path=str(state / "logs" / "r.log"))
    (state / "runs" / "r.json").write_text(json.dumps(rec))
    shutil.rmtree(state / "logs", ignore_errors=True)  # readers make a missing one
    (state / "logs").write_text("not a directory\n")
    p = _xpuctl("logs", "r", "--state-dir", str(state), root=root)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip() == (f"xpuctl: error: run 'r': its log {state}/logs/r.log cannot be "
                                "read: Not a directory"), p.stderr
    p = _xpuctl("doctor", "--json", "--state-dir", str(state), root=str(host.root))
    assert [f["message"] for f in json.loads(p.stdout)["findings"] if f["check"] == "run-records"] \
        == [f"{state}/logs is a regular file, not a directory: serve refuses this state directory"]
    # serve refuses it before anything starts: an unusable state directory (exit 2)
    p = _xpuctl("serve", "--state-dir", str(state), "--vllm", "/bin/false", "m", root=root)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == (f"xpuctl: error: state directory {state}: {state}/logs is a "
                                "regular file, not a directory")


@pytest.mark.parametrize("what", ["audit.jsonl", "audit.lock"])
def test_an_audit_log_that_is_a_fifo_never_blocks_reset(tmp_path, what):
    """reset goes on (bounded by HANG), deletes what it planned, and says the audit lines
    were not written, as when the log cannot be written for any other reason."""
    h = fakehost.orphan_host(tmp_path / "root")
    state = _state(tmp_path)
    os.mkfifo(state / what, 0o600)
    p = _xpuctl("reset", "--yes", "--json", "--state-dir", str(state), root=str(h.root))
    assert p.returncode == 1, p.stderr  # the fake orphans cannot be stopped: as without a FIFO
    data = json.loads(p.stdout)
    assert h.paths["stale_shm"] in data["removed"]
    assert data["audit"]["lost"] >= 1 and data["audit"]["lines"] == 0, data["audit"]
    path = state / what
    assert "is a FIFO" in data["audit"]["error"], data["audit"]
    assert f"xpuctl: warning: audit log {state}/audit.jsonl: " in p.stderr, p.stderr
    assert path.exists() and not path.is_file()  # left as it was


# ---------------------------------------------------------------------------------------------
# stale records (§13): the record says the run is active, nothing of it runs


def _gone_pid() -> tuple[int, int]:
    """A pid and start ticks that name no process: this test's pid with another start."""
    with open(f"/proc/{os.getpid()}/stat", "rb") as fh:
        data = fh.read()
    ticks = int(data[data.rfind(b")") + 2:].split()[19])
    return os.getpid(), ticks + 12345


@pytest.mark.slow
def test_a_ready_record_whose_run_is_gone_is_reported_stale(tmp_path, standin_root):
    state = _state(tmp_path)
    pid, ticks = _gone_pid()
    path = state / "runs" / "ghost.json"
    path.write_text(json.dumps(_record("ghost", state="ready", pid=pid, start_ticks=ticks,
                                       session=pid, supervisor_pid=None, ready_at=1.0)))
    root = standin_root.root
    p = _xpuctl("ps", "--json", "--state-dir", str(state), root=root)
    assert p.returncode == 0, p.stderr
    (run,) = json.loads(p.stdout)["runs"]
    assert (run["name"], run["state"], run["recorded_state"]) == ("ghost", "stale", "ready")
    p = _xpuctl("ps", "--state-dir", str(state), root=root)
    assert "ghost  stale" in p.stdout, p.stdout

    p = _xpuctl("shutdown", "ghost", "--state-dir", str(state), root=root)
    assert p.returncode == 3, p.stderr  # nothing to stop: as for a name that matches nothing
    assert p.stderr.strip() == ("xpuctl: error: run 'ghost' is gone: its record is stale (it "
                                "says ready, but no process of the run is alive)")
    assert json.loads(path.read_text())["state"] == "ready"  # reported, not rewritten

    host = fakehost.clean_host(tmp_path / "root")
    p = _xpuctl("doctor", "--json", "--state-dir", str(state), root=str(host.root))
    found = [f for f in json.loads(p.stdout)["findings"] if f["check"] == "run-records"]
    assert [(f["severity"], f["paths"]) for f in found] == [("warn", [str(path)])]
    assert found[0]["message"].startswith("run ghost is gone, its record is stale: it says ready")


# ---------------------------------------------------------------------------------------------
# a non-root ps names the runs it could not read


def _as_nobody_available() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        p = subprocess.run(["unshare", "--mount", "--fork", "setpriv", "--reuid=65534",
                            "--regid=65534", "--clear-groups", "true"], capture_output=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return p.returncode == 0


_NOBODY = r"""
set -e
mount -t tmpfs -o mode=0755 tmpfs /run   # this namespace's own /run: root's runs live there
mkdir -m 0700 /run/xpuctl /run/xpuctl/runs
printf '%s' "$RECORD" > /run/xpuctl/runs/rootrun.json
chmod 0600 /run/xpuctl/runs/rootrun.json
mkdir -m 0755 /run/open /run/open/runs
printf '%s' "$RECORD" > /run/open/runs/sealed.json
chmod 0600 /run/open/runs/sealed.json
mkdir -m 0700 /run/mine
chown 65534:65534 /run/mine
cd /
exec setpriv --reuid=65534 --regid=65534 --clear-groups "$@"
"""


@pytest.mark.slow
@pytest.mark.skipif(not _as_nobody_available(), reason="needs root, unshare --mount and setpriv")
def test_a_non_root_ps_names_the_runs_it_could_not_read(tmp_path):
    """nobody's ps: its own state directory is empty; root's (/run/xpuctl, 0700) cannot be
    listed, and a directory it may list holds a record it may not read: both are said."""
    env = dict(os.environ, RECORD=json.dumps(_record("rootrun", state="ready")), HOME="/")
    env.pop("XPUCTL_STATE_DIR", None)
    sealed = [("/run/open/runs/sealed.json", "sealed")]
    for state, expect in (("/run/mine", []), ("/run/open", sealed)):
        p = subprocess.run(["unshare", "--mount", "--fork", "sh", "-c", _NOBODY, "sh",
                            *XPUCTL, "ps", "--json", "--state-dir", state],
                           capture_output=True, text=True, timeout=HANG, env=env, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        unread = [(u["path"], u["name"], u["damaged"], u["why"]) for u in doc["unread_runs"]]
        want = [(path, name, False, "Permission denied") for path, name in expect]
        want.append(("/run/xpuctl", None, False, "Permission denied"))
        assert unread == want, doc["unread_runs"]
        p = subprocess.run(["unshare", "--mount", "--fork", "sh", "-c", _NOBODY, "sh",
                            *XPUCTL, "ps", "--state-dir", state],
                           capture_output=True, text=True, timeout=HANG, env=env, cwd=tmp_path)
        assert ("xpuctl: warning: the runs in /run/xpuctl cannot be listed: Permission denied"
                in p.stderr), p.stderr


@pytest.mark.parametrize("what", ["fifo", "zero"])
def test_an_idle_baseline_that_is_not_a_regular_file_is_taken_as_0(tmp_path, what):
    """The idle baseline (baseline.json, doctor --deep) is read the same way: never blocked
    on, never read without end; it is taken as 0 and said why."""
    import sys

    state = _state(tmp_path)
    SHAPES[what][0](state / "baseline.json")
    code = ("import sys; from xpuctl.probes.baseline import load_baseline; "
            "used, issue = load_baseline(sys.argv[1]); print(used, issue.reason)")
    p = subprocess.run([sys.executable, "-c", code, str(state)], capture_output=True, text=True,
                       timeout=HANG, preexec_fn=_bounded_memory)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("{} baseline unreadable, taken as 0: ")
    assert SHAPES[what][1] in p.stdout, p.stdout
