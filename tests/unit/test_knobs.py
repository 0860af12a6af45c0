"""Unit tests for perseus.base.knobs: environment parsing, precedence, validation, Settings."""

from __future__ import annotations

import pytest

from perseus.base.knobs import (KNOBS, Knob, Settings, knob, load_settings, parse_bool, parse_reset_limit,
                                   read_knob)

pytestmark = pytest.mark.timeout(60)

BY_NAME = {k.name: k for k in KNOBS}
TWO_NAMES = [k for k in KNOBS if len(k.env) >= 2]


def sample_values(k: Knob) -> tuple[str, object, str, object]:
    """Two distinct valid environment strings for ``k`` with their parsed values (neither is the default)."""
    if k.choices:  # a knob of two choices has one other than its default: b is then the default
        others = [c for c in k.choices if c != k.default]
        a, b = others[0], (others[1] if len(others) > 1 else k.default)
        return a, a, b, b
    if k.type is bool:
        return ("1", True, "0", False) if not k.default else ("0", False, "1", True)
    if k.type is int:
        return "7", 7, "9", 9
    if k.type is float:
        return "1.5", 1.5, "2.25", 2.25
    if k.type is parse_reset_limit:
        return "none", None, "5", 5
    return "/tmp/perseus-a", "/tmp/perseus-a", "/tmp/perseus-b", "/tmp/perseus-b"


# ----------------------------------------------------------------------------- declarations

def test_knob_declarations():
    names = [k.name for k in KNOBS]
    assert len(names) == len(set(names)), "duplicate knob names"
    all_env = [v for k in KNOBS for v in k.env]
    assert len(all_env) == len(set(all_env)), "an environment variable belongs to two knobs"
    for k in KNOBS:
        assert isinstance(k.doc, str) and k.doc.strip(), f"{k.name} has no doc"
        assert k.env and k.env[0].startswith("PERSEUS_"), f"{k.name}: first env name must be PERSEUS_*"
        assert all(v.startswith(("PERSEUS_", "HOROVOD_")) and v == v.upper() for v in k.env)
        if len(k.env) > 1:
            assert k.env[1].startswith("HOROVOD_")
        assert k.type in (int, float, bool, str, parse_reset_limit)
        if k.type is parse_reset_limit:
            assert k.default is None or isinstance(k.default, int)
        else:
            assert isinstance(k.default, k.type), f"{k.name}: default {k.default!r} is not {k.type.__name__}"
        if k.choices:
            assert k.default in k.choices


def test_knob_lookup():
    for k in KNOBS:
        assert knob(k.name) is k
    with pytest.raises(KeyError) as info:
        knob("fusion_treshold_bytes")
    text = str(info.value)
    assert "fusion_treshold_bytes" in text
    assert all(k.name in text for k in KNOBS)


# ----------------------------------------------------------------------------- defaults

def test_defaults_from_empty_environment():
    s = load_settings({})
    assert set(s.as_dict()) == set(BY_NAME)
    for k in KNOBS:
        assert getattr(s, k.name) == k.default
        assert type(getattr(s, k.name)) is type(k.default)
        assert not s.is_explicit(k.name)


def test_documented_default_values():
    s = load_settings({})
    assert s.fusion_threshold_bytes == 4 * 1024 * 1024
    assert s.inplace_threshold_bytes == 256 * 1024
    assert s.cycle_time_ms == 0.0
    assert s.num_channels == 0  # chosen at init() by topology (tests/unit/test_topology_defaults.py)
    assert s.cache_capacity == 4096
    assert s.stall_check_time_s == 60.0 and s.stall_shutdown_time_s == 300.0
    assert s.log_level == "warning"
    assert s.timeline == ""
    assert s.stall_check_disable is False and s.elastic is False
    assert s.abort_on_exception is True and s.gc_freeze is True


def test_os_environ_is_the_default_source(monkeypatch):
    for k in KNOBS:
        for var in k.env:
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PERSEUS_CYCLE_TIME", "3.5")
    s = load_settings()
    assert s.cycle_time_ms == 3.5 and s.is_explicit("cycle_time_ms")
    assert s.fusion_threshold_bytes == 4 << 20


def test_environment_is_not_modified():
    env = {"PERSEUS_FUSION_THRESHOLD": "10", "HOROVOD_CYCLE_TIME": "2"}
    load_settings(env, num_channels=3)
    assert env == {"PERSEUS_FUSION_THRESHOLD": "10", "HOROVOD_CYCLE_TIME": "2"}


# ----------------------------------------------------------------------------- precedence

@pytest.mark.parametrize("k", TWO_NAMES, ids=lambda k: k.name)
def test_perseus_name_wins_over_horovod_name(k):
    text_a, value_a, text_b, value_b = sample_values(k)
    s = load_settings({k.env[0]: text_a, k.env[1]: text_b})
    assert getattr(s, k.name) == value_a
    assert s.is_explicit(k.name)
    s = load_settings({k.env[1]: text_b})
    assert getattr(s, k.name) == value_b
    assert s.is_explicit(k.name)
    s = load_settings({k.env[0]: text_b})
    assert getattr(s, k.name) == value_b


@pytest.mark.parametrize("k", KNOBS, ids=lambda k: k.name)
def test_every_knob_reads_its_variable(k):
    text, value, _, _ = sample_values(k)
    s = load_settings({k.env[0]: text})
    assert getattr(s, k.name) == value
    assert s.is_explicit(k.name)
    others = [n for n in BY_NAME if n != k.name]
    assert not any(s.is_explicit(n) for n in others)
    assert all(getattr(s, n) == BY_NAME[n].default for n in others)


def test_empty_value_counts_as_unset():
    s = load_settings({"PERSEUS_CYCLE_TIME": "  ", "HOROVOD_CYCLE_TIME": "4"})
    assert s.cycle_time_ms == 4.0
    s = load_settings({"PERSEUS_FUSION_THRESHOLD": ""})
    assert s.fusion_threshold_bytes == 4 << 20 and not s.is_explicit("fusion_threshold_bytes")


def test_numbers_are_parsed_with_whitespace():
    s = load_settings({"PERSEUS_FUSION_THRESHOLD": " 1048576 ", "PERSEUS_CYCLE_TIME": "\t2.5\n",
                       "PERSEUS_NUM_CHANNELS": "0"})
    assert s.fusion_threshold_bytes == 1048576 and type(s.fusion_threshold_bytes) is int
    assert s.cycle_time_ms == 2.5 and type(s.cycle_time_ms) is float
    assert s.num_channels == 0 and s.is_explicit("num_channels")


# ----------------------------------------------------------------------------- booleans

@pytest.mark.parametrize("text", ["1", "true", "True", "TRUE", "yes", "Yes", "on", "ON", "y", "t", " on ",
                                  "2", "17", "+3", "007"])
def test_bool_true_spellings(text):
    assert parse_bool(text) is True
    s = load_settings({"PERSEUS_ELASTIC": text})
    assert s.elastic is True and s.is_explicit("elastic")


@pytest.mark.parametrize("text", ["0", "false", "False", "FALSE", "no", "NO", "off", "Off", "n", "f", " 0 ",
                                  "-1", "-5", "00"])
def test_bool_false_spellings(text):
    assert parse_bool(text) is False
    s = load_settings({"PERSEUS_ABORT_ON_EXCEPTION": text})  # default True
    assert s.abort_on_exception is False and s.is_explicit("abort_on_exception")


@pytest.mark.parametrize("text", ["maybe", "2.5", "tru", "enable", "1 0", "0x1", "yess"])
def test_bool_garbage_is_a_clear_error(text):
    with pytest.raises(ValueError) as info:
        parse_bool(text)
    assert repr(text) in str(info.value)
    with pytest.raises(ValueError) as info:
        load_settings({"PERSEUS_STALL_CHECK_DISABLE": text})
    msg = str(info.value)
    assert "PERSEUS_STALL_CHECK_DISABLE" in msg
    assert repr(text) in msg
    assert "true/false" in msg


@pytest.mark.parametrize("var,text", [("HOROVOD_ELASTIC", "maybe"), ("HOROVOD_FUSION_THRESHOLD", "4MB"),
                                      ("HOROVOD_LOG_LEVEL", "verbose")])
def test_garbage_through_horovod_name_names_that_variable(var, text):
    with pytest.raises(ValueError) as info:
        load_settings({var: text})
    assert var in str(info.value)


@pytest.mark.parametrize("var,text", [("PERSEUS_FUSION_THRESHOLD", "4MB"), ("PERSEUS_FUSION_THRESHOLD", "1.5"),
                                      ("PERSEUS_NUM_CHANNELS", "two"), ("PERSEUS_CYCLE_TIME", "fast"),
                                      ("PERSEUS_STALL_CHECK_TIME_SECONDS", "1s")])
def test_number_garbage_is_a_clear_error(var, text):
    with pytest.raises(ValueError) as info:
        load_settings({var: text})
    assert var in str(info.value)
    assert text in str(info.value)


# ----------------------------------------------------------------------------- choices

@pytest.mark.parametrize("level", ["trace", "debug", "info", "warning", "error", "fatal"])
def test_log_level_choices_accepted(level):
    s = load_settings({"PERSEUS_LOG_LEVEL": level})
    assert s.log_level == level
    s = load_settings({"HOROVOD_LOG_LEVEL": level})
    assert s.log_level == level


def test_log_level_case_insensitive_and_stripped():
    s = load_settings({"PERSEUS_LOG_LEVEL": " DEBUG "})
    assert s.log_level.lower() == "debug"


@pytest.mark.parametrize("text", ["verbose", "warn", "0", "debugging"])
def test_log_level_rejects_other_values(text):
    with pytest.raises(ValueError) as info:
        load_settings({"PERSEUS_LOG_LEVEL": text})
    msg = str(info.value)
    assert "PERSEUS_LOG_LEVEL" in msg and repr(text) in msg
    for choice in ("trace", "debug", "info", "warning", "error", "fatal"):
        assert choice in msg


# ----------------------------------------------------------------------------- overrides

def test_overrides_by_knob_name_win_over_environment():
    s = load_settings({"PERSEUS_FUSION_THRESHOLD": "100", "HOROVOD_CYCLE_TIME": "9"},
                      fusion_threshold_bytes=5, num_channels=4)
    assert s.fusion_threshold_bytes == 5
    assert s.num_channels == 4
    assert s.cycle_time_ms == 9.0
    assert s.is_explicit("fusion_threshold_bytes") and s.is_explicit("num_channels")
    assert s.is_explicit("cycle_time_ms")
    assert not s.is_explicit("stall_check_time_s")


def test_unknown_override_raises_key_error_listing_known_names():
    with pytest.raises(KeyError) as info:
        load_settings({}, fusion_threshold=5)
    text = str(info.value)
    assert "'fusion_threshold'" in text
    for k in KNOBS:
        assert k.name in text


# ----------------------------------------------------------------------------- Settings

def test_settings_rejects_unknown_attributes():
    s = load_settings({})
    with pytest.raises(AttributeError) as info:
        s.fusion_threshold  # noqa: B018
    assert "fusion_threshold" in str(info.value)
    with pytest.raises(AttributeError):
        s.no_such_setting = 1
    assert "no_such_setting" not in s.as_dict()
    assert not hasattr(s, "cycle_time")
    with pytest.raises(AttributeError):
        getattr(s, "HOROVOD_CYCLE_TIME")


def test_settings_known_attributes_can_be_set():
    s = load_settings({})
    s.fusion_threshold_bytes = 123
    assert s.fusion_threshold_bytes == 123
    assert s.as_dict()["fusion_threshold_bytes"] == 123
    assert not s.is_explicit("fusion_threshold_bytes")  # set in code, not by the user's environment


def test_settings_as_dict_is_a_copy_and_independent_instances():
    s1, s2 = load_settings({}), load_settings({})
    d = s1.as_dict()
    d["num_channels"] = 99
    assert s1.num_channels == 0
    s1.num_channels = 5
    assert s2.num_channels == 0


def test_settings_direct_construction():
    s = Settings({"a": 1}, frozenset({"a"}))
    assert s.a == 1 and s.is_explicit("a") and not s.is_explicit("b")
    with pytest.raises(AttributeError):
        s.b  # noqa: B018
    with pytest.raises(AttributeError):
        s.b = 2
    assert "a" in repr(s)


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_settings_can_be_copied(how):
    import copy
    import pickle

    s = load_settings({"PERSEUS_NUM_CHANNELS": "3"})
    dup = {"copy": copy.copy, "deepcopy": copy.deepcopy,
           "pickle": lambda x: pickle.loads(pickle.dumps(x))}[how](s)
    assert dup.num_channels == 3 and dup.is_explicit("num_channels")


def test_is_explicit_for_unknown_name_is_false():
    s = load_settings({"PERSEUS_ELASTIC": "1"})
    assert s.is_explicit("elastic")
    assert not s.is_explicit("PERSEUS_ELASTIC")
    assert not s.is_explicit("unknown")


def test_reset_limit_parsing_and_read_knob():
    assert parse_reset_limit(" None ") is None and parse_reset_limit("unlimited") is None
    assert parse_reset_limit("0") == 0 and parse_reset_limit("12") == 12
    for bad in ("-1", "three", "1.5"):
        with pytest.raises(ValueError, match="integer >= 0"):
            parse_reset_limit(bad)
    assert read_knob("elastic_reset_limit", {}) == (3, False)
    assert read_knob("elastic_reset_limit", {"PERSEUS_ELASTIC_RESET_LIMIT": "none"}) == (None, True)
    with pytest.raises(ValueError, match="PERSEUS_ELASTIC_RESET_LIMIT"):
        read_knob("elastic_reset_limit", {"PERSEUS_ELASTIC_RESET_LIMIT": "x"})


def test_common_util_env_sets_and_restores_through_knobs(monkeypatch):
    import os

    from perseus.base.util import env

    monkeypatch.delenv("PERSEUS_TEST_A", raising=False)
    monkeypatch.setenv("PERSEUS_TEST_B", "b")
    with env(PERSEUS_TEST_A=1, PERSEUS_TEST_B="x", PERSEUS_TEST_C=None):
        assert os.environ["PERSEUS_TEST_A"] == "1" and os.environ["PERSEUS_TEST_B"] == "x"
        assert "PERSEUS_TEST_C" not in os.environ
    assert "PERSEUS_TEST_A" not in os.environ and os.environ["PERSEUS_TEST_B"] == "b"


def test_only_knobs_and_the_launcher_touch_the_environment():
    # Settings are declared once: every read of the process environment goes through perseus.base.knobs.
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "perseus"
    # The launcher's own files (they build the ranks' and the keepers' environments).
    allowed = {"base/knobs.py", "runner/launch.py", "runner/mpi_run.py", "runner/elastic_run.py",
               "runner/elastic/keeper_process.py", "runner/remote/job.py", "runner/remote/service.py"}
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if re.search(r"os\.environ|os\.getenv|os\.putenv", p.read_text())
                 and str(p.relative_to(root)) not in allowed]
    assert offenders == [], f"read or write the environment through perseus.base.knobs: {offenders}"
