"""Object storage as a path: S3 (moto's server) and GCS (fake-gcs-server), real servers on 127.0.0.1; and any
tensorstore kvstore as a path (the in-memory one).

The servers are started by the fixtures below and stopped at the end of the module. moto accepts
unconditional writes without the conditional puts S3 offers, so nothing here proves a store's atomicity:
what is shown is that the two slots and each record's checksum decide what is complete, as on a disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from helpers import (
    STORE_OPTIONS,
    abstract,
    assert_close_to_optax,
    assert_same_bits,
    make_params,
    run_offload,
    run_optax,
    train,
)
from object_stores import S3_KEYS, FakeGcs, MotoS3

import jax_mlp
from jax_mlp import report
from jax_mlp._src.storage.kvstore import ONE_RETRY, KvStoreBackend, retries_within
from jax_mlp._src.storage.paths import PathStore, open_path
from jax_mlp._src.storage.record import new_record

TESTS = Path(__file__).resolve().parent
SUBGROUP = "32KiB"
STORE_TIMEOUT = 2.0
"""A short store_timeout, so that an outage fails in seconds."""
OUTAGE_BOUND = 30.0
"""An outage must fail well within this (io_timeout stays at its 600 s): store_timeout plus the
requests' own time, not a hang."""

# One optimizer object for the module: compiled subgroup updates are cached per object.
INNER = optax.adam(1e-2)


def _serving(server, environ: dict, bucket: str):
    """Yields ``server`` with ``bucket`` made and ``environ`` set for tensorstore; stops it after."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environ.items():
            patch.setenv(name, value)
        try:
            server.create_bucket(bucket)
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server with the bucket ``bkt``, and keys in the environment for tensorstore."""
    yield from _serving(MotoS3().start(), S3_KEYS, "bkt")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """fake-gcs-server with the bucket ``gbkt``, its objects on disk (they survive a restart)."""
    server = FakeGcs(tmp_path_factory.mktemp("gcs") / "objects").start()
    yield from _serving(server, server.environ(), "gbkt")


@pytest.fixture
def gcs_to_kill(gcs):
    """The module's fake-gcs-server for a test that kills it, started over empty after so that what a kill
    leaves half-written cannot break a later test's listing."""
    yield gcs
    gcs.start_empty("gbkt")


def test_urls_and_specs_are_paths_named_with_their_bucket():
    s3 = jax_mlp.Path("s3://bkt/run1")
    assert s3.location == {"driver": "s3", "bucket": "bkt", "path": "run1"}
    assert s3.name == "s3://bkt/run1/"
    assert jax_mlp.Path("gs://gbkt/a/b/").name == "gs://gbkt/a/b/"
    assert jax_mlp.Path({"driver": "s3", "bucket": "bkt", "endpoint": "http://x:1", "path": "p"}).name == "s3://bkt/p/"
    assert jax_mlp.Path("file:///tmp/run").location == "/tmp/run"
    assert s3.identity == jax_mlp.Path({"driver": "s3", "bucket": "bkt", "path": "run1/"}).identity
    with pytest.raises(jax_mlp.OffloadError, match="is given twice"):
        jax_mlp.mlp_offload(INNER, paths=["s3://bkt/run1", {"driver": "s3", "bucket": "bkt", "path": "run1/"}])
    with pytest.raises(jax_mlp.OffloadError, match=r"path 'nosuch://x' is not a tensorstore kvstore URL"):
        jax_mlp.Path("nosuch://x")
    with pytest.raises(jax_mlp.OffloadError, match="store_timeout must be positive"):
        jax_mlp.mlp_offload(INNER, paths=["s3://bkt/x"], store_timeout=0)


def test_retries_add_up_to_at_most_the_store_timeout():
    """tensorstore's backoff before retry k is at most min(first * 2**k + first, max_delay) (jitter included)."""
    for seconds in (0.5, 2.0, 30.0, 600.0):
        retries = retries_within(seconds)
        first, longest = (float(retries[k].removesuffix("s")) for k in ("initial_delay", "max_delay"))
        waits = [min(first * 2**k + first, longest) for k in range(retries["max_retries"])]
        assert retries["max_retries"] >= 1 and sum(waits) <= seconds, (seconds, retries)
        assert sum(waits) + min(first * 2 ** len(waits) + first, longest) > seconds, "as many retries as fit"


def test_a_path_can_be_any_tensorstore_kvstore(paths):
    """A kvstore spec (here tensorstore's in-memory store) works like a directory, bit for bit."""
    params = make_params()
    memory = {"driver": "memory", "path": "run1"}
    got, stats = run_offload(optax.adam(1e-2), params, 3, [memory, paths[0]], subgroup_size="16KiB")
    assert stats.bytes_read["memory://run1/"] > 0
    expected = run_offload(optax.adam(1e-2), params, 3, [paths[1]], subgroup_size="16KiB")[0]
    assert_same_bits(got, expected)
    with pytest.raises(jax_mlp.OffloadError, match="needs a 'driver'"):
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[{"path": "x"}])


def test_local_plus_s3_and_gcs_alone_match_optax_and_the_local_run_bitwise(s3, gcs, tmp_path):
    params = make_params()
    options = {"subgroup_size": SUBGROUP, "placement": "round_robin", "rebalance": False}
    local, _ = run_offload(INNER, params, 3, [tmp_path / "a", tmp_path / "b"], **options)
    log = tmp_path / "log.jsonl"
    mixed, stats = run_offload(INNER, params, 3, [tmp_path / "c", s3.spec("bkt", "exact")], log_to=log, **options)
    alone, gcs_stats = run_offload(INNER, params, 3, ["gs://gbkt/exact"], subgroup_size=SUBGROUP)
    assert stats.bytes_read["s3://bkt/exact/"] > 0 and stats.bytes_written["s3://bkt/exact/"] > 0
    assert set(stats.bandwidth) == {str(tmp_path / "c"), "s3://bkt/exact/"}, "the store is a path of its own speed"
    assert gcs_stats.bytes_read["gs://gbkt/exact/"] > 0
    assert_same_bits(mixed, local, "local + S3 against two local directories")
    figure = report.make_figure(report.load_log(log))
    assert "p1 = s3://bkt/exact/" in figure.get_suptitle(), "the report names the store with its bucket"
    assert_same_bits(alone, local, "GCS alone against two local directories")
    assert_close_to_optax(local, run_optax(INNER, params, 3, jit=False), params, what="offloaded against optax")


def test_the_scheduler_gives_a_slower_store_a_smaller_share(s3, tmp_path):
    """Declared speeds split the records by bandwidth: the store, five times slower, gets about a sixth."""
    params = make_params()
    paths = [
        jax_mlp.Path(tmp_path / "nvme", read_bandwidth="1GB/s", write_bandwidth="1GB/s"),
        jax_mlp.Path(s3.spec("bkt", "share"), read_bandwidth="200MB/s", write_bandwidth="200MB/s"),
    ]
    with jax_mlp.mlp_offload(INNER, paths=paths, subgroup_size="8KiB", rebalance=False) as tx:
        tx.init(params)
        placement = tx.stats.placement
        tx.close(delete=True)
    assert 0 < placement["s3://bkt/share/"] < placement[str(tmp_path / "nvme")], placement


def test_a_wrong_bucket_or_refused_credentials_fail_at_init_naming_the_url(s3, gcs):
    params = make_params()
    for path, url in ((s3.spec("nosuch", "run"), "s3://nosuch/run/"), ("gs://nosuch/run", "gs://nosuch/run/")):
        with (
            jax_mlp.mlp_offload(INNER, paths=[path], store_timeout=STORE_TIMEOUT) as tx,
            pytest.raises(jax_mlp.PathError, match=rf"{url}.*the bucket does not exist.*create it"),
        ):
            tx.init(params)
    checked = MotoS3(checked_after=1).start()  # the bucket's creation passes; every later request is checked
    try:
        checked.create_bucket("bkt")
        with (
            jax_mlp.mlp_offload(INNER, paths=[checked.spec("bkt", "run")], store_timeout=STORE_TIMEOUT) as tx,
            pytest.raises(jax_mlp.PathError, match=r"s3://bkt/run/ at http://127\.0\.0\.1:\d+ refused the credentials"),
        ):
            tx.init(params)
    finally:
        checked.stop()


def test_an_s3_server_killed_between_updates_fails_the_next_update_in_bounded_time_naming_the_url(tmp_path):
    server = MotoS3().start()
    try:
        server.create_bucket("bkt")
        with pytest.MonkeyPatch.context() as patch:
            for name, value in S3_KEYS.items():
                patch.setenv(name, value)
            params = make_params()
            unreachable = r"s3://bkt/outage/.* is unreachable .*store_timeout=2s"
            tx = jax_mlp.mlp_offload(
                INNER, paths=[server.spec("bkt", "outage")], subgroup_size=SUBGROUP, store_timeout=STORE_TIMEOUT
            )
            params, state = train(tx, params, tx.init(params), range(2))
            server.kill()
            started = time.monotonic()
            with pytest.raises(jax_mlp.PathError, match=unreachable):
                train(tx, params, state, [2])
            assert time.monotonic() - started < OUTAGE_BOUND
            assert tx.step == 2, "a failed update changes nothing visible"
            # The records of step 2 whose writes ran on past its update are still in memory: closing cannot flush them.
            with pytest.raises(jax_mlp.PathError, match=unreachable):
                tx.close()
            assert time.monotonic() - started < 2 * OUTAGE_BOUND
    finally:
        server.stop()


def test_a_hung_s3_server_is_bounded_by_io_timeout_and_the_update_can_be_retried(monkeypatch):
    """A server that accepts connections and never answers (SIGSTOP) is no refused connection: curl waits for
    its low-speed limit, so io_timeout bounds the update (twice: the wait, then the settling of what is in
    flight). Once the server answers again, the same update succeeds."""
    for name, value in S3_KEYS.items():
        monkeypatch.setenv(name, value)
    server = MotoS3().start()
    try:
        server.create_bucket("bkt")
        params = make_params()
        options = {"subgroup_size": SUBGROUP, "store_timeout": STORE_TIMEOUT, "io_timeout": 3.0}
        with jax_mlp.mlp_offload(INNER, paths=[server.spec("bkt", "hung")], **options) as tx:
            params, state = train(tx, params, tx.init(params), range(2))
            server.process.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(
                jax_mlp.OffloadError, match=r"subgroup \d+ \(on s3://bkt/hung/\).*did not finish within io_timeout=3s"
            ):
                train(tx, params, state, [2])
            assert time.monotonic() - started < OUTAGE_BOUND
            server.process.send_signal(signal.SIGCONT)
            got, _ = train(tx, params, state, [2])
        start = make_params()
        assert_close_to_optax(got, run_optax(INNER, start, 3, jit=False), start, what="retried after the hang")
    finally:
        server.stop()


def s3_retries() -> int:
    """tensorstore's count of S3 request retries in this process so far."""
    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3/retries")
    return sum(value["value"] for metric in metrics for value in metric["values"])


def test_once_a_store_is_found_unreachable_new_requests_fail_at_once_until_it_answers(monkeypatch):
    """The first request retries for store_timeout; later ones ask once and fail: an update's pipeline
    does not wait store_timeout again for each read it starts. Once the server is back, requests work."""
    for name, value in S3_KEYS.items():
        monkeypatch.setenv(name, value)
    server = MotoS3().start()
    try:
        server.create_bucket("bkt")
        backend = KvStoreBackend(server.spec("bkt", "breaker"), 0, store_timeout=1.0)
        record = new_record(8192)
        array = backend.open_record("r", record.nbytes, create=True)
        array.write(record).result()
        server.kill()
        before = s3_retries()
        with pytest.raises(ValueError, match="retry attempts failed"):
            array.read().result()
        after_first = s3_retries()
        assert after_first - before == retries_within(1.0)["max_retries"] > 1
        for _ in range(3):
            with pytest.raises(ValueError, match="retry attempts failed"):
                array.read().result()
        assert s3_retries() - after_first <= 3 * ONE_RETRY["max_retries"]
        server.start()  # moto keeps nothing: the bucket and the record are written again
        server.create_bucket("bkt")
        backend.open_record("r", record.nbytes, create=True).write(record).result()
        assert np.array_equal(array.read().result(), record)
    finally:
        server.stop()


def test_a_gcs_server_killed_during_an_update_keeps_the_last_step_restorable_once_back(gcs_to_kill, monkeypatch):
    """The server dies as the update writes its second record (the first may have reached it); its objects
    stay on disk, and once it is back a resumed run takes up the last complete step and goes on, bit for bit."""
    params = make_params()
    options = {"subgroup_size": SUBGROUP, "store_timeout": STORE_TIMEOUT}
    with jax_mlp.mlp_offload(INNER, paths=["gs://gbkt/outage"], **options) as tx:
        state = tx.init(params)
        got, state = train(tx, params, state, range(2))
        write, writes = PathStore.write, []

        def die_at_the_second_write(store, *args):
            writes.append(args[0])
            if len(writes) == 2:
                gcs_to_kill.kill()
            return write(store, *args)

        monkeypatch.setattr(PathStore, "write", die_at_the_second_write)
        started = time.monotonic()
        with pytest.raises(jax_mlp.PathError, match=r"gs://gbkt/outage/.* is unreachable"):
            train(tx, got, state, [2])
        assert time.monotonic() - started < OUTAGE_BOUND
        assert len(writes) >= 2 and tx.step == 2
        monkeypatch.setattr(PathStore, "write", write)
        gcs_to_kill.start()
    with jax_mlp.mlp_offload(INNER, paths=["gs://gbkt/outage"], resume=True, **options) as resumed:
        state = resumed.init(abstract(params))
        assert int(state.step) == 2
        final, _ = train(resumed, got, state, [2, 3])
        resumed.close(delete=True)
    assert_same_bits(final, run_offload(INNER, params, 4, ["gs://gbkt/reference"], subgroup_size=SUBGROUP)[0])
    assert_close_to_optax(final, run_optax(INNER, params, 4, jit=False), params, what="resumed after the outage")


def test_a_torn_record_on_a_store_is_never_taken_for_complete(gcs):
    """A record whose chunks are objects of two steps (a writer died between its PUTs) fails its checksum:
    resume falls back to the step before, and continues bit for bit."""
    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (800, 1024))}  # adam state of 6.25 MiB: 2 chunks
    options = {"subgroup_size": "8MiB"}
    with jax_mlp.mlp_offload(INNER, paths=["gs://gbkt/torn"], **options) as tx:
        got, _ = train(tx, params, tx.init(params), range(3))
    objects = ts.KvStore.open({"driver": "gcs", "bucket": "gbkt", "path": "torn/proc0000/"}).result()
    chunks = sorted(key.decode() for key in objects.list().result() if b"/c/" in key)
    assert {"sg000000.0/c/1", "sg000000.1/c/1"} <= set(chunks), chunks
    objects.write("sg000000.1/c/1", objects.read("sg000000.0/c/1").result().value).result()  # step 3's head, 2's tail
    with jax_mlp.mlp_offload(INNER, paths=["gs://gbkt/torn"], resume=True, **options) as resumed:
        state = resumed.init(abstract(params))
        assert int(state.step) == 2
        expected = run_offload(INNER, params, 3, ["gs://gbkt/torn-reference"], **options)[0]
        two_steps = run_offload(INNER, params, 2, ["gs://gbkt/torn-two"], **options)[0]
        final, _ = train(resumed, two_steps, state, [2])
        resumed.close(delete=True)
    assert_same_bits(final, expected)
    assert not np.array_equal(np.asarray(got["w"]), np.asarray(two_steps["w"]))


def test_an_orbax_checkpoint_of_an_offload_on_a_store_restores_onto_local_paths(s3, tmp_path):
    params = make_params()
    options = {"subgroup_size": SUBGROUP, "placement": "round_robin", "rebalance": False}
    with jax_mlp.mlp_offload(INNER, paths=[tmp_path / "nvme", s3.spec("bkt", "ckpt")], **options) as tx:
        state = tx.init(params)
        params, state = train(tx, params, state, range(3))
        with ocp.CheckpointManager(tmp_path / "checkpoints") as manager:
            manager.save(
                3, args=ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=jax_mlp.OffloadSave(tx))
            )
            manager.wait_until_finished()
        expected, _ = train(tx, params, state, range(3, 5))
        tx.close(delete=True)
    with jax_mlp.mlp_offload(INNER, paths=[tmp_path / "restored"], **options) as local:
        like = abstract(params)
        with ocp.CheckpointManager(tmp_path / "checkpoints") as manager:
            restored = manager.restore(
                3,
                args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(like), opt_state=jax_mlp.OffloadRestore(local, like)
                ),
            )
        assert int(restored["opt_state"].step) == 3
        got, _ = train(local, restored["params"], restored["opt_state"], range(3, 5))
    assert_same_bits(got, expected, "restored onto a local directory against the run on the store")


MEMORY_CHILD = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, optax
    import jax_mlp
    sys.path.insert(0, sys.argv[2])
    from rss import update_rises

    n = 32 * 1024**2  # 32M float32 params: 128 MiB; adam state: 256 MiB
    params = {"w": jnp.ones((n // 1024, 1024), jnp.float32)}
    tx = jax_mlp.mlp_offload(optax.adam(1e-3), paths=[sys.argv[1]], subgroup_size="4MiB")
    rises = update_rises(tx, params)
    config = tx.config
    print(json.dumps({"rises": rises, "state_bytes": tx.plan.state_nbytes,
                      "record_bytes": max(sg.layout.nbytes for sg in tx.plan.subgroups),
                      "depths": config.prefetch_depth + config.write_depth + config.max_inflight}))
    tx.close(delete=True)
    """
)


def test_peak_rss_of_an_update_on_a_store_is_bounded_by_records_in_flight(gcs):
    """Host memory of an update on GCS: the records in flight (each held by the engine and copied once by
    tensorstore's HTTP requests), never the state; the updates (the params' size) come on top. 4 MiB records
    keep all that can be in flight under half the state, so the one bound shows both."""
    env = {**os.environ, **gcs.environ()}
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, "gs://gbkt/memory", str(TESTS)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    params_bytes = 32 * 1024**2 * 4
    in_flight = 2 * figures["depths"] * figures["record_bytes"]
    print(figures, "bound:", params_bytes + in_flight)
    assert figures["state_bytes"] >= 2 * params_bytes
    assert in_flight < figures["state_bytes"] / 2, "records this large could not tell the state from the records"
    for rise in figures["rises"][1:]:
        assert rise < params_bytes + in_flight, figures


def test_s3_keys_in_the_environment_are_used_without_the_sdk_logging_missing_aws_files(s3, capfd):
    """tensorstore's default AWS chain logs four errors per open where ~/.aws is missing; keys in the
    environment are read by its ``environment`` provider, which logs nothing."""
    open_path(jax_mlp.Path(s3.spec("bkt", "quiet")), **STORE_OPTIONS).remove()
    assert ".aws" not in capfd.readouterr().err


def test_probe_and_plan_take_urls_and_json_specs_and_report_no_free_space(s3, gcs, capsys):
    from jax_mlp._src.cli import main as cli

    spec = json.dumps(s3.spec("bkt", "probe"))
    arguments = ["--size", "2MiB", "--record", "1MiB", "--state", "8MiB", "--subgroup-size", "1MiB"]
    assert cli.main(["probe", "gs://gbkt/probe", spec, *arguments]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[1:3]}
    assert set(rows) == {"gs://gbkt/probe/", "s3://bkt/probe/"}, lines
    free = {path: row[next(n for n, word in enumerate(row) if word.endswith(")")) + 1] for path, row in rows.items()}
    assert all(float(row[1]) > 0 and float(row[3]) > 0 for row in rows.values()), rows
    assert set(free.values()) == {"-"}, rows  # the column after "both at once": no free-space figure
    assert "an object store has no free-space figure" in "\n".join(lines)
    pasted = lines[-1].removeprefix("for jax-mlp plan elsewhere: --paths ")
    assert cli.main(["plan", "--params", "1B", "--paths", pasted, "gs://gbkt/plan"]) == 0
    out = capsys.readouterr().out
    assert "probed gs://gbkt/plan/: read " in out and "s3://bkt/probe/" in out


def test_the_object_store_benchmark_writes_the_ratio_to_the_raw_throughput(tmp_path):
    script = TESTS.parent / "benchmarks" / "object_store.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((tmp_path / "object_store.json").read_text())
    assert [server["server"] for server in written["servers"]] == ["s3", "gcs"]
    for server in written["servers"]:
        assert server["records"] >= 2 and server["median_ratio_to_io_bound"] > 0
        assert server["outage"]["error"].startswith("PathError") and "is unreachable" in server["outage"]["error"]
        for row in server["updates"]:
            assert row["bytes_read"] == row["bytes_written"] >= server["state_bytes"], "every record, each way"
            assert row["raw_read_MBps"] > 0 and row["raw_write_MBps"] > 0
            assert row["ratio_to_io_bound"] == row["update_s"] / row["io_bound_s"]
