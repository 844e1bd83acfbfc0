"""The rule that makes the fast tier (tests/support/processes.py): it holds, and breaking it fails.

``make test-fast`` runs ``-m "not process"``. A test that starts a process without requesting
the ``processes`` fixture would slip into it; these tests show that every door to a new
process is shut to such a test, and that the fixtures that start processes carry the mark.
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing
import os
import subprocess
import sys

import pytest

from tests.support.processes import FIXTURE, MARK, UndeclaredProcess

PROCESS_FIXTURES = ["node_factory", "redis_factory", "stack_factory"]


def test_a_test_that_does_not_request_processes_cannot_run_a_command():
    with pytest.raises(UndeclaredProcess, match="test_a_test_that_does_not_request_processes_cannot_run_a_command"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)


def test_a_test_that_does_not_request_processes_cannot_fork_or_spawn():
    with pytest.raises(UndeclaredProcess):
        if os.fork() == 0:  # reached only if the door is open: the child leaves at once
            os._exit(0)
    with pytest.raises(UndeclaredProcess):
        os.waitpid(os.posix_spawn("/bin/true", ["true"], {}), 0)
    with pytest.raises(UndeclaredProcess):
        os.system("true")
    with pytest.raises(UndeclaredProcess):
        multiprocessing.get_context("spawn").Process(target=print).start()


async def test_a_test_that_does_not_request_processes_cannot_start_an_asyncio_subprocess():
    with pytest.raises(UndeclaredProcess):
        await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")


def test_a_library_that_probes_the_host_while_it_is_imported_is_let_through(tmp_path, monkeypatch):
    """torch runs ``ldconfig -p`` on its first import: which test imports it first must not matter."""
    (tmp_path / "probing_library.py").write_text("import subprocess\nPROBED = subprocess.run(['true']).returncode\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.import_module("probing_library").PROBED == 0
    with pytest.raises(UndeclaredProcess):  # the same call from the test itself is refused
        subprocess.run(["true"], check=False)


@pytest.mark.usefixtures(FIXTURE)
def test_a_test_that_requests_processes_runs_commands_and_is_marked(request):
    assert subprocess.run([sys.executable, "-c", "pass"], check=False).returncode == 0
    assert request.node.get_closest_marker(MARK) is not None


def test_every_test_using_a_fixture_that_starts_processes_is_out_of_the_fast_tier(request):
    users = [item for item in request.session.items if set(PROCESS_FIXTURES) & set(getattr(item, "fixturenames", ()))]
    assert all(item.get_closest_marker(MARK) for item in users), [
        item.nodeid for item in users if not item.get_closest_marker(MARK)
    ]
    fixtures = request.session._fixturemanager
    for name in PROCESS_FIXTURES:
        (definition,) = fixtures.getfixturedefs(name, request.node)
        assert FIXTURE in definition.argnames, f"{name} starts processes but does not request {FIXTURE!r}"
    assert request.node.get_closest_marker(MARK) is None
