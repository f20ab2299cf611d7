"""Nox sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s demo`` and ``nox -s pretrain``.

Each session installs into its own virtual environment (made with the standard ``venv`` module, so
uv is not needed) for the Python that runs nox.
"""

import os
import shutil

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests", "lint"]


@nox.session
def tests(session: nox.Session) -> None:
    """Runs the test suite; arguments after ``--`` go to pytest (default: ``-q -n auto --maxprocesses 4``).

    The suite is mostly child processes and waits on them (training runs, killed peers, timeouts), so
    two workers on a 2-core machine finish it in about 60% of the time one takes. More than four
    workers would hold 9 fake devices each for little gain. By default the tests marked ``alone``
    (the scheduler on kernel-throttled devices, whose updates it times) run afterwards in one process:
    beside another worker's training they saw its noise as a change of the paths.
    """
    session.install(".[test]")
    if session.posargs:
        session.run("pytest", *session.posargs)
        return
    session.run("pytest", "-q", "-n", "auto", "--maxprocesses", "4", "-m", "not alone")
    session.run("pytest", "-q", "-m", "alone")


@nox.session
def lint(session: nox.Session) -> None:
    """Checks lint and formatting with ruff."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def demo(session: nox.Session) -> None:
    """Trains a small GPT (Flax NNX) with offloaded AdamW state; arguments after ``--`` go to the script."""
    session.install(".[examples]")
    session.run("python", "examples/train_gpt.py", *session.posargs)


@nox.session
def pretrain(session: nox.Session) -> None:
    """Runs the FSDP pre-training recipe on 8 fake CPU devices (GPUs where present); ``--`` args go to the script.

    The run lives in ``.nox/pretrain/tmp/run``, started afresh unless ``--resume`` is among the arguments.
    It trains 60 steps unless ``--steps`` says otherwise.
    """
    session.install(".[examples]")
    workdir = os.path.join(session.create_tmp(), "run")
    if "--resume" not in session.posargs:
        shutil.rmtree(workdir, ignore_errors=True)
    # Only the CPU backend reads these: 8 fake devices, and more XLA CPU threads than devices, without
    # which the FSDP step's all-reduce waits forever on a machine with fewer cores.
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "NPROC": "24"}
    short_run = ("--steps", "60", "--save-every", "20")  # about 3 minutes on 2 cores; later arguments win
    session.run("python", "examples/pretrain.py", "--workdir", workdir, *short_run, *session.posargs, env=env)
