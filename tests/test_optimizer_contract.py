"""The optimizer contract: every optimizer in optax's own test-suite lists is exact through mlp_offload, or refused.

The lists are read from the installed optax, so a new optax release brings its new optimizers here.
Each runs a few steps through ``mlp_offload`` on a tree of several subgroups, with one leaf split
into row chunks unless its optimizer keeps it whole, and is compared with the same optimizer in
memory: the params, and the displacement ``p - p0`` so that tiny steps are seen too. An optimizer
that cannot be exact must be refused at ``init``, before anything is written, with the remedy.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_close_to_optax, scale_by_global_norm

import jax_mlp
from jax_mlp._src.plan import partition

_LISTS = (
    ("_src/alias_test.py", "_OPTIMIZERS_UNDER_TEST"),
    ("contrib/_common_test.py", "_MAIN_OPTIMIZERS_UNDER_TEST"),
)
SHAPES = {"big": (40, 6), "w": (6, 5), "b": (5,), "u": (3, 4)}  # "big" exceeds the subgroup size
SUBGROUP_SIZE = 512
WHOLE_LEAF_SIZE = 128  # below the state of "big" for each row-coupled optimizer (adafactor's is factored)
STEPS = 3


def _listed(file: str, name: str) -> list[dict]:
    """The dicts assigned or appended (``+=``) to ``name`` in an optax test module, read without importing it.

    Importing the test modules would need their test-only dependencies; the lists are literals.
    """
    tree = ast.parse((pathlib.Path(optax.__file__).parent / file).read_text())
    entries: list[dict] = []
    for node in ast.walk(tree):
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        target = node.target if isinstance(node, ast.AugAssign) else target
        if isinstance(target, ast.Name) and target.id == name and isinstance(node.value, (ast.List, ast.Tuple)):
            entries += ast.literal_eval(node.value)
    return entries


def _case_id(case: dict) -> str:
    kwargs = ",".join(f"{k}={v}" for k, v in case["opt_kwargs"].items())
    wrapper = case.get("wrapper_name")
    return f"{case['opt_name']}({kwargs})" + (f"+{wrapper}" if wrapper else "")


CASES = [case for file, name in _LISTS for case in _listed(file, name)]


def _optimizer(case: dict) -> optax.GradientTransformation:
    """The optimizer of a case, built as optax's tests build it."""
    name = case["opt_name"]
    factory = getattr(optax.contrib, name) if hasattr(optax.contrib, name) else getattr(optax, name)
    opt = factory(**case["opt_kwargs"])
    wrapper = case.get("wrapper_name")
    if wrapper == "reduce_on_plateau":
        return optax.chain(opt, optax.contrib.reduce_on_plateau(**case["wrapper_kwargs"]))
    if wrapper is not None:
        return getattr(optax.contrib, wrapper)(opt, **case["wrapper_kwargs"])
    return opt


def _problem() -> tuple[Any, Any]:
    """Initial params and a quadratic loss on them, with a different minimum per leaf."""
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * len(SHAPES))
    params = {n: 0.5 * jax.random.normal(k, s) for (n, s), k in zip(SHAPES.items(), keys[::2], strict=True)}
    targets = {n: jax.random.normal(k, s) for (n, s), k in zip(SHAPES.items(), keys[1::2], strict=True)}

    def loss(p: Any) -> jax.Array:
        return sum(jnp.sum((p[n] - targets[n]) ** 2 * (1 + i)) for i, n in enumerate(sorted(p)))

    return params, loss


def _steps(tx: optax.GradientTransformation, state: Any, params: Any, loss: Any, steps: int) -> tuple[Any, Any]:
    for _ in range(steps):
        value, grads = jax.value_and_grad(loss)(params)
        # As optax's own tests do, every optimizer is given the loss; those that do not take it ignore it.
        updates, state = tx.update(grads, state, params, value=value)
        params = optax.apply_updates(params, updates)
    return params, state


def _train(tx: optax.GradientTransformation, state: Any, params: Any, loss: Any) -> Any:
    return _steps(tx, state, params, loss, STEPS)[0]


def _reason(error: jax_mlp.OffloadError) -> str:
    """The refusal's gist, for the table in docs/faq.md."""
    message = str(error)
    if isinstance(error, jax_mlp.CoupledOptimizerError):
        return re.split(r":(?!\d)", message)[0].removeprefix("the inner optimizer ")
    return message.split(";")[0].split(", so")[0]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_each_listed_optimizer_is_exact_or_refused(case, tmp_path):
    params, loss = _problem()
    tx = jax_mlp.mlp_offload(
        _optimizer(case),
        paths=tmp_path,
        host_cache=0,
        write_depth=1,
        subgroup_size=SUBGROUP_SIZE,
        extra_args={"value": jax.ShapeDtypeStruct((), jnp.float32)},
    )
    try:
        state = tx.init(params)
    except jax_mlp.OffloadError as error:
        message = str(error)
        assert "mlp_offload" in message and "or use a leaf-wise optimizer" in message, message
        assert not [p for p in tmp_path.rglob("*") if p.is_file()], "a refused optimizer wrote state"
        print(f"| `{_case_id(case)}` | refused: {_reason(error)} |")
        return
    try:
        # A stateless optimizer (its only state the shared scalars; fp32 params take no master) has no bytes
        # to split: one subgroup holds every leaf.
        plan = tx.plan
        per_leaf = any(field.shape for sg in plan.subgroups for field in sg.layout.state_fields)
        assert len(plan.subgroups) >= 3 or not per_leaf, "the tree should make several subgroups"
        offloaded = _train(tx, state, params, loss)
        ran_on = 1  # the last update's last record, its write running on past it (write_depth=1)
        assert tx.stats.cache_hits == ran_on, "host_cache=0: every other subgroup is read from its path"
        assert tx.stats.cache_misses == len(plan.subgroups) - ran_on
    finally:
        tx.close()
    inner = optax.with_extra_args_support(_optimizer(case))
    expected = _train(inner, inner.init(params), params, loss)
    assert_close_to_optax(offloaded, expected, params, rounding_steps=STEPS, what=_case_id(case))
    print(f"| `{_case_id(case)}` | exact |")


ROW_COUPLED = {
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-1),
    "contrib.muon": lambda: optax.contrib.muon(1e-2),
}


@pytest.mark.parametrize("name", ROW_COUPLED)
def test_leaves_whose_rows_the_optimizer_mixes_stay_whole_and_exact(name, tmp_path):
    params, loss = _problem()
    options = {"host_cache": 0, "subgroup_size": WHOLE_LEAF_SIZE}
    with jax_mlp.mlp_offload(ROW_COUPLED[name](), paths=tmp_path, **options) as tx:
        with pytest.warns(UserWarning, match=r"param \['big'\] is kept whole in subgroup \d+"):
            state = tx.init(params)
        plan = tx.plan
        big = next(i for i, leaf in enumerate(plan.leaves) if leaf.path == "['big']")
        (subgroup,) = [sg for sg in plan.subgroups if any(p.leaf == big for p in sg.pieces)]
        assert subgroup.pieces == (partition.Piece(big),) and subgroup.layout.nbytes > WHOLE_LEAF_SIZE
        assert tx.stats.whole_leaf_subgroups["['big']"] == subgroup.index and tx.stats.check_s > 0
        assert tx.stats.as_dict()["whole_leaf_subgroups[['big']]"] == subgroup.index
        assert len(plan.subgroups) >= 3
        offloaded = _train(tx, state, params, loss)
    inner = optax.with_extra_args_support(ROW_COUPLED[name]())
    assert_close_to_optax(offloaded, _train(inner, inner.init(params), params, loss), params, what=name)


def test_a_planted_global_norm_transformation_is_refused_by_name_before_anything_is_written(tmp_path):
    params, _ = _problem()
    with (
        jax_mlp.mlp_offload(optax.chain(optax.adam(1e-2), scale_by_global_norm()), paths=tmp_path) as tx,
        pytest.raises(jax_mlp.CoupledOptimizerError, match=r"scale_by_global_norm \(.*helpers\.py"),
    ):
        tx.init(params)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def with_none_and_empty_state(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` with a ``None`` and a zero-size array beside its state, per leaf and shared."""

    def init_fn(params):
        per_leaf = jax.tree.map(lambda p: (None, jnp.zeros((0, *p.shape[1:]))), params)
        return inner.init(params), per_leaf, None, jnp.zeros((0,), jnp.int32)

    def update_fn(updates, state, params=None):
        inner_state, per_leaf, nothing, empty = state
        updates, inner_state = inner.update(updates, inner_state, params)
        return updates, (inner_state, per_leaf, nothing, empty + 1)

    return optax.GradientTransformation(init_fn, update_fn)


def test_none_and_empty_state_leaves_are_laid_out_as_nothing_and_come_back_as_they_were(tmp_path):
    start, loss = _problem()
    options = {"host_cache": 0, "subgroup_size": SUBGROUP_SIZE, "paths": tmp_path}
    inner = optax.with_extra_args_support(with_none_and_empty_state(optax.adam(1e-2)))
    with jax_mlp.mlp_offload(inner, **options) as tx:
        state = tx.init(start)
        assert len(tx.plan.subgroups) >= 3
        params, _ = _steps(tx, state, start, loss, STEPS - 1)
    with jax_mlp.mlp_offload(inner, resume=True, **options) as tx:
        state = tx.init(params)
        _, _, nothing, empty = state.shared
        assert nothing is None and empty.shape == (0,) and empty.dtype == jnp.int32
        offloaded, _ = _steps(tx, state, params, loss, 1)
    assert_close_to_optax(offloaded, _train(inner, inner.init(start), start, loss), start)
