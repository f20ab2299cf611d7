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
