"""The release lines: check names the patch file that fits each release (README's table), apply works on the lines
before 0.6, the backport is derived from the carried patch, and each release's tests run in the environment it
declares."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from packaging.version import Version

from maintain.repo import patch_file, release, release_lines
from mtp_mask_fix.reading import read
from tests.support.targets import BACKPORT_FILE, FIXED, PINNED, hunk_parts, verdict


pytestmark = pytest.mark.slow
RELEASES = {version: patch_file(version) for version in release_lines()}  # and the file that fixes each


class TestReleaseLines:
    """Every release line with the bug: check picks the patch file that fits it (README's table), apply works."""

    @pytest.mark.parametrize("version", RELEASES)
    def test_check_and_status_name_the_file_that_applies(self, cli, version):
        root = release(version).root
        said = (
            f"{root}: the patch applies (source hunks only, {RELEASES[version]}); the bug is present: `apply` fixes it"
        )
        assert verdict(cli("check", root), 0) == said
        assert cli("status", root).stdout.splitlines()[-1] == f"  on {said}"

    def test_pinned_release_is_one_of_them(self):
        assert PINNED in RELEASES

    @pytest.mark.parametrize("version", ["0.3.0", "0.5.1"])
    def test_apply_then_again_on_an_older_line(self, cli, tmp_path, version):
        copy = tmp_path / "site-packages"
        shutil.copytree(release(version).root / "megatron", copy / "megatron")
        result = cli("apply", "--no-verify", copy)
        assert result.stdout == f"{copy}: applied (source hunks only, {BACKPORT_FILE})\n", result.stderr
        assert read((copy / FIXED.removeprefix("src/")).read_text()).fixed
        assert "already applied" in verdict(cli("check", copy), 3)
        assert cli("apply", "--no-verify", copy).returncode == 0

    def test_readme_names_each_release_beside_its_file(self, repo_file):
        """README's release table lists each release line (by name or in an `A to B` span) in the row of its file."""
        rows = [line.split("|")[1:3] for line in repo_file("README.md").decode().splitlines() if line.startswith("| ")]
        for version, name in RELEASES.items():
            (listed,) = [releases for releases, file in rows if f"`{name}`" in file]
            spans = re.findall(r"(\d+\.\d+\.\d+) to (\d+\.\d+\.\d+)", listed)
            named = version in re.findall(r"\d+\.\d+\.\d+", listed)
            assert named or any(Version(a) <= Version(version) <= Version(b) for a, b in spans), (version, listed)


class TestBackport:
    """The backport is derived from the carried patch, never edited: a drift guard."""

    def test_committed_backport_equals_its_derivation(self, patch, repo_file):
        from maintain import refresh

        for line in refresh.backport_lines():
            committed = refresh.path(line, patch).read_text()
            assert committed == refresh.derive_for(line, patch), f"run `./run refresh --backports` ({line})"

    def test_same_added_lines_as_the_carried_patch(self, patch):
        from maintain import refresh
        from mtp_mask_fix.patch import Patch

        for path in (refresh.path(line, patch) for line in refresh.backport_lines()):
            assert hunk_parts(Patch.load(path), src_only=True) == hunk_parts(patch, src_only=True)


class TestReleaseEnvironments:
    """Each release's tests run with the megatron-core its submodule pins and the transformers its wheel declares."""

    def test_pinned_release_uses_this_environment(self):
        from maintain.envs.spec import spec

        assert spec(PINNED).key == ""

    @pytest.mark.parametrize(
        ("version", "key"),
        [
            ("0.3.0", "core0.16.0-transformers-lt5.0.0"),
            ("0.4.2", "core0.17.1-transformers-le5.3.0-ge5.0.0"),
            ("0.5.1", "core0.18.2-transformers-lt5.9.0-ge5.8.1"),
        ],
    )
    def test_older_lines_get_their_own(self, version, key):
        from maintain.envs.spec import spec

        assert spec(version).key == key

    @pytest.fixture
    def scratch_checkout(self, git, tmp_path, monkeypatch):
        """A scratch Megatron-Bridge checkout: (bridge, its submodule, the pinned commit); .work/src in tmp_path."""
        import maintain.envs.spec

        monkeypatch.setattr(maintain.envs.spec, "WORK", tmp_path / "work")
        lm, bridge = tmp_path / "lm", tmp_path / "bridge"
        (lm / "megatron" / "core").mkdir(parents=True)
        (lm / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 20\nPATCH = 0\n")
        git(lm, "init", "-q")
        git(lm, "add", ".")
        git(lm, "commit", "-q", "-m", "core")
        bridge.mkdir()
        (bridge / "pyproject.toml").write_text(
            '[project]\ndependencies = ["transformers[torch]>=5.8,<=5.12.1", "datasets ; python_version>\'3\'"]\n'
        )
        git(bridge, "init", "-q")
        git(bridge, "-c", "protocol.file.allow=always", "submodule", "-q", "add", str(lm), "3rdparty/Megatron-LM")
        git(bridge, "add", ".")
        git(bridge, "commit", "-q", "-m", "bridge")
        return bridge, (bridge / "3rdparty" / "Megatron-LM").resolve(), git(lm, "rev-parse", "HEAD").strip()

    def test_an_upstream_checkout_gets_its_submodules_core(self, scratch_checkout, tmp_path):
        """Upstream main's megatron-core is on no package index: `./run python DIR` builds it from the commit DIR
        pins, unpacked from git (not the submodule's working tree, with its local edits and stale build/), and keeps
        the transformers pin through its extras."""
        from maintain.envs.spec import checkout_spec

        bridge, source, commit = scratch_checkout
        (source / "megatron" / "core" / "uncommitted.py").write_text("")  # a local edit
        (source / "build" / "lib").mkdir(parents=True)  # a stale build
        unpacked = tmp_path / "work" / "src" / f"megatron-lm-{commit[:12]}"
        assert checkout_spec(bridge) == (
            f"core0.20.0-{commit[:12]}-transformers-ge5.8-le5.12.1",
            ["megatron-core==0.20.0", "transformers>=5.8,<=5.12.1", "datasets"],
            unpacked,
        )
        assert sorted(str(p.relative_to(unpacked)) for p in unpacked.rglob("*")) == [
            "megatron",
            "megatron/core",
            "megatron/core/package_info.py",
        ]
        assert [p.name for p in unpacked.parent.iterdir()] == [unpacked.name]  # no temporary left
        (unpacked / "megatron" / "core" / "package_info.py").unlink()
        checkout_spec(bridge)  # unpacked once: an existing tree is reused as it is
        assert not (unpacked / "megatron" / "core" / "package_info.py").exists()

    @pytest.mark.parametrize("state", ["moved", "staged", "not checked out"])
    def test_an_upstream_checkout_off_its_pinned_core_is_refused(self, scratch_checkout, git, state):
        """Only the commit HEAD pins will do: the submodule moved on, or moved and staged (`git submodule status`
        would call that clean, as it compares with the index), or absent."""
        from maintain.envs.spec import checkout_spec
        from mtp_mask_fix.errors import ToolError

        bridge, source, _ = scratch_checkout
        if state == "not checked out":
            git(bridge, "submodule", "-q", "deinit", "-f", "3rdparty/Megatron-LM")
        else:
            git(source, "commit", "-q", "--allow-empty", "-m", "not the pinned commit")
            if state == "staged":
                git(bridge, "add", "3rdparty/Megatron-LM")
        with pytest.raises(ToolError, match="run `git -C .* submodule update --init 3rdparty/Megatron-LM`") as refused:
            checkout_spec(bridge)
        assert refused.value.code == 2 and "\n" not in str(refused.value)

    @pytest.mark.parametrize(
        ("breakage", "reason"),
        [
            ("no dependencies", "no static \\[project\\].dependencies"),
            ("dynamic dependencies", "no static \\[project\\].dependencies"),
            ("no package_info.py", "no 3rdparty/Megatron-LM/megatron/core/package_info.py"),
            ("no version", "no MAJOR/MINOR/PATCH version in"),
        ],
    )
    def test_a_broken_upstream_checkout_is_one_line(self, scratch_checkout, git, breakage, reason):
        from maintain.envs.spec import checkout_spec
        from mtp_mask_fix.errors import ToolError

        bridge, source, _ = scratch_checkout
        info = source / "megatron" / "core" / "package_info.py"
        if breakage == "no dependencies":
            (bridge / "pyproject.toml").write_text('[project]\nname = "megatron-bridge"\n')
        elif breakage == "dynamic dependencies":
            (bridge / "pyproject.toml").write_text('[project]\ndynamic = ["dependencies"]\n')
        else:
            info.unlink() if breakage == "no package_info.py" else info.write_text("MAJOR = 0\nMINOR = x\n")
            git(source, "commit", "-q", "-am", breakage)
            git(bridge, "commit", "-q", "-am", breakage)
        with pytest.raises(ToolError, match=reason) as refused:
            checkout_spec(bridge)
        assert refused.value.code == 2 and "\n" not in str(refused.value)

    def test_a_mistyped_checkout_is_no_such_directory(self, tmp_path):
        """A path that is not a directory must not read as a release version ("not on the package index")."""
        from maintain.repo import REPO

        typo = tmp_path / "Megatron-Brigde"
        done = subprocess.run(
            [sys.executable, "-m", "maintain.envs", str(typo)], cwd=REPO, capture_output=True, text=True
        )
        assert (done.returncode, done.stdout, done.stderr) == (
            2,
            "",
            f"mtp-mask-fix: error: {typo}: no such directory\n",
        )

    def test_help_is_the_usage_not_a_release(self):
        """`./run python --help` prints its usage; it is not looked up on the package index as a release."""
        from maintain.repo import REPO

        done = subprocess.run(
            [sys.executable, "-m", "maintain.envs", "--help"], cwd=REPO, capture_output=True, text=True
        )
        assert (done.returncode, done.stderr) == (0, "") and done.stdout.startswith("usage: ./run python")

    def test_lines_toml_is_each_tags_submodule(self, upstream_checkout):
        bridge, lm = upstream_checkout, upstream_checkout / "3rdparty" / "Megatron-LM"
        for version, core in ((v, row["megatron-core"]) for v, row in release_lines().items() if row):
            tree = subprocess.run(
                ["git", "-C", bridge, "ls-tree", f"v{version}", "3rdparty/Megatron-LM"], capture_output=True, text=True
            )
            if not tree.stdout:  # untagged (0.6.1): its row says why
                continue
            info = subprocess.run(
                ["git", "-C", lm, "show", f"{tree.stdout.split()[2]}:megatron/core/package_info.py"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            parts = dict(re.findall(r"^(MAJOR|MINOR|PATCH) = (\d+)", info, re.M))
            assert core == f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}", version


def _wheel(path, name: str, version: str) -> None:
    """A minimal valid wheel at `path`, as pip reads one (METADATA, WHEEL, RECORD)."""
    import zipfile

    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: cp311-cp311-manylinux_2_28_x86_64\n",
        )
        wheel.writestr(f"{info}/RECORD", "")


class TestEnvironmentSetUp:
    """How ./run makes the environments: uv syncs each from pyproject.toml and uv.lock; the two files uv.lock names
    in .work/dists come from the machine's own package sources (torch) and PyPI (megatron-core's sdist)."""

    def test_run_is_the_dispatch(self):
        from maintain.repo import REPO

        assert len((REPO / "run").read_text().splitlines()) <= 100

    def test_the_set_up_needs_only_the_standard_library(self):
        """./run imports maintain.envs with the bare Python 3.11 it found, before any environment exists."""
        from maintain.repo import REPO

        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run(
            [sys._base_executable, "-S", "-c", "import maintain.envs.__main__"], cwd=REPO, env=env, capture_output=True
        )
        assert done.returncode == 0, done.stderr.decode()

    @pytest.fixture
    def torch_at(self, tmp_path, monkeypatch):
        """pyproject.toml's torch source moved into tmp_path, and pip told to read no configuration but a find-links
        folder of tmp_path (PIP_NO_INDEX: nothing from the network)."""
        import maintain.envs.make

        project = maintain.envs.make.project()
        wheel = tmp_path / "dists" / project["tool"]["uv"]["sources"]["torch"]["path"].rpartition("/")[2]
        project["tool"]["uv"]["sources"]["torch"]["path"] = str(wheel)
        monkeypatch.setattr(maintain.envs.make, "project", lambda: project)
        (tmp_path / "links").mkdir()
        for name, value in {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(tmp_path / "links")}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        return wheel

    def test_torch_comes_from_the_machines_own_package_sources(self, torch_at, tmp_path):
        from maintain.envs.make import stage_torch

        _, version = torch_at.name.split("-")[:2]
        _wheel(tmp_path / "links" / torch_at.name, "torch", version)
        stage_torch()
        assert torch_at.read_bytes() == (tmp_path / "links" / torch_at.name).read_bytes()

    def test_no_torch_anywhere_is_one_line(self, torch_at, capsys):
        """Not among the machine's sources nor (PIP_NO_INDEX) on PyTorch's index: one line, nothing staged."""
        from maintain.envs.make import TORCH_INDEX, stage_torch
        from mtp_mask_fix.errors import ToolError

        with pytest.raises(ToolError, match=r"^torch==2\.13\.0\+cpu: not downloadable") as refused:
            stage_torch()
        assert refused.value.code == 2 and "\n" not in str(refused.value)
        assert f"downloading it from {TORCH_INDEX}" in capsys.readouterr().err
        assert not torch_at.parent.exists() or not list(torch_at.parent.iterdir())

    @pytest.mark.parametrize("served", ["the sdist", "another file"])
    def test_the_core_sdist_is_checked_against_the_index(self, tmp_path, monkeypatch, served):
        import hashlib
        import io
        import json

        import maintain.envs.make
        from mtp_mask_fix.errors import ToolError

        sdist, data = "megatron_core-0.99.0.tar.gz", b"the sdist"
        page = {
            "files": [
                {"filename": sdist, "url": "https://files/x", "hashes": {"sha256": hashlib.sha256(data).hexdigest()}}
            ]
        }

        def urlopen(request, timeout):
            url = getattr(request, "full_url", request)
            return io.BytesIO(json.dumps(page).encode() if url == maintain.envs.make.CORE_INDEX else served.encode())

        monkeypatch.setattr(maintain.envs.make, "DISTS", tmp_path / "dists")
        monkeypatch.setattr(maintain.envs.make.urllib.request, "urlopen", urlopen)
        if served == "the sdist":
            maintain.envs.make.stage_core("0.99.0")
            assert (tmp_path / "dists" / sdist).read_bytes() == data
        else:
            with pytest.raises(ToolError, match=f"^{sdist}: the download does not match the sha256"):
                maintain.envs.make.stage_core("0.99.0")
            assert not (tmp_path / "dists").exists() or not list((tmp_path / "dists").iterdir())

    def test_a_lines_project_is_this_one_with_its_pins(self, upstream_tree):
        """The generated pyproject.toml of a line: the dev group with the line's three pins in place of the same
        names, the same [tool.uv] with absolute paths; a checkout's core from its tree, of the version it names."""
        import tomllib

        from maintain.envs.make import _line_project, project
        from maintain.envs.spec import Spec
        from maintain.repo import REPO

        root = project()
        pins = ["megatron-core==0.18.2", "transformers<5.9.0,>=5.8.1", "datasets>=2"]
        for tree in (None, upstream_tree):
            made = tomllib.loads(_line_project(Spec("key", pins, tree)))
            kept = [
                r
                for r in root["dependency-groups"]["dev"]
                if not r.startswith(("megatron-core", "transformers", "datasets"))
            ]
            assert made["dependency-groups"]["dev"] == kept + pins
            uv = made["tool"]["uv"]
            assert uv["package"] is False and not {"config-settings-package", "cache-keys"} & set(uv)
            assert uv["index"] == [{"name": "dists", "url": str(REPO / ".work" / "dists"), "format": "flat"}]
            assert uv["sources"]["torch"]["path"] == str(REPO / root["tool"]["uv"]["sources"]["torch"]["path"])
            (core,) = uv["dependency-metadata"]
            if tree is None:
                assert "megatron-core" not in uv["sources"] and "version" not in core
            else:
                assert uv["sources"]["megatron-core"] == {"path": str(tree)} and core["version"] == "0.18.2"

    def test_a_transformers_4_line_keeps_huggingface_hub_below_1(self):
        """transformers 4 needs huggingface-hub < 1.0: unbounded, uv keeps the dev lock's newer hub and datasets and
        resolves a transformers 4.1x, whose tokenizers builds only from source."""
        import tomllib

        from maintain.envs.make import _line_project
        from maintain.envs.spec import Spec

        lines = {"transformers<5.0.0": ["huggingface-hub<1.0"], "transformers<=5.3.0,>=5.0.0": []}
        for transformers, wanted in (lines | {"transformers<5.9.0,>=5.8.1": [], "transformers<=5.3.0": []}).items():
            made = tomllib.loads(_line_project(Spec("key", ["megatron-core==0.16.0", transformers, "datasets>=2"])))
            assert made["tool"]["uv"].get("constraint-dependencies", []) == wanted

    @pytest.fixture
    def upstream_tree(self, tmp_path):
        tree = tmp_path / "megatron-lm-0123456789ab"
        tree.mkdir()
        return tree
