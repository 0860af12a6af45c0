"""The layering and size rules docs/architecture.md states, checked on every run.

tools/import_graph.py: no cycle between files of perseus/ or native/ (except those it allows, with the
reason docs/architecture.md gives), no import from a lower layer to a higher one, no import of a perseus
module hidden inside a function, no folder mixing layers, no cycle between packages.
tools/function_lengths.py: no function over 80 lines except the table-like ones it lists, no source file in
perseus/ or native/ (tests included) over 500 lines except the generated ones it lists.
tools/broad_catches.py: no broad exception handler (``except Exception``, ``catch (...)``) that
neither re-raises nor says why swallowing is safe.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("tool", ["import_graph.py", "function_lengths.py", "broad_catches.py"])
def test_structure_rules_hold(tool):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"tools/{tool} --check:\n{proc.stdout}{proc.stderr}"


def test_import_graph_finds_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: a planted cycle and a planted upward import are reported."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import import_graph
    finally:
        sys.path.pop(0)
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.sccs(graph) == [["a", "b", "c"]]
    assert import_graph.layer_of("perseus.base.exceptions") < import_graph.layer_of("perseus.autotune.tuner")
    assert import_graph.layer_of("perseus.runtime.state") < import_graph.layer_of("perseus.elastic.worker")


def test_function_lengths_counts_cpp_and_python(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import function_lengths
    finally:
        sys.path.pop(0)
    cc = tmp_path / "x.cc"
    cc.write_text('namespace n {\nint f(int a) {\n  if (a) {\n    return 1;  // }\n  }\n  return "}" [0];\n}\n'
                  'struct S {\n  void g() const { }\n};\n}  // namespace n\n')
    found = {name: length for name, _, length in function_lengths.cpp_functions(str(cc))}
    assert found == {"f": 6, "g": 1}
    py = tmp_path / "x.py"
    py.write_text("def f():\n    def g():\n        pass\n    return g\n")
    assert {n: l for n, _, l in function_lengths.python_functions(str(py))} == {"f": 4, "g": 2}


def test_broad_catches_finds_silent_handlers(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import broad_catches
    finally:
        sys.path.pop(0)
    py = tmp_path / "m.py"
    py.write_text("try:\n    f()\nexcept Exception:  # noqa: BLE001\n    pass\n"       # lint marker only: found
                  "try:\n    f()\nexcept BaseException:\n    cleanup()\n    raise\n"   # re-raises: fine
                  "try:\n    f()\nexcept (OSError, Exception):  # noqa: BLE001 - why\n    pass\n"  # a reason
                  "try:\n    f()\nexcept:\n    pass\n"                                  # bare: found
                  "try:\n    f()\nexcept ValueError:\n    pass\n")                     # narrow: fine
    assert [line for line, _ in broad_catches.python_findings(str(py))] == [3, 16]
    cc = tmp_path / "m.cc"
    cc.write_text("void f() {\n  try { g(); } catch (...) {\n  }\n"
                  "  try { g(); } catch (...) {\n    undo();\n    throw;\n  }\n"
                  "  try { g(); } catch (const std::exception&) {  // why\n  }\n}\n")
    assert [line for line, _ in broad_catches.cpp_findings(str(cc))] == [2]
