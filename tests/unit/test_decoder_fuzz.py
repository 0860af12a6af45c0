"""The engine's decoders of what ranks send each other (native/control.cc: control messages; native/negotiation.cc:
negotiation payloads; both over native/codec.h's Reader) on random, truncated and mutated input: a valid message
decodes to its fields, anything else raises RuntimeError (the engine's TransportError), never a crash, a
MemoryError or a hang.

The batches run in child processes (tests/unit/decoder_fuzz_child.py) through the test hook
``perseus._core._decode_for_test``, so that a crash fails its test with the child's faulthandler report instead
of killing pytest. PERSEUS_TEST_FUZZ_SCALE=N multiplies the number of examples (default 1).
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCALE = int(os.environ.get("PERSEUS_TEST_FUZZ_SCALE", "1"))

#: batch -> hypothesis examples (each example decodes one or more inputs; the child counts the inputs)
BATCHES = {"valid": 300, "random": 3000, "truncated": 200, "mutated": 1500, "lying_counts": 1}


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_decoders_never_crash(batch):
    examples = BATCHES[batch] * (SCALE if batch != "lying_counts" else 1)
    done = subprocess.run([sys.executable, "-X", "faulthandler", str(HERE / "decoder_fuzz_child.py"), batch,
                           str(examples)], cwd=REPO, capture_output=True, text=True, timeout=540,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}\n{done.stderr}"
    tried = int(re.search(r"tried (\d+)", done.stdout).group(1))
    assert tried >= examples, done.stdout
    print(f"{batch}: {tried} inputs")


@pytest.fixture(scope="module")
def core():
    from perseus.engine.native import load_core

    return load_core()


def _entry(name: bytes, op_type: int, dtype: int, shape=(), count=None) -> bytes:
    head = struct.pack("=I", len(name)) + name + struct.pack("=iiI", op_type, dtype,
                                                              len(shape) if count is None else count)
    return head + b"".join(struct.pack("=q", d) for d in shape) + struct.pack("=iiddii", 1, -1, 1.0, 1.0, 0, -1)


def test_hook_decodes_valid_messages(core):
    assert core._decode_for_test("control", b"w" + struct.pack("=q", 7)) == ("wake", 7)
    assert core._decode_for_test("control", b"a" + struct.pack("=iI", 2, 4) + b"boom") == ("abort", 2, b"boom")
    one = struct.pack("=BI", 0, 1) + _entry(b"allreduce.w", 0, 7, (2, 3))
    assert core._decode_for_test("negotiation", one) == ([b"allreduce.w"], [])
    other = struct.pack("=BI", 0, 1) + _entry(b"allreduce.w", 0, 3, (2, 3))
    ready, errors = core._decode_for_test("negotiation", [one, other])
    assert ready == [] and "dtype int32" in errors[0][1].decode() and "float32" in errors[0][1].decode()
    with pytest.raises(ValueError, match="kind must be"):
        core._decode_for_test("other", b"")


@pytest.mark.parametrize("op_type, dtype", [(7, 7), (-1, 7), (0, 11), (0, -5)])
def test_unknown_collective_or_dtype_is_refused(core, op_type, dtype):
    # An unknown dtype would index the engine's item-size table out of bounds once the name was ready.
    data = struct.pack("=BI", 0, 1) + _entry(b"allreduce.w", op_type, dtype)
    with pytest.raises(RuntimeError, match="unknown collective .* or dtype"):
        core._decode_for_test("negotiation", data)


def test_a_count_the_message_cannot_hold_is_refused(core):
    # A shape count was trusted: 2**32 - 1 dimensions were 32 GiB allocated and zeroed before the next read
    # failed (the lying_counts batch tries that one, in a child process); 2**24 here costs 128 MiB at worst.
    data = struct.pack("=BI", 0, 1) + _entry(b"allreduce.w", 0, 7, (), count=1 << 24)
    with pytest.raises(RuntimeError, match="cannot hold"):
        core._decode_for_test("negotiation", data)
    answer = b"s" + struct.pack("=qBqI", 1, 0, 2, 0xFFFFFFFF)
    with pytest.raises(RuntimeError, match="cannot hold"):
        core._decode_for_test("control", answer)
