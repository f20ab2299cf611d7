"""``plan/partition.py``: properties of the plan, on tree shapes drawn by hypothesis (shapes only: nothing is
computed).
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import optax
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_mlp._src.plan import partition

shapes = st.lists(st.integers(1, 40), min_size=0, max_size=3).map(tuple)
trees = st.recursive(
    shapes.map(lambda s: jax.ShapeDtypeStruct(s, np.float32)),
    lambda children: st.dictionaries(st.sampled_from("abcdefgh"), children, min_size=1, max_size=4),
    max_leaves=24,
).filter(lambda t: len(jax.tree.leaves(t)) > 0)


@settings(max_examples=40, deadline=None)
@given(tree=trees, subgroup_size=st.integers(256, 16384), master=st.booleans())
def test_every_row_of_every_leaf_is_in_exactly_one_subgroup(tree, subgroup_size, master):
    inner = optax.adam(1e-3)
    plan = partition.make_plan(tree, inner, subgroup_size, np.dtype(np.float32) if master else None)
    covered = {i: [] for i in range(len(plan.leaves))}
    for subgroup in plan.subgroups:
        leaves = [p.leaf for p in subgroup.pieces]
        assert len(leaves) == len(set(leaves)), "a leaf appears once per subgroup"
        for piece in subgroup.pieces:
            covered[piece.leaf].append(piece.rows)
        nbytes = subgroup.layout.nbytes
        ends = [f.offset + f.nbytes for f in (*subgroup.layout.state_fields, *subgroup.layout.master_fields)]
        assert max(ends, default=0) <= nbytes
        assert all(f.offset % partition.ALIGN == 0 for f in subgroup.layout.state_fields)
    for index, rows in covered.items():
        spec = plan.leaves[index]
        if rows == [None]:
            continue
        assert None not in rows
        assert rows[0][0] == 0 and rows[-1][1] == spec.shape[0]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))
    # Every non-scalar state leaf of the whole tree is in exactly one record (scalars such as
    # adam's count are repeated per subgroup).
    total_state = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(jax.eval_shape(inner.init, tree)) if x.ndim)
    state_in_records = sum(f.nbytes for sg in plan.subgroups for f in sg.layout.state_fields if len(f.shape) > 0)
    assert state_in_records == total_state


def test_the_layout_hash_depends_on_the_plan():
    tree = {"w": jax.ShapeDtypeStruct((64, 32), np.float32), "b": jax.ShapeDtypeStruct((32,), np.float32)}
    inner = optax.adam(1e-3)
    base = partition.make_plan(tree, inner, 4096).layout_hash
    assert partition.make_plan(tree, inner, 4096).layout_hash == base
    assert partition.make_plan(tree, inner, 2048).layout_hash != base
    assert partition.make_plan(tree, inner, 4096, np.dtype(np.float32)).layout_hash != base
    assert partition.make_plan(tree, optax.sgd(1e-3), 4096).layout_hash != base


def _layers(count: int, width: int = 16) -> dict:
    return {f"l{i}": {"w": jax.ShapeDtypeStruct((width, width), np.float32)} for i in range(count)}


def _names(plan) -> list[set[str]]:
    return [{plan.leaves[piece.leaf].path for piece in sg.pieces} for sg in plan.subgroups]


def test_subgroups_hold_neighbouring_layers_as_users_number_them():
    # 12 layers of 1 KiB params, 3 KiB of adam state: 3 a subgroup. Flattening sorts the keys as strings
    # (l0, l1, l10, l11, l2, ...); the natural order puts l2 before l10, so a subgroup's grads arrive together.
    tree, inner = _layers(12), optax.adam(1e-3)
    natural = partition.make_plan(tree, inner, 3 * 2 * 1024 + 512)
    assert _names(natural) == [{f"['l{i}']['w']" for i in range(k, k + 3)} for k in range(0, 12, 3)]
    # Within a subgroup the pieces keep the tree's order, which its view (the optimizer's tree) has.
    assert all(list(sg.pieces) == sorted(sg.pieces, key=lambda piece: piece.leaf) for sg in natural.subgroups)
    legacy = partition.make_plan(tree, inner, 3 * 2 * 1024 + 512, leaf_order="tree")
    assert _names(legacy)[0] == {"['l0']['w']", "['l1']['w']", "['l10']['w']"}
    assert (natural.leaf_order, legacy.leaf_order) == ("natural", "tree")
    assert natural.layout_hash != legacy.layout_hash
    # Where both orders agree, so does the layout: runs of names without numbers resume as before.
    few = _layers(3)
    assert (
        partition.make_plan(few, inner, 4096).layout_hash
        == partition.make_plan(few, inner, 4096, leaf_order="tree").layout_hash
    )


def test_the_natural_order_compares_every_number_in_a_path():
    paths = ["['Dense_10']['kernel']", "['Dense_2']['bias']", "['Dense_2']['kernel']", "['Dense_9']['kernel']"]
    assert sorted(paths, key=partition._natural_key) == [paths[1], paths[2], paths[3], paths[0]]
    assert sorted(["[3][12]", "[3][2]", "[10][0]"], key=partition._natural_key) == ["[3][2]", "[3][12]", "[10][0]"]
