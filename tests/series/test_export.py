"""make pr TOPIC=... and patches/overlay-topics, on the fake upstream (fast, offline)."""

from __future__ import annotations

from fake_upstream import ENVS_PY, UPSTREAM, envs_edit_1, envs_edit_2, make_patch, ok

ADA = "Ada Lovelace <ada@example.com>"


def _identity(tmp_path, name: str | None = "Ada Lovelace", email: str | None = "ada@example.com") -> dict:
    config = tmp_path / "gitconfig"
    lines = ["[user]"] + ([f"\tname = {name}"] if name else []) + ([f"\temail = {email}"] if email else [])
    config.write_text("\n".join(lines) + "\n")
    return {"GIT_CONFIG_GLOBAL": str(config), "GIT_CONFIG_NOSYSTEM": "1"}


def _branches(fs) -> list[str]:
    return fs.git("branch", "--format=%(refname:short)").splitlines()


def _worktrees(fs) -> int:
    return len(fs.git("worktree", "list", "--porcelain").split("\n\n"))


def _root(fs) -> str:
    return fs.git("rev-list", "--max-parents=0", "HEAD")


def test_each_topic_exports_alone_without_touching_the_build_tree(fake_series, tmp_path):
    """Two topics edit vllm/envs.py at distant places; each becomes its own PR on pristine upstream."""
    fs = fake_series
    fs.add_patch("0003-other-flag.patch",
               make_patch("Add OTHER_FLAG", "vllm/envs.py", ENVS_PY, envs_edit_2(ENVS_PY), topic="fetch-kv"))
    fs.commit()
    env = _identity(tmp_path)
    ok(fs.run("apply"))
    main_head = fs.git("rev-parse", "HEAD")
    edited = fs.build / "vllm/utils.py"
    original = edited.read_text()
    edited.write_text(original + "# my local work\n")

    report = ok(fs.run("pr", "--topic", "fetch-kv", env=env)).stdout
    assert "pr/fetch-kv" in report and "main untouched" in report and "check: 3 file(s) OK" in report
    # build/vllm: same branch, same HEAD, uncommitted work intact, no scratch worktree left.
    assert fs.git("symbolic-ref", "--short", "HEAD") == "main" and fs.git("rev-parse", "HEAD") == main_head
    assert edited.read_text() == original + "# my local work\n" and _worktrees(fs) == 1
    subjects = fs.git("log", "--reverse", "--format=%s", f"{_root(fs)}..pr/fetch-kv").splitlines()
    assert subjects == ["Add the new files of fetch-kv", "Comment sub", "Add OTHER_FLAG"]
    envs = fs.git("show", "pr/fetch-kv:vllm/envs.py")
    assert "OTHER_FLAG = 1" in envs and "SERIES_FLAG" not in envs
    message = fs.git("log", "-1", "--format=%an <%ae>%n%B", "pr/fetch-kv")
    assert message.startswith(ADA) and "Why: because the test says so, on two lines." in message
    assert "Series-Patch" not in message and "Topic:" not in message and "Drop when" not in message

    dist = fs.root / "dist" / "fetch-kv"
    files = sorted(p.name for p in dist.iterdir())
    assert files == ["0001-Add-the-new-files-of-fetch-kv.patch", "0002-Comment-sub.patch",
                     "0003-Add-OTHER_FLAG.patch", "PR_DESCRIPTION.md"]
    for name in files[:3]:
        text = (dist / name).read_text()
        assert text.count(f"Signed-off-by: {ADA}") == 1 and f"From: {ADA}" in text
    description = (dist / "PR_DESCRIPTION.md").read_text()
    assert 'FILES="vllm/envs.py vllm/ops/new_kernel.py vllm/utils.py"\n' in description

    # Exporting again gives the same commits and byte-identical files.
    first = {p.name: p.read_bytes() for p in dist.iterdir()}
    tip = fs.git("rev-parse", "pr/fetch-kv")
    ok(fs.run("pr", "--topic", "fetch-kv", env=env))
    assert {p.name: p.read_bytes() for p in dist.iterdir()} == first and fs.git("rev-parse", "pr/fetch-kv") == tip

    # The build tree is still the series: once the edit is undone, apply has nothing to do.
    edited.write_text(original)
    assert "up to date" in ok(fs.run("apply")).stdout
    assert fs.git("status", "--porcelain", cwd=fs.root) == ""   # nothing written outside build/ and dist/


def test_a_topic_that_needs_another_topics_hunk_fails_clearly(fake_series, tmp_path):
    fs = fake_series
    base = envs_edit_1(ENVS_PY)  # made on top of 0001 (mla-fusion), not on pristine upstream
    fs.add_patch("0003-use-series-flag.patch",
               make_patch("Use SERIES_FLAG", "vllm/envs.py", base,
                          base.replace("VALUE_4 = 4\n", "VALUE_4 = 4\nUSES = SERIES_FLAG\n"),
                          topic="order-contract"))
    ok(fs.run("apply"))  # the whole series applies; the topic alone does not
    proc = fs.run("pr", "--topic", "order-contract", env=_identity(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert ("topic order-contract: patches/0003-use-series-flag.patch does not apply on pristine upstream "
            "without the other topics: patch failed: vllm/envs.py") in err
    assert "depend on a hunk of patches/0001-add-series-flag.patch (topic mla-fusion)" in err
    assert "pr/order-contract" not in _branches(fs) and not (fs.root / "dist" / "order-contract").exists()
    assert _worktrees(fs) == 1 and fs.git("status", "--porcelain") == ""


def test_export_without_a_git_identity_for_the_sign_off_is_refused_first(fake_series, tmp_path):
    fs = fake_series
    env = _identity(tmp_path, name="Ada Lovelace", email=None)
    with open(env["GIT_CONFIG_GLOBAL"], "a") as f:
        f.write("\tuseConfigOnly = true\n")   # no guessing from the host name, on any machine
    proc = fs.run("pr", "--topic", "fetch-kv", env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "git has no author identity" in proc.stderr and "Signed-off-by" in proc.stderr
    assert "auto-detection is disabled" in proc.stderr        # git's own reason
    assert not fs.build.exists() and not (fs.root / "dist").exists()


def test_upstream_ci_checks_use_the_pinned_trees_config(fake_series, tmp_path):
    """ruff runs with the pinned tree's pyproject.toml."""
    fs = fake_series
    env = _identity(tmp_path)
    long_line = ENVS_PY.replace("VALUE_15 = 15\n", "VALUE_15 = 15  # fifteen, explained at some length\n")
    fs.add_patch("0003-document-fifteen.patch",
               make_patch("Document VALUE_15", "vllm/envs.py", ENVS_PY, long_line, topic="fetch-kv"))
    ok(fs.run("pr", "--topic", "fetch-kv", env=env))  # ruff's defaults allow 88 columns

    ruff_config = '[tool.ruff]\nline-length = 40\n\n[tool.ruff.lint]\nselect = ["E501"]\n'
    fs.upstream({**UPSTREAM, "pyproject.toml": ruff_config})
    ok(fs.run("apply", "--force"))  # a rebuilt tree: earlier pr/ branches are gone with it
    proc = fs.run("pr", "--topic", "fetch-kv", env=env)
    assert proc.returncode == 2 and "ruff check failed (pinned tree's pyproject.toml)" in proc.stderr
    assert "vllm/envs.py:30:41: E501" in proc.stderr
    assert "The export stopped: pr/fetch-kv and dist/fetch-kv/ were not written." in proc.stderr
    assert "pr/fetch-kv" not in _branches(fs) and _worktrees(fs) == 1



def test_overlay_topics_and_pr_tests_are_linted(fake_series):
    fs = fake_series
    topics = fs.patches / "overlay-topics"
    topics.write_text("vllm/ops/*.py misc\nvllm/gone.py fetch-kv\n")
    (fs.patches / "pr-tests").write_text("tests/missing.py tests/kernels/test_x.py fetch-kv\n"
                                         "tests/missing.py README.md fetch-kv\n"
                                         "tests/missing.py tests/test_y.py nope\n")
    out = fs.run("check").stdout
    assert "patches/overlay-topics:1: unknown topic 'misc'" in out
    assert "patches/overlay-topics:2: 'vllm/gone.py' matches no overlay file" in out
    assert "patches/pr-tests:1: tests/missing.py does not exist" in out
    assert "patches/pr-tests:2: README.md is not a test file of vLLM's tests/" in out
    assert "patches/pr-tests:3: unknown topic 'nope'" in out
    topics.unlink()
    assert "vllm_overlay/vllm/ops/new_kernel.py: no topic" in fs.run("check").stdout
    proc = fs.run("pr", "--topic", "fetch-kv")
    assert proc.returncode == 2 and "overlay files without a valid topic" in proc.stderr


def test_a_shared_file_ships_once_and_the_prs_apply_alone_and_stacked(fake_series, tmp_path):
    """A file two topics ship is added by the first PR in series order in a commit of its own;
    the later PR is built on that same commit (same id) and leaves it out of its patches; each
    PR's tests (patches/pr-tests) ship at vLLM's layout; `pr-stack` applies each PR alone and all
    stacked, and the stack is the series plus the tests."""
    fs = fake_series
    env = _identity(tmp_path)
    (fs.root / "vllm_overlay" / "vllm" / "ops" / "shared_helper.py").write_text(
        '"""A helper both PRs use."""\n\n\ndef helper():\n    return 1\n')
    (fs.patches / "overlay-topics").write_text("vllm/ops/new_kernel.py fetch-kv\n"
                                               "vllm/ops/shared_helper.py fetch-kv,mla-fusion\n")
    (fs.root / "tests" / "kernels").mkdir(parents=True)
    (fs.root / "tests" / "kernels" / "test_new_kernel.py").write_text(
        "from vllm.ops.new_kernel import kernel\n\n\ndef test_kernel():\n    assert kernel() == 42\n")
    (fs.patches / "pr-tests").write_text(
        "# series test -> vLLM path -> topic\n"
        "tests/kernels/test_new_kernel.py tests/kernels/attention/test_new_kernel.py fetch-kv\n")
    ok(fs.run("apply"))
    for topic in ("fetch-kv", "mla-fusion"):
        ok(fs.run("pr", "--topic", topic, env=env))
    root = _root(fs)
    fk = fs.git("log", "--reverse", "--format=%H %s", f"{root}..pr/fetch-kv").splitlines()
    mla = fs.git("log", "--reverse", "--format=%H %s", f"{root}..pr/mla-fusion").splitlines()
    assert [c.split(" ", 1)[1] for c in fk] == [
        "Add shared_helper.py, shared by PRs fetch-kv and mla-fusion", "Add the new files of fetch-kv",
        "Add tests of fetch-kv", "Comment sub"]
    assert mla[0] == fk[0]                                # the same commit, not a copy
    assert [c.split(" ", 1)[1] for c in mla[1:]] == ["Add SERIES_FLAG"]
    assert sorted(p.name for p in (fs.root / "dist" / "mla-fusion").glob("*.patch")) == [
        "0001-Add-SERIES_FLAG.patch"]
    assert "tests/kernels/attention/test_new_kernel.py" in fs.git(
        "show", "--name-only", "--format=", "pr/fetch-kv~1")
    fk_body = (fs.root / "dist" / "fetch-kv" / "PR_DESCRIPTION.md").read_text()
    mla_body = (fs.root / "dist" / "mla-fusion" / "PR_DESCRIPTION.md").read_text()
    assert "shared with PR `mla-fusion`, which builds on that commit" in fk_body
    assert ("Depends on PR `fetch-kv`: its first commit adds `vllm/ops/shared_helper.py`, which this PR "
            "uses too") in mla_body
    assert ("CUDA_VISIBLE_DEVICES= VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 pytest -q "
            "tests/kernels/attention/test_new_kernel.py") in fk_body

    proc = ok(fs.run("pr-stack", env=env))
    assert "pr-stack: fetch-kv: 4 patch(es) apply on pristine vLLM 9.9.9" in proc.stdout
    assert ("pr-stack: mla-fusion: 1 patch(es) apply on pristine vLLM 9.9.9 after "
            "fetch-kv/0001-Add-shared_helper.py-shared-by-PRs-fetch-kv-and-mla-.patch") in proc.stdout
    assert "pr-stack: fetch-kv, mla-fusion stacked = the series + 1 PR test file(s)" in proc.stdout
    assert _worktrees(fs) == 1 and fs.git("status", "--porcelain") == ""

    # An export that is not the series any more (main moved on) is caught.
    (fs.build / "vllm/utils.py").write_text((fs.build / "vllm/utils.py").read_text() + "X = 1\n")
    fs.git("commit", "-qam", "local")
    proc = fs.run("pr-stack", env=env)
    assert proc.returncode == 2 and "the stacked PRs are not the series" in proc.stderr
    assert "M\tvllm/utils.py" in proc.stderr
