"""Fuzz batches for test_decoder_fuzz.py, run in a child process (a crash then fails one test instead of
killing pytest): ``python -X faulthandler decoder_fuzz_child.py BATCH EXAMPLES``.

Feeds perseus._core._decode_for_test (the engine's decoders of control messages and negotiation payloads)
random bytes, truncated and mutated valid messages, and messages whose counts and lengths lie. Every input
must decode (valid input: to the fields it was built from) or raise RuntimeError (the engine's
TransportError); anything else fails the batch. Prints ``tried N`` on success.
"""

from __future__ import annotations

import struct
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perseus.engine.native import load_core

CORE = load_core()
TRIED = [0]
INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
INT32 = st.integers(-(1 << 31), (1 << 31) - 1)
NAME = st.binary(max_size=24)


# -- valid messages, built as the engine writes them (native byte order; strings: uint32 length + bytes) --------
def _str(b: bytes) -> bytes:
    return struct.pack("=I", len(b)) + b


def control(kind, *fields) -> bytes:
    if kind == "wake":
        return b"w" + struct.pack("=q", fields[0])
    if kind == "probe":
        return b"p" + struct.pack("=q", fields[0])
    if kind == "answer":
        ident, joined, rnd, pending, where = fields
        return (b"s" + struct.pack("=qBqI", ident, int(joined), rnd, len(pending)) + b"".join(map(_str, pending))
                + _str(where))
    if kind == "abort":
        return b"a" + struct.pack("=i", fields[0]) + _str(fields[1])
    return b"x"


def signature(op_type, dtype, shape, reduce_op, root, pre, post, priority, device) -> bytes:
    return (struct.pack("=iiI", op_type, dtype, len(shape)) + b"".join(struct.pack("=q", d) for d in shape)
            + struct.pack("=iiddii", reduce_op, root, pre, post, priority, device))


def payload(joined, entries) -> bytes:
    return struct.pack("=BI", int(joined), len(entries)) + b"".join(_str(n) + signature(*s) for n, s in entries)


CONTROL = st.one_of(
    st.tuples(st.just("wake"), INT64), st.tuples(st.just("probe"), INT64),
    st.tuples(st.just("answer"), INT64, st.booleans(), INT64, st.lists(NAME, max_size=4), NAME),
    st.tuples(st.just("abort"), INT32, st.binary(max_size=40)), st.tuples(st.just("shutdown")))
SIGNATURE = st.tuples(st.integers(0, 6), st.integers(0, 10), st.lists(st.integers(0, 1 << 20), max_size=4),
                      st.integers(0, 5), st.integers(-1, 3), st.floats(allow_nan=False), st.floats(allow_nan=False),
                      st.integers(-2, 2), st.integers(-1, 1))
PAYLOAD = st.tuples(st.booleans(), st.lists(st.tuples(st.sampled_from([b"a", b"b", b"allreduce.w"]), SIGNATURE),
                                            max_size=4))


# -- mutations ---------------------------------------------------------------------------------------------------
@st.composite
def mutated(draw, valid: bytes) -> bytes:
    """``valid`` with a few bytes overwritten, inserted or deleted, or a uint32 planted where a count or a
    length may be read (a large one: the decoder must not trust it)."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["set", "insert", "delete", "count"]))
        at = draw(st.integers(0, len(data)))
        if how == "set" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif how == "delete" and at < len(data):
            del data[at:at + draw(st.integers(1, 4))]
        elif how == "count":
            big = draw(st.sampled_from([0xFFFFFFFF, 0x7FFFFFFF, 0x10000000, 1 << 20, 255]))
            data[at:at + 4] = struct.pack("=I", big)
    return bytes(data)


def decode(kind, data):
    """Decode; return the fields, or None when the decoder raised RuntimeError. Anything else propagates."""
    TRIED[0] += 1
    try:
        return CORE._decode_for_test(kind, data)
    except RuntimeError as exc:
        assert str(exc).startswith("perseus: "), exc
        return None


# -- batches -------------------------------------------------------------------------------------------------------
def batch_valid_roundtrip(n):
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(CONTROL, st.lists(PAYLOAD, min_size=1, max_size=3))
    def run(fields, payloads):
        got = decode("control", control(*fields))
        want = tuple(list(f) if isinstance(f, list) else f for f in fields)
        assert got == want, (got, want)
        ready, errors = decode("negotiation", [payload(*p) for p in payloads])
        # A name every rank sent with one signature (active ranks: not joined) comes back ready or as an error.
        assert isinstance(ready, list) and isinstance(errors, list)
    run()


def batch_random(n):
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(["control", "negotiation"]), st.binary(max_size=200))
    def run(kind, data):
        decode(kind, data)
    run()


def batch_truncated(n):
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(CONTROL, PAYLOAD)
    def run(fields, p):
        for kind, valid in (("control", control(*fields)), ("negotiation", payload(*p))):
            for cut in range(len(valid)):  # every proper prefix must be refused
                assert decode(kind, valid[:cut]) is None, (kind, valid[:cut])
    run()


def batch_mutated(n):
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data(), CONTROL, st.lists(PAYLOAD, min_size=1, max_size=3))
    def run(data, fields, payloads):
        decode("control", data.draw(mutated(control(*fields))))
        decode("negotiation", [data.draw(mutated(payload(*p))) for p in payloads])
    run()


def batch_lying_counts(n):
    """Every 4-byte window of valid messages replaced by a large count or length (deterministic): the
    decoder must refuse it without allocating what the count asks for."""
    messages = [("control", control("answer", 1, False, 2, [b"a", b"bc"], b"where")),
                ("control", control("abort", 3, b"text")),
                ("negotiation", payload(False, [(b"a", (0, 7, [2, 3], 1, -1, 1.0, 1.0, 0, -1)),
                                                (b"b", (1, 4, [5], 0, 0, 2.0, 0.5, 1, -1))]))]
    for kind, valid in messages:
        for at in range(len(valid) - 3):
            for big in (0xFFFFFFFF, 0x80000000, 0x10000000, 0x01000000):
                data = valid[:at] + struct.pack("=I", big) + valid[at + 4:]
                decode(kind, data)


BATCHES = {"lying_counts": batch_lying_counts, "valid": batch_valid_roundtrip, "random": batch_random, "truncated": batch_truncated,
           "mutated": batch_mutated}

if __name__ == "__main__":
    BATCHES[sys.argv[1]](int(sys.argv[2]))
    print(f"tried {TRIED[0]}", flush=True)
