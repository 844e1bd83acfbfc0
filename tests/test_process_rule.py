"""The process rule holds in the suites make test does not run in full: tests/deploy, tests/hosts, tests/faults.

``tests.support.process_rule`` reads their syntax trees (nothing is imported or run, so this is a
fast test): a test that starts a process, itself or through a helper, a class or a fixture it
reaches, must have ``processes`` in its fixture closure.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.conftest import REPO
from tests.support.process_rule import SUITES, check, starting_tests


def test_every_test_in_deploy_hosts_and_faults_that_starts_a_process_requests_processes():
    folders = [REPO / "tests" / suite for suite in SUITES]
    violations = check(REPO, folders)
    assert not violations, "\n".join(map(str, violations))
    starting = {test.split("/")[1] for test, _, _ in starting_tests(REPO, folders)}
    assert starting == set(SUITES)  # the reading sees the process starts of every suite: it is not vacuous


def _suite(root: Path, source: str) -> Path:
    tests = root / "tests"
    (tests / "support").mkdir(parents=True)
    (tests / "conftest.py").write_text(
        textwrap.dedent(
            """
            import subprocess

            import pytest

            @pytest.fixture(scope="session")
            def processes():
                pass

            @pytest.fixture
            def node_factory(processes):
                return lambda: None

            @pytest.fixture
            def podman_ready():
                subprocess.run(["podman", "info"])
            """
        )
    )
    (tests / "support" / "launch.py").write_text(
        "import subprocess\n\nclass Server:\n    def start(self):\n        subprocess.Popen(['redis-server'])\n"
    )
    suite = tests / "faults"
    suite.mkdir()
    (suite / "test_x.py").write_text(textwrap.dedent(source))
    return suite


def test_the_rule_flags_a_test_that_starts_a_process_without_requesting_processes(tmp_path):
    suite = _suite(
        tmp_path,
        """
        import os
        import subprocess

        import pytest

        from tests.support.launch import Server

        def helper():
            return subprocess.run(["true"])

        def test_runs_a_command():
            subprocess.check_output(["true"])

        def test_through_a_helper():
            helper()

        def test_through_a_class_of_the_repo():
            Server().start()

        def test_through_a_fixture(podman_ready):
            pass

        class TestForks:
            def test_forks(self):
                os.fork()

        def test_declared(processes):
            helper()

        @pytest.mark.usefixtures("processes")
        def test_declared_by_mark():
            os.system("true")

        def test_declared_through_a_fixture(node_factory):
            Server()

        def test_starts_nothing(tmp_path):
            Server  # named, not called
        """,
    )
    flagged = {v.test.split("::", 1)[1]: v.how for v in check(tmp_path, [suite])}
    assert flagged == {
        "test_runs_a_command": "subprocess.check_output",
        "test_through_a_helper": "helper() -> subprocess.run",
        "test_through_a_class_of_the_repo": "Server() -> subprocess.Popen",
        "test_through_a_fixture": "subprocess.run",
        "TestForks::test_forks": "os.fork",
    }
    assert "'processes' fixture" in str(check(tmp_path, [suite])[0])
