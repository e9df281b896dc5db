"""`check` and `status` on each kind of target: a site-packages dir, a plain source tree, a git checkout; and what
counts as the fix, whoever wrote it."""

import os
import re
import sys

import pytest

from maintain.repo import patch_file, release_lines
from maintain.repo import release as release_target
from mtp_mask_fix.reading import Reading, read, unbound
from tests.support.targets import (
    CONTEXT,
    EQUIVALENT_FIX,
    FIXED,
    LABELS,
    PATCH_FILE,
    REGION_EDIT,
    UPSTREAM_TEST,
    Tree,
    fake_python,
    probe_says,
    verdict,
)


class TestCheckStates:
    """The three states, each with its own exit code and a one-line verdict, on every kind of target."""

    def test_applies(self, cli, snapshot, target):
        before = snapshot(target.root)
        line = verdict(cli("check", target.root), 0)
        assert snapshot(target.root) == before  # check never writes
        assert "the patch applies" in line and "the bug is present" in line
        scope = "source hunks only" if target.kind == "installed" else "source and tests"
        assert scope in line

    def test_already_applied_after_apply(self, cli, target):
        assert cli("apply", "--no-verify", target.root).returncode == 0
        line = verdict(cli("check", target.root), 3)
        assert "already applied" in line

    def test_equivalent_upstream_fix_is_already_fixed(self, cli, edit, target):
        edit(target, target.gpt_step, LABELS, EQUIVALENT_FIX)
        line = verdict(cli("check", target.root), 3)
        assert "fixed another way" in line and "nothing to apply" in line

    def test_drifted_context_names_the_file(self, cli, edit, snapshot, target):
        """The patch tried, and the line of the tree where it departs from its hunk, as the tree has it."""
        edit(target, target.gpt_step, CONTEXT, '        "attention_mask": attention_mask if use_mask else None,\n')
        before = snapshot(target.root)
        line = verdict(cli("check", target.root), 4)
        assert snapshot(target.root) == before
        at = target.gpt_step.read_text().split("attention_mask if use_mask")[0].count("\n") + 1  # the user's line
        where = f"{target.gpt_step.relative_to(target.root)}:{at}"
        said = f'{where} `"attention_mask": attention_mask if use_mask else None,` is not what its hunk has there'
        assert line.endswith(f": drifted: {PATCH_FILE} does not apply: {said}")

    def test_upstream_test_file_moved_on(self, cli, edit, checkout, patched_gpt_step):
        """The source hunk still fits, but upstream's test file moved on: the source alone, said so (naming the test
        file), and apply writes that; revert takes it out again."""
        edit(checkout, checkout.upstream_test, "_flops_seqlen_sum == 0\n", "_flops_seqlen_sum == 0  # moved on\n")
        tests = checkout.upstream_test.read_bytes()
        line = verdict(cli("check", checkout.root), 0)
        assert (
            "source hunks only; upstream's tests left out, their file has moved on" in line and UPSTREAM_TEST in line
        )
        assert cli("apply", "--no-verify", checkout.root).returncode == 0
        assert checkout.gpt_step.read_text() == patched_gpt_step and checkout.upstream_test.read_bytes() == tests
        assert "already applied (source hunks only; upstream's tests left out" in verdict(
            cli("check", checkout.root), 3
        )
        assert cli("revert", checkout.root).returncode == 0
        assert "the patch applies" in verdict(cli("check", checkout.root), 0)

    def test_default_target_is_what_the_interpreter_imports(self, cli, tool_env, site_packages):
        path = os.pathsep.join(filter(None, [str(site_packages.root), tool_env.get("PYTHONPATH")]))
        line = verdict(cli("check", env=dict(tool_env, PYTHONPATH=path)), 0)
        assert line.startswith(f"{site_packages.root}: the patch applies")

    def test_default_target_of_an_editable_checkout_is_the_checkout(self, cli, tool_env, edit, checkout):
        """An editable install imports the checkout's src/: judged as the checkout, with the same verdicts as when
        it is named."""
        env = dict(tool_env, PYTHONPATH=str(checkout.root / "src"))
        assert verdict(cli("check", env=env), 0).startswith(f"{checkout.root}: the patch applies (source and tests")
        edit(checkout, checkout.gpt_step, CONTEXT, REGION_EDIT, commit=False)
        line = verdict(cli("check", env=env), 2)
        assert line == verdict(cli("check", checkout.root), 2) and "uncommitted local changes in the patch's" in line

    def test_no_target_and_no_megatron_bridge_is_refused(self, cli, refused):
        refused(cli("check"), 2, "imports no megatron.bridge", sys.executable, "--python")


# A line changed and a line added, in the source hunk's region; each the user's line that the verdict names.
REGION_EDITS = {"changed": (CONTEXT, REGION_EDIT), "added": (CONTEXT, CONTEXT + "        # a local note\n")}


@pytest.mark.parametrize("change", REGION_EDITS)
@pytest.mark.parametrize("kind", ["site_packages", "checkout"])
def test_local_edits_in_the_region_name_the_users_line(request, cli, refused, edit, snapshot, kind, change):
    """Installed (the wheel's RECORD says the file is not as shipped) or checked out (the diff fits the commit):
    local edits, not drift; check and apply refuse with exit 2, at the line of the user's file, and change nothing."""
    tree, (old, new) = request.getfixturevalue(kind), REGION_EDITS[change]
    edit(tree, tree.gpt_step, old, new, commit=False)
    text = tree.gpt_step.read_text()
    line = text[: text.index(new) + len(new)].count("\n")  # the last line of the edit
    where = f"{tree.gpt_step.relative_to(tree.root)}:{line}"
    before = snapshot(tree.root)
    said = verdict(cli("check", tree.root), 2)
    assert f" in the patch's region ({where})" in said
    assert refused(cli("apply", "--no-verify", tree.root), 2) == f"mtp-mask-fix: error: {said}"
    assert snapshot(tree.root) == before


class TestNestedTree:
    """A source tree vendored inside another git repository, with a space in its path."""

    @pytest.fixture
    def vendored(self, tmp_path, git, source_tree):
        outer = tmp_path / "outer project"
        tree = outer / "vendor" / "Megatron Bridge"
        tree.parent.mkdir(parents=True)
        source_tree.root.rename(tree)
        git(outer, "init", "--quiet")
        git(outer, "add", "-A")
        git(outer, "commit", "--quiet", "-m", "vendor Megatron-Bridge")
        return Tree(tree, "tree")

    def test_check_apply_check(self, cli, vendored, patched_gpt_step):
        assert f"the patch applies (source and tests, {PATCH_FILE})" in verdict(cli("check", vendored.root), 0)
        assert cli("apply", "--no-verify", vendored.root).returncode == 0
        assert vendored.gpt_step.read_text() == patched_gpt_step
        assert "def test_forward_common_passes_loss_mask_to_mtp_model(" in vendored.upstream_test.read_text()
        assert "already applied" in verdict(cli("check", vendored.root), 3)


MODEL_CALL = "            output_tensor = model(**forward_args)\n"
MTP_TEST = '(getattr(config, "mtp_num_layers", None) or 0) > 0'  # as every release tests it
FORWARD_ARGS = (
    "    forward_args = {\n",
    '        forward_args["packed_seq_params"] = get_packed_seq_params(packed_seq_metadata)\n',
)


def _moved_into_a_helper(text: str) -> str:
    """forward_args built by a new helper, the patch's context lines with it, away from the model call."""
    start, end = text.index(FORWARD_ARGS[0]), text.index(FORWARD_ARGS[1]) + len(FORWARD_ARGS[1])
    call = (
        "    forward_args = _forward_args(tokens, position_ids, attention_mask, labels, packed_seq_metadata, config)\n"
    )
    helper = "def _forward_args(tokens, position_ids, attention_mask, labels, packed_seq_metadata, config):\n"
    helper += text[start:end] + "    return forward_args\n\n\n"
    text = text[:start] + call + text[end:]
    return text.replace("def _forward_step_common(", helper + "def _forward_step_common(", 1)


def _a_second_model_call(text: str) -> str:
    """A new helper above, with the same forward_args block and its own model call."""
    start, end = text.index(FORWARD_ARGS[0]), text.index(FORWARD_ARGS[1]) + len(FORWARD_ARGS[1])
    helper = "def _forward_eval(model, tokens, position_ids, attention_mask, labels, packed_seq_metadata, config):\n"
    helper += text[start:end] + "    return model(**forward_args)\n\n\n"
    return text.replace("def _forward_step_common(", helper + "def _forward_step_common(", 1)


OLDER = [version for version, line in release_lines().items() if line.get("backport")]
# A line of the source hunk's context changed: its first, and its last (the one the backport has its own way).
HUNK_EDITS = {"first": (CONTEXT, REGION_EDIT), "last": ("    if cu_seqlens is not None:\n", "    if cu_seqlens:\n")}


@pytest.mark.parametrize("edited", HUNK_EDITS)
@pytest.mark.parametrize("version", OLDER[:1] + OLDER[-1:])
def test_a_drift_on_an_older_line_names_its_backport_and_a_line_of_the_tree(cli, tmp_path, version, edited):
    """On a 0.3-0.5 tree the drift names the backport, and the tree's own line where it departs from the hunk."""
    root, (old, new) = tmp_path / f"Megatron-Bridge-{version}", HUNK_EDITS[edited]
    for rel in (FIXED, "src/megatron/bridge/package_info.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text((release_target(version).root / rel.removeprefix("src/")).read_text())
    text = (root / FIXED).read_text()
    (root / FIXED).write_text(text.replace(old, new, 1))
    line = verdict(cli("check", root), 4)
    at = text[: text.index(old)].count("\n") + 1
    assert line.endswith(
        f": drifted: {patch_file(version)} does not apply: {FIXED}:{at} `{new.strip()}` is not what its hunk has there"
    )


class TestUpstreamMovedOn:
    """Upstream renames the function, moves the hunk's lines, adds a helper: the tool agrees with itself."""

    def test_a_renamed_function_is_applied_then_already_applied(self, cli, edit, site_packages):
        edit(site_packages, site_packages.gpt_step, "def _forward_step_common(", "def _forward_step_shared(")
        assert "the patch applies" in verdict(cli("check", site_packages.root), 0)
        assert cli("apply", "--no-verify", site_packages.root).returncode == 0
        assert "already applied" in verdict(cli("check", site_packages.root), 3)
        again = cli("apply", "--no-verify", site_packages.root)
        assert (again.returncode, again.stderr) == (0, "") and "already fixed" in again.stdout

    @pytest.mark.parametrize(
        ("change", "moved"),
        [
            (_moved_into_a_helper, "`if use_mtp:` names `use_mtp`, which `_forward_args` does not bind"),
            (_a_second_model_call, "`return model(**forward_args)` gets no loss_mask"),
        ],
        ids=["hunk moved into a helper", "a second model call"],
    )
    def test_a_hunk_away_from_the_model_call_is_refused_up_front(
        self, cli, refused, snapshot, site_packages, change, moved
    ):
        """The patch would apply, but not where the model call gets its arguments: exit 4 before any write, naming
        the line that moved."""
        site_packages.gpt_step.write_text(change(site_packages.gpt_step.read_text()))
        before = snapshot(site_packages.root)
        said = verdict(cli("check", site_packages.root), 4)
        assert moved in said
        assert refused(cli("apply", "--no-verify", site_packages.root), 4) == f"mtp-mask-fix: error: {said}"
        assert snapshot(site_packages.root) == before


OVERRIDES = [
    'forward_args["loss_mask"] = torch.ones_like(loss_mask)',
    'forward_args["loss_mask"] = None',
    "forward_args.update(loss_mask=torch.ones_like(labels))",
]


# Lines after the fix, at the model call, that change or may change the mask it receives; what check says of them.
AFTER_THE_FIX = {
    "another mask": ('forward_args["loss_mask"] = torch.ones_like(loss_mask)', "may hand the model something other"),
    "del": ('del forward_args["loss_mask"]', "does what check cannot follow"),
    "pop": ('forward_args.pop("loss_mask", None)', "does what check cannot follow"),
    "a key in a variable": ("forward_args[key] = torch.ones_like(loss_mask)", "does what check cannot follow"),
}


@pytest.mark.parametrize("case", AFTER_THE_FIX)
def test_a_line_after_the_fix_that_changes_the_mask_is_not_fixed(
    cli, refused, edit, site_packages, release_gpt_step, case
):
    """check and status name that line and point to verify (exit 2), never "fixed" (exit 3); apply refuses it the same
    way; revert takes the patch out and leaves the line where it stands."""
    assert cli("apply", "--no-verify", site_packages.root).returncode == 0
    code, said = AFTER_THE_FIX[case]
    before = '            key = "loss_mask"\n' if "key" in code else ""
    edit(site_packages, site_packages.gpt_step, MODEL_CALL, f"{before}            {code}\n{MODEL_CALL}", commit=False)
    line = site_packages.gpt_step.read_text().split(MODEL_CALL)[0].count("\n")  # the line before the call
    where = f"megatron/bridge/training/gpt_step.py:{line} `{code}` {said}"
    for command in ("check", "status"):
        result = cli(command, site_packages.root)
        assert result.returncode == 2, (result.stdout, result.stderr)
        assert where in result.stdout.splitlines()[-1] and "`mtp-mask-fix verify`" in result.stdout, result.stdout
    assert where in refused(cli("apply", "--no-verify", site_packages.root), 2)
    assert cli("revert", site_packages.root).returncode == 0  # outside the hunk: that line is kept
    assert site_packages.gpt_step.read_text() == release_gpt_step.replace(
        MODEL_CALL, f"{before}            {code}\n{MODEL_CALL}"
    )


def test_a_line_next_to_the_fix_that_changes_the_mask_is_for_the_probe(cli, edit, site_packages):
    """Next to the fix's own line the patch no longer reverses, and that line touches the mask: check cannot tell."""
    assert cli("apply", "--no-verify", site_packages.root).returncode == 0
    fix = '        forward_args["loss_mask"] = loss_mask\n'
    edit(site_packages, site_packages.gpt_step, fix, fix + f"    {OVERRIDES[0]}\n", commit=False)
    line = site_packages.gpt_step.read_text().split(fix)[0].count("\n") + 2
    for command in ("check", "status"):
        result = cli(command, site_packages.root)
        assert result.returncode == 2
        assert f"check cannot tell: megatron/bridge/training/gpt_step.py:{line} `{OVERRIDES[0]}`" in result.stdout


# After the fix, edits a maintainer might make that leave the mask's way to the model unshown: each is the probe's.
UNSHOWN = {
    "the guard negated": ("    if use_mtp:\n", "    if not use_mtp:\n", "`if not use_mtp:` may skip"),
    "a condition on the mask": (
        '        forward_args["loss_mask"] = loss_mask\n',
        '        forward_args["loss_mask"] = loss_mask if state.cfg else None\n',
        "may hand the model something other than the batch's loss_mask",
    ),
    "a harmless read": (MODEL_CALL, '            _ = forward_args["loss_mask"]\n' + MODEL_CALL, "cannot follow"),
}


@pytest.mark.parametrize("case", UNSHOWN)
def test_a_fix_check_cannot_follow_is_for_the_probe(cli, refused, snapshot, tmp_path, site_packages, probe_ok, case):
    """check and status: "check cannot tell" (exit 2), never fixed; apply --no-verify refuses it; a verified apply
    runs the probe and exits 0 where it shows the mask, 5 where not; nothing changes."""
    assert cli("apply", "--no-verify", site_packages.root).returncode == 0
    old, new, said = UNSHOWN[case]
    site_packages.gpt_step.write_text(site_packages.gpt_step.read_text().replace(old, new, 1))
    before = snapshot(site_packages.root)
    for command in ("check", "status"):
        result = cli(command, site_packages.root)
        assert result.returncode == 2, result.stdout
        assert "check cannot tell" in result.stdout and said in result.stdout
    assert said in refused(cli("apply", "--no-verify", site_packages.root), 2, "check cannot tell")
    python = probe_ok()
    done = cli("apply", "--python", python, site_packages.root)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == (
        f"{site_packages.root}: already fixed (check cannot tell, the probe shows it); nothing changed; "
        f"verified with {python}: fake probe\n"
    )
    not_seen = fake_python(tmp_path, "python-sees-none", probe_says(False, "no loss_mask reached"))
    refused(cli("apply", "--python", not_seen, site_packages.root), 5, "no loss_mask reached", "nothing changed")
    assert snapshot(site_packages.root) == before


RENAME = ("loss_mask", "mask")  # upstream renames the local variable in _forward_step_common


def _renamed(text: str) -> str:
    start, end = text.index("def _forward_step_common("), text.index("\ndef forward_step(")
    return text[:start] + re.sub(rf"\b{RENAME[0]}\b", RENAME[1], text[start:end]) + text[end:]


def test_a_renamed_local_is_drift_not_a_name_error(cli, refused, snapshot, site_packages, patch, probe_ok):
    """The patch still applies, but its lines would read a name the function no longer binds: exit 4 naming it,
    before any write, verified or not; the patch's lines in place there are never "already applied"."""
    renamed = _renamed(site_packages.gpt_step.read_text())
    site_packages.gpt_step.write_text(renamed)
    before, where = snapshot(site_packages.root), '`forward_args["loss_mask"] = loss_mask` names `loss_mask`'
    said = verdict(cli("check", site_packages.root), 4)
    assert "applies, but then megatron/bridge/training/gpt_step.py:" in said
    assert said.endswith(f"{where}, which `_forward_step_common` does not bind")
    for flags in (["--no-verify"], ["--python", probe_ok()]):
        assert refused(cli("apply", *flags, site_packages.root), 4) == f"mtp-mask-fix: error: {said}"
    assert snapshot(site_packages.root) == before
    fix = "".join(line.value for hunk in patch.files[0] for line in hunk if line.is_added)
    site_packages.gpt_step.write_text(renamed.replace(LABELS, LABELS + fix))  # by hand, or by an earlier tool
    result = cli("check", site_packages.root)
    assert result.returncode == 2 and where in result.stdout and "already applied" not in result.stdout


FIX = '    if use_mtp:\n        forward_args["loss_mask"] = loss_mask\n'  # the patch's lines, less its comments
PACKED = "    # Add packed sequence support\n"  # the line after the patch's, in the release
WRITTEN_ANOTHER_WAY = {
    "a dict entry": (LABELS, EQUIVALENT_FIX),
    "a keyword at the call": ("model(**forward_args)", "model(**forward_args, loss_mask=loss_mask)"),
    "our lines without our comments": (PACKED, FIX + PACKED),
    "the MTP test inline": (PACKED, FIX.replace("use_mtp", MTP_TEST) + PACKED),
    "no guard": (PACKED, FIX.split("\n")[1].removeprefix("    ") + "\n" + PACKED),
    "beside the call": (MODEL_CALL, '            forward_args["loss_mask"] = loss_mask\n' + MODEL_CALL),
}


class TestReading:
    """The reading of gpt_step.py shows the fix by what the code does, not by our exact lines: fixed (True), not
    fixed (False), or what it cannot tell (None: the probe's), naming the line."""

    def test_release_has_no_fix(self, release_gpt_step):
        # The release passes loss_mask only to build_schedule_plan, which does not count.
        assert "loss_mask=loss_mask" in release_gpt_step
        assert read(release_gpt_step).fixed is False and read(release_gpt_step).why.endswith("gets no loss_mask")

    def test_our_patch(self, patched_gpt_step):
        assert read(patched_gpt_step) == Reading(True)

    @pytest.mark.parametrize("way", WRITTEN_ANOTHER_WAY)
    def test_a_fix_written_another_way(self, release_gpt_step, way):
        old, new = WRITTEN_ANOTHER_WAY[way]
        assert read(release_gpt_step.replace(old, new, 1)) == Reading(True)

    @pytest.mark.parametrize(
        "guard",
        [
            "if not use_mtp:",
            "if config.mtp_num_layers > 1:",
            "for _ in range(use_mtp):",
            "with contextlib.nullcontext():",
            "if return_schedule_plan:",
            "try:",
        ],
    )
    def test_a_line_that_may_not_run_on_every_mtp_call_is_the_probes(self, release_gpt_step, guard):
        lines = FIX.replace("if use_mtp:", guard) + (
            "    except ValueError:\n        pass\n" if guard == "try:" else ""
        )
        text = release_gpt_step.replace(PACKED, lines + PACKED)
        assert read(text).fixed is None and f"`{guard}` may skip" in read(text).why

    def test_a_guard_whose_name_is_bound_twice_is_the_probes(self, patched_gpt_step):
        text = patched_gpt_step.replace(PACKED, "    use_mtp = not use_mtp\n" + PACKED, 1)
        assert read(text).fixed is None and "`if use_mtp:` may skip" in read(text).why

    @pytest.mark.parametrize(
        "value",
        [
            "None",
            "torch.ones_like(loss_mask)",
            "loss_mask.roll(-1, -1)",
            "labels",
            "loss_mask[:, 1:]",
            "loss_mask.clone()",
        ],
    )
    def test_a_tensor_that_is_not_the_batchs_mask_is_the_probes(self, release_gpt_step, value):
        text = release_gpt_step.replace(LABELS, LABELS.replace("    }", f'        "loss_mask": {value},\n    }}'))
        assert read(text).fixed is None and "may hand the model something other" in read(text).why

    @pytest.mark.parametrize(
        "value", ["loss_mask if state.cfg else None", "None if loss_mask is None else loss_mask.clone()"]
    )
    def test_a_mask_under_a_condition_is_the_probes(self, release_gpt_step, value):
        """Even the same tensor whenever there is one: check says fixed only where it can prove it."""
        assert (
            read(release_gpt_step.replace(PACKED, f'    forward_args["loss_mask"] = {value}\n' + PACKED)).fixed is None
        )

    @pytest.mark.parametrize("override", OVERRIDES)
    def test_a_later_word_on_the_mask_overrides_the_fix(self, patched_gpt_step, override):
        """What the model receives is the last word on loss_mask before the call, not the first."""
        assert read(patched_gpt_step).fixed
        assert read(patched_gpt_step.replace(MODEL_CALL, f"            {override}\n{MODEL_CALL}")).fixed is None

    def test_the_mask_as_the_last_word_after_a_none_is_the_fix(self, release_gpt_step):
        fixed = release_gpt_step.replace(LABELS, EQUIVALENT_FIX.replace(": loss_mask", ": None"))
        assert read(fixed).fixed is None
        assert read(
            fixed.replace(MODEL_CALL, f'            forward_args["loss_mask"] = loss_mask\n{MODEL_CALL}')
        ).fixed

    def test_a_name_the_function_does_not_bind(self, patched_gpt_step):
        """The patch's lines where the function no longer binds `loss_mask`: they would raise NameError."""
        text = patched_gpt_step.replace(
            "            loss_mask,\n            attention_mask,", "            mask,\n            attention_mask,"
        )
        at = text[: text.index('forward_args["loss_mask"] = loss_mask')].count("\n") + 1
        said = '`forward_args["loss_mask"] = loss_mask` names `loss_mask`, which `_forward_step_common` does not bind'
        assert unbound(text, {at}) == f"gpt_step.py:{at} {said}"
        assert (
            read(text).fixed is None
            and said.removeprefix('`forward_args["loss_mask"] = loss_mask` ') in read(text).why
        )
        assert unbound(patched_gpt_step, {at}) == ""

    def test_a_file_that_does_not_parse_is_not_the_fix(self):
        assert read("def _forward_step_common(:\n", "gpt_step.py") == Reading(False, "gpt_step.py:1 does not parse")

    @pytest.mark.parametrize(
        "use",
        [
            'del forward_args["loss_mask"]',
            'forward_args.pop("loss_mask", None)',
            "forward_args[key] = torch.ones_like(loss_mask)",
            'forward_args["loss_mask"].mul_(0)',
            'forward_args["loss_mask"] += 1',
            '_ = forward_args["loss_mask"]',
            'forward_args.get("loss_mask")',
            "forward_args.update(extra)",
            'forward_args.setdefault("loss_mask", None)',
            'forward_args.pop("padding_mask", None)',
            "forward_args.clear()",
            "forward_args = dict(forward_args)",
            "_strip(forward_args)",
            "output_tensor = model(**forward_args, **extra)",
        ],
    )
    def test_a_use_after_the_fix_it_cannot_follow_is_the_probes(self, patched_gpt_step, use):
        """Any other use of forward_args or its loss_mask after the fix leaves it unshown: the line is named."""
        text = patched_gpt_step.replace(MODEL_CALL, f"            {use}\n{MODEL_CALL}")
        line = text.split(MODEL_CALL)[0].count("\n")
        assert read(text, "gpt_step.py") == Reading(None, f"gpt_step.py:{line} `{use}` does what check cannot follow")

    @pytest.mark.parametrize(
        "use",
        [
            'forward_args["padding_mask"] = padding_mask',
            'assert "loss_mask" in forward_args',
        ],
    )
    def test_a_use_that_leaves_the_mask_as_it_is_keeps_it_fixed(self, patched_gpt_step, use):
        """Guards the reading's reach: another key set and a test of the dict (upstream main's own uses)."""
        assert read(patched_gpt_step.replace(MODEL_CALL, f"            {use}\n{MODEL_CALL}")) == Reading(True)

    def test_a_model_call_given_its_arguments_by_a_caller_is_not_shown(self, patched_gpt_step):
        """A helper that calls the model with the dict it is given: what the caller put in is not read."""
        text = patched_gpt_step + "\n\ndef _call(model, forward_args):\n    return model(**forward_args)\n"
        said = f"gpt_step.py:{text.count(chr(10))} `return model(**forward_args)` does what check cannot follow"
        assert read(text, "gpt_step.py") == Reading(None, said)


class TestStatus:
    """status: the patch's status block, then whether the target still needs the patch."""

    def test_status_before_and_after_apply(self, cli, patch, site_packages):
        before = cli("status", site_packages.root)
        assert before.returncode == 0, before.stderr
        for key, value in patch.metadata.items():
            assert f"  {key}: {value}\n" in before.stdout
        assert "the patch applies" in before.stdout.splitlines()[-1]
        assert cli("apply", "--no-verify", site_packages.root).returncode == 0
        after = cli("status", site_packages.root)  # exit codes as check's: 3, retire
        assert after.returncode == 3 and "already applied" in after.stdout.splitlines()[-1]
