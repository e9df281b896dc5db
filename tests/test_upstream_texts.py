"""The texts in upstream/ for Megatron-Bridge's maintainers and Megatron-LM's: every link pinned, the credit left to the
poster, nothing of this repo in them, the code and the warning they quote the patches', and (with an upstream checkout)
each linked line range holding the code its link text quotes."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

from maintain.repo import FIXED_FILE, REPO, UPSTREAM_TEST
from maintain.upstreams import MEGATRON_LM_PATCHES, base_commit, load
from mtp_mask_fix.patch import Patch


TEXTS = {path.name: path.read_text() for path in sorted((REPO / "upstream").glob("*.md"))}
FOR_MEGATRON_LM = {"megatron-lm-issue.md", "megatron-lm-pr-body.md", "megatron-lm-pr-body-dev.md"} | {
    "megatron-lm-callers-pr-body.md",
    "megatron-lm-callers-issue.md",
}
CORE_PATCHES = [load(path) for path in sorted(MEGATRON_LM_PATCHES.glob("*.patch"))]
BRIDGE = "NVIDIA-NeMo/Megatron-Bridge"
MEGATRON_LM = "NVIDIA/Megatron-LM"
SUBMODULE = "3rdparty/Megatron-LM"
# A link into one of the two repositories: [text](https://github.com/REPO/blob|tree/REV/PATH#Lfirst-Llast).
LINK = re.compile(
    r"\[(?P<text>[^\]]+)\]\((?P<url>https://github\.com/(?P<repo>[\w.-]+/[\w.-]+)/(?:blob|tree)/(?P<rev>[^/]+)/"
    r"(?P<path>[^)#]+)(?:#L(?P<first>\d+)(?:-L(?P<last>\d+))?|#[\w-]+)?)\)"
)
LINKS = [link for text in TEXTS.values() for link in LINK.finditer(text)]
LINKS_FOR = {name: list(LINK.finditer(text)) for name, text in TEXTS.items()}
# What the texts say is not there, which no quote can show: {a linked path: strings absent from what its links show}.
ABSENT = {
    # FalconH1Model.forward's parameters
    "src/megatron/bridge/models/falcon_h1/modeling_falconh1/falconh1_model.py": ("loss_mask", "**", "packed_seq"),
    "src/megatron/bridge/recipes": ("falcon",),  # no FalconH1 recipe
}
# What the texts say a file reads only where they link: {a linked path: (a name, the one line elsewhere that holds it)}.
ONLY_WHERE_LINKED = {
    "megatron/core/models/hybrid/hybrid_model.py": ("loss_mask", "loss_mask: Optional[Tensor] = None,"),  # forward's
}


def _quotes(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def _added(path: str) -> str:
    """The lines the patch adds to `path`, without the blank lines at their end."""
    lines = [
        line.value for file in load().files if file.path == path for hunk in file for line in hunk if line.is_added
    ]
    return "".join(lines).rstrip("\n") + "\n"


def test_the_texts_are_there():
    assert set(TEXTS) == {"review-6105.md", "pr-body.md", "follow-up-6105-landed.md"} | FOR_MEGATRON_LM


def test_every_link_names_a_commit_that_never_moves():
    repos = {link["repo"] for link in LINKS}
    urls = re.findall(rf"https://github\.com/(?:{BRIDGE}|{MEGATRON_LM})/(?:blob|tree)/\S+", "".join(TEXTS.values()))
    assert repos == {BRIDGE, MEGATRON_LM} and len(urls) == len(LINKS)  # every such URL is a link LINK reads
    base = base_commit(load())
    assert {link["rev"] for link in LINKS if link["repo"] == BRIDGE} == {base}
    assert all(re.fullmatch(r"[0-9a-f]{40}", link["rev"]) for link in LINKS if link["repo"] == MEGATRON_LM)


def test_megatron_lm_texts_link_megatron_lm_at_the_commits_its_patches_are_made_on():
    links = [link for name in FOR_MEGATRON_LM for link in LINKS_FOR[name]]
    assert {link["repo"] for link in links} == {MEGATRON_LM}
    assert {link["rev"] for link in links} <= {base_commit(patch) for patch in CORE_PATCHES}


def _warning(patch: Patch) -> str:
    """The message the patch logs: the string literals its added lines pass after `logging.WARNING,`, joined."""
    added = "".join(line.value for file in patch.files for hunk in file for line in hunk if line.is_added)
    literals = re.search(r"logging\.WARNING,\n((?:\s+\".*\",?\n)+)", added)[1]
    return "".join(ast.literal_eval(literal.strip().rstrip(",")) for literal in literals.splitlines())


def test_the_warning_the_megatron_lm_prs_quote_is_the_one_every_patch_logs():
    (warning,) = {_warning(patch) for patch in CORE_PATCHES}
    for name in ("megatron-lm-pr-body.md", "megatron-lm-pr-body-dev.md"):
        (quoted,) = re.findall(r"^```\n(.*?)\n```$", TEXTS[name], re.S | re.M)
        assert " ".join(quoted.split()) == warning


def test_every_line_link_quotes_the_code_it_points_at():
    ranges = [link for link in LINKS if link["first"]]
    assert ranges and all(_quotes(link["text"]) for link in ranges)
    assert set(ABSENT) | set(ONLY_WHERE_LINKED) <= {link["path"] for link in LINKS}


def test_the_co_author_is_left_to_the_poster():
    (credit,) = re.findall(r"^Co-authored-by:.*$", TEXTS["pr-body.md"], re.M)
    assert re.fullmatch(r"Co-authored-by: <[^<>@]+> <[^<>@]+>", credit), credit  # no address is guessed


def _posted(text: str) -> str:
    """The text as posted: without the note to the poster at its top, which says to delete it."""
    return re.sub(r"\A<!--.*?-->\n", "", text, flags=re.S)


def test_no_text_speaks_of_this_repo():
    words = ("mtp-mask-fix", "mtp_mask_fix", "./run", ".work", "tiny model", "tinymodel")
    said = {name: [w for w in words if w in _posted(text).lower()] for name, text in TEXTS.items()}
    assert said == dict.fromkeys(TEXTS, [])


@pytest.mark.parametrize(
    "name", ["megatron-lm-pr-body.md", "megatron-lm-pr-body-dev.md", "megatron-lm-callers-pr-body.md"]
)
def test_a_megatron_lm_pr_body_is_short_and_its_note_says_to_check_it_on_live_upstream_first(name):
    note = TEXTS[name][: TEXTS[name].index("-->")]
    assert "Delete this whole comment" in note and "./run refresh --applies --upstream" in note
    assert len(_posted(TEXTS[name]).split()) < 400


def test_the_suggested_code_is_the_patchs():
    fix, tests = _added(FIXED_FILE), _added(UPSTREAM_TEST)
    assert fix.strip() and tests.strip() and fix in TEXTS["review-6105.md"] and tests in TEXTS["review-6105.md"]
    assert re.sub(r"(?m)^(?=.)", "+", fix) in TEXTS["follow-up-6105-landed.md"]


def _git(where: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True)


@pytest.mark.slow
def test_megatron_lm_links_for_bridge_name_the_commit_upstream_pins(upstream_checkout):
    pin = _git(upstream_checkout, "rev-parse", f"{base_commit(load())}:{SUBMODULE}").stdout.strip()
    links = [link for name in set(TEXTS) - FOR_MEGATRON_LM for link in LINKS_FOR[name]]
    assert {link["rev"] for link in links if link["repo"] == MEGATRON_LM} == {pin}


@pytest.mark.slow
@pytest.mark.parametrize("url", sorted({link["url"] for link in LINKS}), ids=lambda url: url.split("/", 7)[-1])
def test_a_link_shows_what_its_text_says(upstream_checkout, url):
    link = next(link for link in LINKS if link["url"] == url)
    rev, path, first, last = link["rev"], link["path"], link["first"], link["last"]
    quotes = [quote for each in LINKS if each["url"] == url for quote in _quotes(each["text"])]  # in every text
    clone = upstream_checkout / SUBMODULE if link["repo"] == MEGATRON_LM else upstream_checkout
    if _git(clone, "cat-file", "-e", f"{rev}^{{commit}}").returncode:  # a Megatron-LM patch's base, newer than the pin
        pytest.skip(f"{clone} does not hold {rev}: fetch it there (git -C {clone} fetch origin {rev})")
    absent = ABSENT.get(path, ())
    if "/tree/" in url:  # a folder: it is there, and nothing in it holds what the text says it lacks
        assert _git(clone, "ls-tree", "-d", rev, path).stdout.strip() and set(quotes) <= {path}
        assert [word for word in absent if _git(clone, "grep", "-qiF", word, rev, "--", path).returncode == 0] == []
        return
    shown = _git(clone, "show", f"{rev}:{path}").stdout
    if first:
        shown = "\n".join(shown.splitlines()[int(first) - 1 : int(last or first)])
        assert [quote for quote in quotes if " ".join(quote.split()) not in " ".join(shown.split())] == []
    assert shown.strip() and [word for word in absent if word in shown.lower()] == []


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(ONLY_WHERE_LINKED))
def test_a_name_said_to_be_read_only_where_linked_is_nowhere_else(upstream_checkout, path):
    name, declaration = ONLY_WHERE_LINKED[path]
    links = [link for link in LINKS if link["path"] == path]
    clone = upstream_checkout / SUBMODULE if links[0]["repo"] == MEGATRON_LM else upstream_checkout
    linked = {number for link in links for number in range(int(link["first"]), int(link["last"] or link["first"]) + 1)}
    lines = _git(clone, "show", f"{links[0]['rev']}:{path}").stdout.splitlines()
    elsewhere = [line.strip() for number, line in enumerate(lines, 1) if name in line and number not in linked]
    assert elsewhere == [declaration]
