"""Unit tests of the engine's settings (perseus.engine.settings): the table, the generated native/settings.h,
the core's bound Settings struct, and how resolved knobs fill it."""

from __future__ import annotations

import importlib.util
import os
import types

import pytest

from perseus.base.knobs import knob, load_settings
from perseus.engine.settings import (ENGINE_FIELDS, ENGINE_SETTINGS, allreduce_algorithm, engine_values,
                                     interface_names)

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generator():
    spec = importlib.util.spec_from_file_location("gen_settings", os.path.join(ROOT, "tools", "gen_settings.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def core():
    from perseus.engine.native import load_core

    return load_core()


# ----------------------------------------------------------------------------- the table and the header

def test_committed_header_is_what_the_generator_writes():
    with open(os.path.join(ROOT, "native", "settings.h")) as f:
        committed = f.read()
    assert committed == generator().render(), \
        "native/settings.h differs from the table: run python tools/gen_settings.py and commit the header"


def test_table_names_real_knobs_and_unique_fields():
    names = [f.name for f in ENGINE_FIELDS]
    assert len(names) == len(set(names))
    for name in ENGINE_SETTINGS:
        knob(name)  # KeyError for a knob that does not exist
    assert "hierarchical_allreduce" in ENGINE_SETTINGS  # read through the algorithm
    for f in ENGINE_FIELDS:
        assert f.knobs or f.default is not None, f"{f.name}: a per-rank field needs a default"


def test_generated_defaults_follow_the_knobs():
    text = generator().render()
    assert f"int64_t fusion_threshold_bytes = {knob('fusion_threshold_bytes').default >> 20} << 20;" in text
    assert f"double stall_shutdown_time_s = {float(knob('stall_shutdown_time_s').default)!r};" in text
    assert "bool track_steps = false;  // knob autotune" in text
    assert "Algorithm algorithm = Algorithm::AUTO;" in text
    assert "int cpu_core = -1;" in text


# ----------------------------------------------------------------------------- resolving knobs

def test_hierarchical_allreduce_turns_only_auto_into_hierarchical():
    def algorithm(name, hierarchical):
        return allreduce_algorithm(types.SimpleNamespace(allreduce_algorithm=name,
                                                         hierarchical_allreduce=hierarchical))

    assert algorithm("auto", True) == "hierarchical"
    assert algorithm("ring", True) == "ring"
    assert algorithm("auto", False) == "auto"
    assert algorithm("RING", False) == "ring"  # the knob accepts any case
    with pytest.raises(ValueError, match="allreduce_algorithm: unexpected value 'bogus'"):
        algorithm("bogus", False)


def test_interface_names():
    assert interface_names("") == []
    assert interface_names("eth0") == ["eth0"]
    assert interface_names(" eth0, ib0 ,,lo ") == ["eth0", "ib0", "lo"]


def test_engine_values_from_environment():
    settings = load_settings({"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_AUTOTUNE": "1",
                              "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "PERSEUS_NETWORK_INTERFACE": "eth0,lo"})
    values = engine_values(settings, host_key=4)
    assert set(values) == {f.name for f in ENGINE_FIELDS}
    assert values["fusion_threshold_bytes"] == 1024
    assert values["track_steps"] is True
    assert values["algorithm"] == "hierarchical"
    assert values["network_interfaces"] == ["eth0", "lo"]
    assert values["host_key"] == 4 and values["cpu_core"] == -1
    with pytest.raises(TypeError, match="num_channels"):
        engine_values(settings, num_channels=3)  # from a knob, not per rank


def test_bad_environment_values_fail_while_loading():
    with pytest.raises(ValueError, match="PERSEUS_ALLREDUCE_ALGORITHM"):
        load_settings({"PERSEUS_ALLREDUCE_ALGORITHM": "bogus"})
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD"):
        load_settings({"HOROVOD_FUSION_THRESHOLD": "many"})


# ----------------------------------------------------------------------------- the core's struct

def test_bound_struct_has_every_field_with_the_header_defaults():
    c = core()
    from perseus.engine.native import core_settings

    blank = c.Settings()
    filled = core_settings(c, load_settings({}))
    for f in ENGINE_FIELDS:
        assert getattr(blank, f.name) == getattr(filled, f.name), f.name


def test_core_settings_types_and_errors():
    c = core()
    from perseus.engine.native import core_settings

    s = core_settings(c, load_settings({"PERSEUS_ALLREDUCE_ALGORITHM": "ring", "PERSEUS_NUM_CHANNELS": "3"}),
                      host_key=2, cpu_core=1)
    assert s.algorithm == c.Algorithm.RING and s.num_channels == 3 and s.host_key == 2 and s.cpu_core == 1
    with pytest.raises(TypeError, match="perseus setting fusion_threshold_bytes: 'x'"):
        core_settings(c, load_settings({}, fusion_threshold_bytes="x"))
    with pytest.raises(ValueError, match="allreduce_algorithm"):
        core_settings(c, load_settings({}, allreduce_algorithm="fastest"))
