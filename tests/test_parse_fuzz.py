"""Every parser in xpuctl/parse/ on arbitrary input: it returns, or raises its own documented
error, and nothing else (no IndexError, UnicodeDecodeError, struct.error, RecursionError…).

Lenient parsers (fdinfo, procfs, net, envvars, roles, vllmargs' readers) document that they never raise; the
strict ones raise NetlinkError, KmdReplyError, XpuSmiError or ProbeOutputError.
"""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xpuctl.errors import UsageError
from xpuctl.parse import (
    collective,
    envvars,
    fdinfo,
    health,
    kmd,
    kmsg,
    net,
    probes,
    procfs,
    roles,
    sockdiag,
    survivability,
    versions,
    vllmargs,
    vllmlog,
    xpusmi,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
texts = st.text(max_size=2000)
blobs = st.binary(max_size=2000)
# JSON-ish values: the strict parsers must survive any JSON, not only any text
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats()
    | st.text(max_size=30),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=20), kids, max_size=6),
    max_leaves=40,
)
# text that mixes the keys the parsers look for with noise
near_fdinfo = st.lists(
    st.sampled_from(["drm-driver:\txe", "drm-pdev:\t0000:03:00.0", "drm-client-id:\t7",
                     "drm-total-vram0:\t23992 KiB", "drm-total-local0:\t9999999999999999999999999 GiB",
                     "size:\t4096", "exp_name:\txe", "ino:\t12", "drm-total-vram1:\t-3 MiB"])
    | texts, max_size=12,
).map("\n".join)


@FUZZ
@given(texts)
def test_envvars_never_raise(value):
    envvars.mask_indices(value)
    envvars.check_affinity_mask(value, None)
    envvars.check_affinity_mask(value, 2)
    envvars.check_device_selector(value)
    envvars.check_hierarchy(value)


@FUZZ
@given(st.one_of(texts, near_fdinfo))
def test_fdinfo_never_raises(text):
    fdinfo.parse_size(text)
    fdinfo.parse_fdinfo(text)
    fdinfo.parse_dmabuf(text)


@FUZZ
@given(st.lists(st.binary(max_size=80).map(lambda b: b.replace(b"\n", b"")), max_size=8),
       st.binary(min_size=1, max_size=40).map(lambda b: b.replace(b"\n", b"x")))
def test_log_lines_splits_at_newlines_only(lines, partial):
    """One line in, one line out, whatever CRs, VTs, NELs or U+2028 it holds (issue 17);
    a final piece without its newline is a line too."""
    for data, want in ((b"".join(ln + b"\n" for ln in lines), lines),
                       (b"".join(ln + b"\n" for ln in lines) + partial, [*lines, partial])):
        got = vllmlog.log_lines(data)
        assert [line.encode("utf-8", "surrogateescape") for line in got] == \
            [raw.removesuffix(b"\r") for raw in want]


def test_log_lines_keeps_a_progress_bar_one_line():
    data = b"Loading:  10%\rLoading:  50%\rLoading: 100%\n(EngineCore) x \xc2\x85 [shutdown] y\r\n"
    assert vllmlog.log_lines(data) == ["Loading:  10%\rLoading:  50%\rLoading: 100%",
                                       "(EngineCore) x \x85 [shutdown] y"]


@FUZZ
@given(texts)
def test_net_never_raises(text):
    net.parse_tcp(text)
    net.parse_tcp(text, listen_only=False)
    net.parse_unix_paths(text)


@FUZZ
@given(blobs)
def test_procfs_never_raises(data):
    procfs.parse_stat(data)
    procfs.parse_cmdline(data)
    procfs.parse_environ(data)
    text = data.decode("utf-8", "surrogateescape")
    procfs.parse_status_uid(text)
    procfs.parse_status_nspid(text)
    procfs.parse_maps_paths(text)
    procfs.parse_maps(text)
    procfs.parse_mountinfo(text)
    procfs.parse_status_creds(text)
    procfs.parse_boot_time(text)


@FUZZ
@given(st.lists(texts, max_size=6))
def test_roles_never_raise(argv):
    roles.classify(argv)


@FUZZ
@given(blobs)
def test_sockdiag_raises_only_netlink_error(data):
    for parse in (sockdiag.parse_listen_reply, sockdiag.parse_unix_reply):
        try:
            parse(data, [])
        except sockdiag.NetlinkError:
            pass


@FUZZ
@given(blobs)
def test_kmd_replies_raise_only_kmd_reply_error(data):
    for fn in (kmd.parse_xe_mem_regions, kmd.parse_i915_memory_regions, kmd.xe_query_size,
               kmd.i915_item_length):
        try:
            fn(data)
        except kmd.KmdReplyError:
            pass


@FUZZ
@given(st.integers(0, 70), st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**64 - 1),
                                              st.integers(0, 2**64 - 1)), max_size=5), st.binary(max_size=100))
def test_kmd_structured_replies(count, regions, tail):
    """Well-formed headers with odd counts and sizes (the interesting part of the space)."""
    xe = struct.pack("<II", count, 0) + b"".join(
        struct.pack("<HHIQQQQ6Q", c, i, 4096, a, b, 0, 0, 0, 0, 0, 0, 0, 0) for i, (c, a, b) in enumerate(regions)
    ) + tail
    i915 = struct.pack("<IIII", count, 0, 0, 0) + b"".join(
        struct.pack("<HHIQQ8Q", c, i, 0, a, b, *([0] * 8)) for i, (c, a, b) in enumerate(regions)
    ) + tail
    for fn, data in ((kmd.parse_xe_mem_regions, xe), (kmd.parse_i915_memory_regions, i915)):
        try:
            parsed = fn(data)
        except kmd.KmdReplyError:
            continue
        for priv in (True, False):
            kmd.device_memory(parsed, priv)


@FUZZ
@given(st.one_of(texts, json_values.map(json.dumps)))
def test_kmd_probe_output_raises_only_kmd_reply_error(text):
    try:
        kmd.probe_result(text)
    except kmd.KmdReplyError:
        pass


@FUZZ
@given(st.one_of(texts, json_values.map(json.dumps),
                 json_values.map(lambda v: json.dumps({"device_list": v})),
                 json_values.map(lambda v: json.dumps({"device_util_by_proc_list": v}))))
def test_xpusmi_raises_only_xpusmi_error(text):
    for fn in (xpusmi.parse_discovery, xpusmi.parse_ps):
        try:
            fn(text)
        except xpusmi.XpuSmiError:
            pass
    xpusmi.probe_result((0, text), (0, text))  # documented never to raise


@FUZZ
@given(st.one_of(texts, json_values.map(json.dumps),
                 json_values.map(lambda v: json.dumps({"name": "sysman", "available": True, "devices": v})),
                 json_values.map(lambda v: json.dumps({"name": "sysman", "available": True,
                                                       "devices": [{"processes": v}]}))))
def test_probe_output_raises_only_probe_output_error(text):
    try:
        r = probes.parse_probe_output(text, "sysman")
    except probes.ProbeOutputError:
        return
    assert probes.result_from_dict(probes.result_to_dict(r)) == r


@FUZZ
@given(json_values)
def test_probe_document_raises_only_probe_output_error(value):
    from xpuctl.parse import probes

    try:
        probes.results_from_json({"schema": probes.SCHEMA, "probes": value if isinstance(value, list) else [value]})
    except probes.ProbeOutputError:
        pass


# vLLM's arguments: the flags serve and shutdown look for, in every spelling, among noise
vllm_argv = st.lists(
    st.sampled_from(["--port", "--port=8001", "--host", "--host=0.0.0.0", "--shutdown-timeout",
                     "--shutdown_timeout", "--shutdown-timeout=7", "--shutdown_timeout=x", "8000",
                     "0", "-1", "", "=", "--port=", "--tensor-parallel-size", "2"])
    | st.text(max_size=30), max_size=12,
)


@FUZZ
@given(vllm_argv)
def test_vllm_argv_readers_never_raise(argv):
    port, bind = vllmargs.port_from_argv(argv)
    assert port is None or port >= 0
    assert bind is None or isinstance(bind, str)
    timeout = vllmargs.shutdown_timeout_from_argv(argv)
    assert timeout is None or timeout >= 0


@FUZZ
@given(vllm_argv, st.dictionaries(st.sampled_from(["VLLM_API_KEY", "OTHER"]), st.text(max_size=8)))
def test_server_reach_never_raises_and_keys_come_from_argv_or_env(argv, env):
    """vllmargs.server_reach (issue 36 item 1): any argv and environment; the keys are values
    that stand in argv or VLLM_API_KEY's, never anything else."""
    reach = vllmargs.server_reach(argv, env)
    assert reach.port is None or reach.port >= 0
    words = set(argv) | {a.partition("=")[2] for a in argv} | {env.get("VLLM_API_KEY")}
    assert all(k in words for k in reach.keys)
    assert reach.mutual <= reach.tls


def test_server_reach_reads_vllms_options():
    """vLLM 0.32 entrypoints/launchers/cli_args.py: --api-key takes one or more values (the
    last --api-key wins, argparse), else VLLM_API_KEY; --uds; --ssl-* with --ssl-cert-reqs an
    ssl.VerifyMode integer."""
    r = vllmargs.server_reach(["m", "--api-key", "a", "b", "--port", "9", "--uds", "/s",
                               "--ssl_keyfile=k", "--ssl-certfile", "c", "--ssl-cert-reqs", "2"],
                              {"VLLM_API_KEY": "env"})
    assert r.keys == ("a", "b") and r.port == 9 and r.uds == "/s" and r.tls and r.mutual
    assert vllmargs.server_reach(["m"], {"VLLM_API_KEY": "env"}).keys == ("env",)
    assert vllmargs.server_reach(["--api-key=x", "--api-key", "y"]).keys == ("y",)
    assert not vllmargs.server_reach(["--ssl-keyfile", "k"]).tls  # uvicorn needs both


@FUZZ
@given(vllm_argv, st.sampled_from(["--port", "--host", "--shutdown-timeout"]))
def test_strip_flag_removes_every_spelling_and_keeps_the_rest(argv, flag):
    rest, value, found = vllmargs.strip_flag(argv, flag)
    spellings = {flag, flag.replace("-", "_").replace("__", "--")}
    assert not any(a.partition("=")[0] in spellings for a in rest)
    assert found == any(a.partition("=")[0] in spellings for a in argv)
    assert value is None or found
    # what is left keeps its order
    it = iter(argv)
    assert all(any(a == b for b in it) for a in rest)


@FUZZ
@given(vllm_argv, st.sampled_from(["--port", "--host"]), st.none() | st.sampled_from(["8000", "08000", "x"]))
def test_merge_shared_passes_the_flag_once_or_refuses(argv, flag, before):
    try:
        merged = vllmargs.merge_shared(list(argv), flag, before)
    except UsageError:
        assert before is not None
        return
    if before is None:
        assert merged == list(argv)
    else:
        assert vllmargs.strip_flag(merged, flag)[2]



@pytest.mark.parametrize("spec", ["²", "١", "0²"])
def test_a_non_ascii_digit_device_spec_is_a_usage_error_not_a_crash(spec):
    """str.isdigit() takes "²" and Arabic-Indic digits, which int() refuses: every reader of
    a number checks for ASCII digits (the vLLM argv fuzz found the first one)."""
    from xpuctl.core.model import Device
    from xpuctl.host.devices import find_device

    dev = Device(bdf="0000:03:00.0", vendor_id="0x8086", device_id="0xe211", driver="xe",
                 render_node="/dev/dri/renderD128", card_node=None, minors=(128,),
                 memory_total_bytes=None, index=0)
    assert find_device([dev], spec) is None


# -- vLLM's lines for a dead engine (parse/enginedeath) -------------------------------------
# Real lines, as quoted in vLLM's issues (the first and the last: the message only, its
# prefix was not quoted): #48966 (a worker, then EngineCore; the server then exited 0; the
# message's end as multiproc_executor.py logs it), #17276 (core.py's fatal error), #32468
# (core_client.py, EngineCore_DP0), a report of the `EngineCore_0` spelling
# (core_client.py:562, with its process tag), #51013 (EngineDeadError in a request), and
# vLLM 0.32's engine monitor line (core_client.py:818, MPClientEngineMonitor, read in its
# source; 0.32's logger writes the process tag: vllm/logger.py `_FORMAT`).
ENGINE_DEATH_LINES = [
    (("(EngineCore_DP0 pid=412) ERROR 12-01 10:00:00 [multiproc_executor.py:316] Worker proc "
      "VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor."),
     "a worker died"),
    ("ERROR 04-28 02:37:03 [core.py:398] EngineCore encountered a fatal error.", "EngineCore failed"),
    (("ERROR 01-16 17:16:49 [core_client.py:605] Engine core proc EngineCore_DP0 died "
     "unexpectedly, shutting down client."), "EngineCore died"),
    (("(APIServer pid=215332) ERROR 09-05 01:15:59 [core_client.py:562] Engine core proc "
     "EngineCore_0 died unexpectedly, shutting down client."), "EngineCore died"),
    (("(APIServer pid=1) ERROR 08-04 09:48:15 [serving.py:830] vllm.v1.engine.exceptions."
     "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root "
     "cause."), "the engine was dead"),
    (("(APIServer pid=1) WARNING 12-01 10:00:00 [core_client.py:818] [shutdown] MPClient: "
      "engine core exited unexpectedly; starting cleanup"), "EngineCore died"),
    # vLLM 0.32's ray_executor_v2.py (logger.error, the dead ranks as a list)
    (("(EngineCore_DP0 pid=9) ERROR 12-01 10:00:00 [ray_executor_v2.py:523] RayWorkerProc "
      "rank=[1] died unexpectedly, shutting down executor."), "a worker died"),
]


@pytest.mark.parametrize(("line", "what"), ENGINE_DEATH_LINES)
def test_engine_death_lines(line, what):
    from xpuctl.parse.enginedeath import engine_death

    assert engine_death(["INFO:     Application shutdown complete.", line]) == (what, line)


def test_engine_death_first_cause_wins_and_a_clean_log_says_nothing():
    from xpuctl.parse.enginedeath import engine_death

    worker, core = ENGINE_DEATH_LINES[0][0], ENGINE_DEATH_LINES[1][0]
    assert engine_death([worker, core]).what == "a worker died"
    assert engine_death([("INFO 12-01 10:00:03 [launcher.py:241] [shutdown] API server: "
                         "shutdown triggered"), "INFO:     Finished server process [1]"]) is None


@FUZZ
@given(st.lists(texts, max_size=20))
def test_engine_death_never_raises(lines):
    from xpuctl.output.safetext import safe
    from xpuctl.parse.enginedeath import QUOTE, engine_death

    found = engine_death(lines)
    assert found is None or found.line in {safe(line.strip(), QUOTE) for line in lines}


@given(st.text(max_size=2000))
def test_kmsg_never_raises(text: str) -> None:
    from xpuctl.parse import kmsg

    records = kmsg.parse_kmsg(text)
    kmsg.gpu_events(records)
    kmsg.gpu_events(kmsg.parse_kmsg(kmsg.relevant_text(text), relevant_only=True))


# the collective check's rank events (xpuctl's own format, xpuctl/parse/collective.py): any
# text, and marker lines carrying any JSON, fold without raising
near_events = st.lists(
    st.one_of(texts, json_values.map(lambda v: collective.MARKER + json.dumps(v)),
              st.fixed_dictionaries({
                  "ev": st.sampled_from(collective.EVENTS) | st.text(max_size=5),
                  "slot": st.integers(-3, 2000) | st.none() | st.booleans(),
                  "phase": st.sampled_from(collective.PHASES) | json_values,
                  "error": json_values, "pid": json_values, "returncode": json_values,
                  "paths": json_values | st.lists(st.text(max_size=12).map("/tmp/".__add__)),
              }).map(lambda d: collective.MARKER + json.dumps(d))),
    max_size=12,
).map("\n".join)


@FUZZ
@given(near_events)
def test_collective_events_never_raise(text):
    for slot, r in collective.parse_events(text).items():
        assert r.slot == slot and 0 <= slot < collective.MAX_SLOTS
        assert r.phase is None or r.phase in collective.PHASES
        assert r.error is None or (isinstance(r.error, str) and len(r.error) <= collective.MAX_TEXT)
        assert len(r.files) <= collective.MAX_FILES and all(map(collective.in_file_dirs, r.files))


# Prometheus text (parse/metrics.py): lines near vLLM's samples (names, labels with escapes,
# values, timestamps) mixed with any text
near_metrics = st.lists(
    st.one_of(
        texts,
        st.tuples(
            st.sampled_from(["vllm:num_requests_running", "vllm:generation_tokens_total",
                             "vllm:prompt_tokens_total", "vllm:generation_tokens_created", "x"]),
            st.lists(st.tuples(st.text(max_size=6), st.text(max_size=8)), max_size=3),
            st.sampled_from(["1", "2.5", "NaN", "+Inf", "-Inf", "1e400", "-3", "x", ""]),
            st.sampled_from(["", " 1700000000000", " x", " 1 2"]),
        ).map(lambda t: t[0] + ("{" + ",".join(
            f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
            for k, v in t[1]) + "}" if t[1] else "") + " " + t[2] + t[3]),
    ),
    max_size=12,
).map("\n".join)


@FUZZ
@given(near_metrics)
def test_metrics_never_raise(text):
    import math

    from xpuctl.parse import metrics

    for s in metrics.samples(text):
        assert s.name and isinstance(s.value, float)
    c = metrics.counters(text)
    assert all(v is None or math.isfinite(v) for v in (c.running, c.waiting,
                                                        c.generation_tokens, c.prompt_tokens))
    for e in metrics.engines(text):
        assert all(v is None or math.isfinite(v) for v in (e.running, e.waiting,
                                                            e.generation_tokens, e.prompt_tokens))
    n = metrics.in_flight(text)
    assert n is None or isinstance(n, int)


@FUZZ
@given(st.lists(st.sampled_from(["Survivability mode type: Boot", "Survivability mode type: Runtime",
                                 "Survivability mode type:", "Capability Info: 0x1 - 0x2"])
                | texts, max_size=6).map("\n".join))
def test_survivability_type_never_raises(text):
    assert survivability.survivability_type(text) in (survivability.BOOT, survivability.RUNTIME,
                                                      survivability.UNKNOWN)


# issue 37: the card's own health (parse/health.py), the wedged uevent's method
# (parse/kmsg.py wedge_method) and the GuC firmware version (parse/versions.py)
near_guc = st.lists(
    st.sampled_from(["GuC firmware: xe/bmg_guc_70.bin", "\tstatus: RUNNING",
                     "\tversion: wanted 70.44.1, found 70.58.0",
                     "\trelease version: wanted 70.44.1, found 99999.1.2.3.4",
                     "xe 0000:03:00.0: [drm] Using GuC firmware from xe/bmg_guc_70.bin version 70.44.1",
                     "WEDGED=rebind,,bus-reset,vendor-specific", "Firmware flash required",
                     "critical", "ok warning"]) | texts, max_size=10,
).map("\n".join)


@FUZZ
@given(st.one_of(texts, near_guc))
def test_health_and_firmware_parsers_never_raise(text):
    assert health.gpu_health(text) in ("ok", "warning", "critical", "unknown")
    assert health.sysman_health(text) in (None, "ok", "warning", "critical", "failed")
    method = kmsg.wedge_method(text)
    assert method is None or set(method.split(",")) <= set(kmsg.METHODS)
    found = versions.guc_info_version(text)
    assert found is None or all(p.isdigit() for p in found.split("."))
    for bdf, v in versions.guc_log_versions(text.splitlines()):
        assert v.replace(".", "").isdigit() and (bdf is None or len(bdf) == 12)


@FUZZ
@given(json_values)
def test_probe_device_health_raises_only_probe_output_error(value):
    doc = {"name": "sysman", "available": True, "devices": [{"bdf": "0000:03:00.0", "health": value}]}
    try:
        r = probes.result_from_dict(doc)
    except probes.ProbeOutputError:
        return
    assert r.devices[0].health in (None, "ok", "warning", "critical", "failed")
    assert probes.result_from_dict(probes.result_to_dict(r)) == r
