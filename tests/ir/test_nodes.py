"""IR nodes (flexspec.ir.nodes): what the runtime's caches rely on, a spec's IR hashed once and
its hash never carried into a copy made in another process."""

import os
import pickle
import subprocess
import sys

import flexspec

SPEC = "causal & window(3) + alibi"


def test_the_hash_of_an_ir_is_its_value_and_stays_out_of_a_pickle():
    spec = flexspec.parse(SPEC).ir
    assert hash(spec) == hash(spec) == hash(flexspec.parse(SPEC).ir)
    copy = pickle.loads(pickle.dumps(spec))
    assert copy == spec and hash(copy) == hash(spec)
    assert b"_hash" not in pickle.dumps(spec)


def test_an_ir_pickled_in_one_process_is_found_by_value_in_another():
    """String hashes differ between processes (PYTHONHASHSEED): a hash carried in the pickle
    would make the copy miss every cache keyed by an equal IR."""
    spec = flexspec.parse(SPEC).ir
    hash(spec), hash(spec.mask)  # the mask's nodes keep their hashes too
    code = ("import pickle, sys, flexspec\n"
            "spec, mask = pickle.loads(sys.stdin.buffer.read())\n"
            f"here = flexspec.parse({SPEC!r}).ir\n"
            "print({here: 'found'}.get(spec, 'missed'),\n"
            "      {here.mask: 'found'}.get(mask, 'missed'))\n")
    result = subprocess.run([sys.executable, "-c", code], input=pickle.dumps((spec, spec.mask)),
                            capture_output=True, env={**os.environ, "PYTHONHASHSEED": "12345"},
                            check=True)
    assert result.stdout.decode().split() == ["found", "found"]


def test_a_node_keeps_its_hash_which_is_its_value_and_stays_out_of_copies():
    """The block-mask cache keys every plan by the mask (a growing cache plans at every step):
    each node's hash is computed once, equals that of an equal node made anew, and a pickle or
    a deep copy does not carry it. Const keeps True and 1 apart."""
    import copy

    from flexspec import ir
    mask = flexspec.parse(SPEC).ir.mask
    assert hash(mask) == hash(mask) == hash(flexspec.parse(SPEC).ir.mask)
    assert all("_hash" in node.__dict__ for node in ir.walk(mask))
    assert b"_hash" not in pickle.dumps(mask)
    for other in (pickle.loads(pickle.dumps(mask)), copy.deepcopy(mask)):
        assert "_hash" not in other.__dict__ and other == mask and hash(other) == hash(mask)
    assert ir.Const(True) != ir.Const(1) and {ir.Const(True): 0}.get(ir.Const(1)) is None


def test_the_tensors_of_an_ir_are_listed_once_and_stay_out_of_a_pickle():
    """Planning asks a spec for its tensors several times per call (a growing cache plans at
    every step): the list is made once, handed out as a new list each time, and not pickled."""
    spec = flexspec.parse("causal & doc + alibi + head_bias").ir
    first = spec.tensors()
    assert [t.name for t in first] == ["doc_ids", "alibi_slopes", "bias"]
    first.append("something")  # the caller's list, not the spec's
    assert spec.tensors() == first[:-1] and spec.tensors() is not spec.tensors()
    assert [t.name for t in spec.bindings()] == ["doc_ids", "bias"]
    assert b"_tensors" not in pickle.dumps(spec)
    copy = pickle.loads(pickle.dumps(spec))
    assert copy == spec and copy.tensors() == spec.tensors()
