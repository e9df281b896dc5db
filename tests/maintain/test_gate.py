"""`./run gate`: the verdict per target, and an exit code a CI job can act on."""

import pytest

from maintain import gate
from maintain.repo import checkout as checkout_target
from tests.support.targets import FIXED


pytestmark = pytest.mark.slow


class TestGate:
    def test_a_release_other_than_the_pin(self, maintain, cli):
        """The whole red/green run on the 0.6.0 wheel: every FAIL_TO_PASS red by assertion, everything green."""
        result = maintain("gate", "--release", "0.6.0")
        assert result.returncode == 0, result.stdout + result.stderr
        (row,) = [line for line in result.stdout.splitlines() if line.startswith("megatron-bridge==0.6.0 (PyPI)")]
        red, green, verdict = row.split()[-3:]
        assert verdict == "PASS" and int(red.split("/")[0]) > 0
        assert red.split("/")[0] == red.split("/")[1] and green.split("/")[0] == green.split("/")[1]

    def test_upstream_already_holds_the_fix(self, maintain, cli, git, checkout):
        """A fork's nightly job fails with "retire" once upstream holds the fix: exit 3, and no test session runs."""
        assert cli("apply", "--no-verify", checkout.root).returncode == 0
        git(checkout.root, "commit", "--quiet", "-am", "upstream merged the fix")
        result = maintain("gate", "--checkouts-only", "--checkout", checkout.root)
        assert result.returncode == 3, result.stdout + result.stderr
        assert "upstream has the fix: retire the patch" in result.stdout
        assert "pytest sessions" not in result.stderr

    def test_drifted_upstream(self, maintain, cli, edit, checkout):
        """A checkout whose gpt_step.py moved on: exit 4, DRIFTED, and the line where it departs from the hunk."""
        edit(checkout, checkout.gpt_step, '        "attention_mask": attention_mask,\n', "        # moved on\n")
        result = maintain("gate", "--checkouts-only", "--checkout", checkout.root)
        assert result.returncode == 4, result.stdout + result.stderr
        (row,) = [line for line in result.stdout.splitlines() if line.startswith(str(checkout.root))]
        assert row.split()[-1] == "DRIFTED"
        assert "gpt_step.patch does not apply" in result.stdout and "gpt_step.py:" in result.stdout
        assert "`# moved on`" in result.stdout

    def test_a_checkout_is_judged_at_head_not_its_working_tree(self, maintain, cli, git, checkout):
        """gate measures HEAD: upstream holds the fix there, whatever the working tree holds (here, the fix undone)."""
        assert cli("apply", "--no-verify", checkout.root).returncode == 0
        git(checkout.root, "commit", "--quiet", "-am", "upstream merged the fix")
        git(checkout.root, "revert", "--no-commit", "HEAD")
        result = maintain("gate", "--checkouts-only", "--checkout", checkout.root)
        assert result.returncode == 3, result.stdout + result.stderr
        assert "upstream has the fix: retire the patch" in result.stdout

    def test_an_interpreter_without_pytest_is_refused_first(self, maintain, cli, refused, tmp_path, checkout):
        python = tmp_path / "python-without-pytest"
        python.write_text("#!/bin/sh\nexit 1\n")
        python.chmod(0o755)
        line = refused(
            maintain("gate", "--checkouts-only", "--checkout", checkout.root, "--python", python), 2, "pytest"
        )
        assert str(python) in line

    def test_two_checkouts_of_the_same_name_get_trees_of_their_own(self, git, checkout, tmp_path):
        """gate builds every tree before it runs a session: a checkout's tree is never another's."""
        other = tmp_path / "elsewhere" / checkout.root.name
        git(tmp_path, "clone", "--quiet", str(checkout.root), str(other))
        (other / FIXED).write_text("# another upstream\n")
        git(other, "commit", "--quiet", "-am", "elsewhere")
        trees = [gate.at(checkout_target(root)).root for root in (checkout.root, other)]
        assert (trees[0] / FIXED).read_text() == checkout.gpt_step.read_text()
        assert (trees[1] / FIXED).read_text() == "# another upstream\n"

    def test_a_bad_interpreter_is_refused_before_any_download(self, maintain, cli, refused):
        refused(maintain("gate", "--release", "9.9.9", "--python", "no-such-python"), 2, "--python no-such-python")
