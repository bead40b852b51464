"""Caches that cannot be poisoned (finetune/cache.py): one process builds, the others wait, and a folder counts
only when its manifest lists every file. The two-process cases run with rank 1 arriving first, so the race the
old code lost (a rank other than 0 saving a model without its weights, and renaming it into place first) is
played out every time, not left to chance."""

import json
import os
import subprocess
import sys
import time

import pytest

from finetune import cache
from tests.helpers import ENV, ROOT, write_tiny_gguf

WORKER = str(ROOT / "tests" / "cache_worker.py")


def two_processes(mode: str, tmp_path) -> list:
    """Run the worker as ranks 0 and 1 at once; return their results in rank order."""
    procs = [subprocess.Popen([sys.executable, WORKER, mode, str(rank), "2", str(tmp_path)], env=ENV, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out
    return [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]


def model_files(path) -> set:
    return {p.name for p in os.scandir(path)}


def test_the_old_scheme_loses_the_weights_when_rank_1_renames_first(tmp_path):
    """The negative control, and the cause confirmed: inside a gloo group transformers writes a model's config and
    weights on rank 0 only, so rank 1's copy is empty and, renamed first, it became the shared folder."""
    results = two_processes("old", tmp_path)
    assert "config.json" not in model_files(results[0]["path"])
    assert "model.safetensors" not in model_files(results[0]["path"])
    assert not cache.is_complete(results[0]["path"])


def test_two_ranks_build_one_complete_copy(tmp_path):
    results = two_processes("group", tmp_path)
    assert results[0] == results[1], results
    path = results[0]["path"]
    assert {"config.json", "model.safetensors", cache.MANIFEST} <= model_files(path)
    assert cache.is_complete(path)
    assert len([f for f in model_files(path) if f.startswith("built-by-")]) == 1  # built once, by rank 0
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".model.tmp")]


def test_gguf_conversion_under_two_ranks_gives_one_complete_model(tmp_path):
    """The product's cache: a tiny GGUF file converted by ``resolve_model_path`` on both ranks at once."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    results = two_processes("gguf", tmp_path)
    assert results[0] == results[1], results
    path = results[0]["path"]
    assert cache.is_complete(path) and {"config.json", "model.safetensors", "tokenizer.json"} <= model_files(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(path).config.num_hidden_layers == 2
    assert AutoTokenizer.from_pretrained(path).chat_template


def test_independent_processes_take_turns_through_the_lock(tmp_path):
    """No process group (two runs, say): the lock holder builds, the other waits and then uses its folder."""
    for rank in (0, 1):
        (tmp_path / f"result-{rank}.json").unlink(missing_ok=True)
    procs = [subprocess.Popen([sys.executable, WORKER, "lock", str(rank), "1", str(tmp_path)], env=ENV, cwd=ROOT)
             for rank in (0, 1)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert results[0] == results[1] and "path" in results[0], results
    assert len([f for f in model_files(results[0]["path"]) if f.startswith("built-by-")]) == 1


def test_a_failed_build_stops_the_waiting_rank_at_once_with_one_line(tmp_path):
    start = time.monotonic()
    results = two_processes("fail", tmp_path)
    assert "ZeroDivisionError" in results[0]["crash"]
    assert results[1]["error"].startswith("cache: rank 0 could not build the tiny model in ")
    assert "ZeroDivisionError" in results[1]["error"] and "\n" not in results[1]["error"]
    assert time.monotonic() - start < 50  # not the 60 s timeout
    assert not cache.is_complete(tmp_path / "cache" / "model")


def test_a_waiting_rank_gives_up_after_its_timeout_with_one_line(tmp_path):
    results = two_processes("slow", tmp_path)
    assert "path" in results[0]  # rank 0 finished its build after rank 1 gave up
    assert results[1]["error"].startswith("cache: rank 0 did not finish the tiny model in ")
    assert "\n" not in results[1]["error"]


def build_counter(calls):
    def build(out):
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w" * 100)
    return build


@pytest.mark.parametrize("damage", ["tokenizer only, no manifest", "weights removed", "weights truncated",
                                    "manifest unreadable"])
def test_an_incomplete_folder_is_rebuilt_not_used(tmp_path, damage):
    target, calls = tmp_path / "model", []
    cache.folder(target, build_counter(calls), "model")
    if damage == "tokenizer only, no manifest":  # the state the poisoned test cache was found in
        for p in target.iterdir():
            p.unlink()
        (target / "tokenizer.json").write_text("{}")
    elif damage == "weights removed":
        (target / "model.safetensors").unlink()
    elif damage == "weights truncated":
        (target / "model.safetensors").write_bytes(b"w" * 10)
    else:
        (target / cache.MANIFEST).write_text("{not json")
    assert not cache.is_complete(target)
    cache.folder(target, build_counter(calls), "model")
    assert len(calls) == 2 and cache.is_complete(target)
    assert (target / "model.safetensors").stat().st_size == 100
    assert not (target / "tokenizer.json").exists()


def test_a_complete_folder_is_used_as_it_is(tmp_path):
    """The control: nothing is rebuilt when nothing is wrong (a later run loads the folder as it is)."""
    target, calls = tmp_path / "model", []
    cache.folder(target, build_counter(calls), "model")
    mtime = (target / cache.MANIFEST).stat().st_mtime_ns
    assert cache.folder(target, build_counter(calls), "model") == target
    assert len(calls) == 1 and (target / cache.MANIFEST).stat().st_mtime_ns == mtime


def test_a_build_that_fails_leaves_no_folder(tmp_path):
    def broken(out):
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError):
        cache.folder(tmp_path / "model", broken, "model")
    assert not (tmp_path / "model").exists() and list(tmp_path.iterdir()) == [tmp_path / ".model.lock"]


def test_the_test_assets_replace_a_poisoned_copy(tmp_path, monkeypatch):
    """The folder found on the machine where the suite failed (a tokenizer, no config, no weights) is rebuilt."""
    from tests import helpers

    poisoned = tmp_path / "tiny-chat-v1"
    (poisoned / "model").mkdir(parents=True)
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
        (poisoned / "model" / name).write_text("{}")
    (poisoned / "chat.jsonl").write_text("{}\n")
    monkeypatch.setattr(helpers, "TINY_CHAT", poisoned)
    assets = helpers.tiny_chat_assets()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= model_files(assets["model"])
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(assets["model"]).config.num_hidden_layers == 2


def test_the_suite_keeps_its_assets_and_caches_in_its_own_folder():
    from tests import helpers

    run = os.environ["FINETUNE_TEST_ASSETS"]
    assert str(helpers.TINY_CHAT).startswith(run) and str(cache.root()).startswith(run)
    assert ENV["FINETUNE_TEST_ASSETS"] == run and ENV["FINETUNE_CACHE"].startswith(run)  # the workers' too


def test_a_test_run_leaves_nothing_in_the_temp_folder(tmp_path):
    """A pytest run makes its folder in the system temp folder and removes it at the end, also when no test ran."""
    for selection in ("test_the_link_check_catches_a_planted_break", "no_test_has_this_name"):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_docs.py",
                               "-k", selection], cwd=ROOT, env={**ENV, "TMPDIR": str(tmp_path)},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: no test selected
        assert not list(tmp_path.glob("finetune-tests-*")), selection


# ---------------------------------------------------------------------------------------------------------------
# a cache folder that cannot be built in: one line, exit 2, before anything is written


def sft_args(chat, out) -> list:
    """``finetune run`` of the sft recipe on the tiny chat model and rows in ``chat`` (their folder), one step."""
    from tests.helpers import SMALL

    sets = [s for s in SMALL["sft-smollm2"] if not s.startswith(("model.name_or_path=", "data.source="))]
    sets += [f"model.name_or_path={chat / 'model'}", f"data.source={chat / 'chat.jsonl'}"]
    return ["--recipe", "sft-smollm2", *[a for s in sets for a in ("--set", s)], "--max-steps", "1",
            "--output-dir", str(out)]


@pytest.mark.parametrize("under", ["", "sub"])
def test_a_cache_that_is_a_file_is_one_line_exit_2(tmp_path, capsys, monkeypatch, under):
    """FINETUNE_CACHE naming a file (a typo, a stale mount), or a folder below one: the data set's cache cannot be
    made there. It once ended in a NotADirectoryError traceback, exit 1."""
    from tests.helpers import TINY_CHAT, refused_in_process, tiny_chat_assets

    tiny_chat_assets()
    stale = tmp_path / "stale-mount"
    stale.write_text("")
    monkeypatch.setenv("FINETUNE_CACHE", str(stale / under if under else stale))
    out = tmp_path / "out"
    refused_in_process(capsys, sft_args(TINY_CHAT, out), f"FINETUNE_CACHE: {stale} is a file, not a folder; point "
                                                         "it at a folder you can write in")
    assert not out.exists() and stale.read_text() == ""


def test_a_cache_folder_without_write_permission_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """A cache folder this user may not write in stops the run with one line before it writes anything."""
    import stat

    from tests.helpers import TINY_CHAT, refused_in_process, tiny_chat_assets

    tiny_chat_assets()
    locked = tmp_path / "cache"
    (locked / "datasets").mkdir(parents=True)
    for p in (locked, locked / "datasets"):
        p.chmod(0o555)
    if os.geteuid() == 0:  # root may write anywhere (and nobody may run this interpreter here): the answer the
        # kernel gives the folder's owner, from its mode bits
        owner_may = lambda path, mode: not mode & os.W_OK or bool(os.stat(path).st_mode & stat.S_IWUSR)  # noqa: E731
        monkeypatch.setattr(cache.os, "access", owner_may)
    monkeypatch.setenv("FINETUNE_CACHE", str(locked))
    out = tmp_path / "out"
    try:
        refused_in_process(capsys, sft_args(TINY_CHAT, out), f"FINETUNE_CACHE: no permission to write in "
                                                             f"{locked / 'datasets'}; point it at a folder you can "
                                                             "write in")
    finally:
        for p in (locked, locked / "datasets"):
            p.chmod(0o755)
    assert not out.exists() and not list((locked / "datasets").iterdir())


def test_a_complete_folder_in_a_cache_that_cannot_be_written_is_only_read(tmp_path, monkeypatch):
    """The control: the check guards building only — a read-only cache that already holds the folder serves it."""
    calls = []
    target = cache.folder(tmp_path / "cache" / "ready", build_counter(calls), "test folder")
    refuse = lambda parent: pytest.fail(f"checked {parent} to read a complete folder")  # noqa: E731
    monkeypatch.setattr(cache, "_make_room", refuse)
    assert cache.folder(target, build_counter(calls), "test folder") == target and len(calls) == 1
    with pytest.raises(pytest.fail.Exception):  # and the planted check is live where the folder is missing
        cache.folder(tmp_path / "cache" / "missing", build_counter(calls), "test folder")
