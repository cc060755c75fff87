"""Byte corpora: the built-in stdlib corpus is deterministic and capped; text files; HF datasets if present."""

from __future__ import annotations

import hashlib
import importlib.util
import sysconfig
from pathlib import Path

import pytest

from peerd.data.config import DataConfig, build_dataset, load_corpus
from peerd.data.sources import builtin_corpus, builtin_files, hf_corpus, text_files_corpus
from peerd.errors import ConfigError
from peerd.loading import from_mapping


def test_builtin_corpus_is_stdlib_text_in_documented_order() -> None:
    files = builtin_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert files[0] == stdlib / "LICENSE.txt"
    rel = [f.relative_to(stdlib).as_posix() for f in files[1:]]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert not any(part in {"site-packages", "test", "tests"} for r in rel for part in r.split("/")[:-1])
    corpus = builtin_corpus(200_000)
    assert len(corpus) == 200_000
    head = files[0].read_bytes() + b"\n" + files[1].read_bytes()
    assert corpus.tokens[: len(head)].tobytes() == head[: len(corpus)]
    assert corpus.digest == hashlib.sha256(corpus.tokens.tobytes()).hexdigest()


def test_builtin_corpus_is_deterministic_and_read_only() -> None:
    builtin_corpus.cache_clear()
    a = builtin_corpus(100_000)
    builtin_corpus.cache_clear()
    b = builtin_corpus(100_000)
    assert a.digest == b.digest
    with pytest.raises(ValueError):
        a.tokens[0] = 1


def test_text_files_in_given_order_globs_sorted(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"bbbb")
    (tmp_path / "a.txt").write_bytes(b"aa")
    (tmp_path / "z.md").write_bytes(b"zz")
    c = text_files_corpus([str(tmp_path / "z.md"), str(tmp_path / "*.txt")])
    assert c.tokens.tobytes() == b"zz\naa\nbbbb"
    capped = text_files_corpus([str(tmp_path / "*.txt")], max_bytes=4)
    assert capped.tokens.tobytes() == b"aa\nb"


def test_text_files_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.paths\[0\]"):
        text_files_corpus([str(tmp_path / "missing.txt")])
    with pytest.raises(ConfigError, match=r"data.paths\[0\]"):
        text_files_corpus([str(tmp_path / "*.nothing")])


def test_data_config_from_mapping_and_digest_pin(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_bytes(b"hello world, " * 100)
    cfg = from_mapping(DataConfig, {"source": "text", "paths": [str(tmp_path / "t.txt")], "seq_len": 16})
    ds = build_dataset(cfg)
    assert len(ds) == (1300 - 17) // 16 + 1
    pinned = DataConfig(source="text", paths=cfg.paths, expect_digest="00")
    with pytest.raises(ConfigError, match="expect_digest"):
        load_corpus(pinned)
    with pytest.raises(ConfigError, match="paths"):
        from_mapping(DataConfig, {"source": "text"})
    with pytest.raises(ConfigError, match="hf_name"):
        from_mapping(DataConfig, {"source": "hf"})
    with pytest.raises(ConfigError, match="sorce"):
        from_mapping(DataConfig, {"sorce": "builtin"})


HAVE_DATASETS = importlib.util.find_spec("datasets") is not None


def test_hf_source_without_datasets_says_how_to_get_it() -> None:
    if HAVE_DATASETS:
        pytest.skip("the 'datasets' package is installed; this checks the message when it is not")
    with pytest.raises(ConfigError, match="pip install datasets"):
        hf_corpus("text", data_files=["x.txt"])


@pytest.mark.skipif(not HAVE_DATASETS, reason="optional source: the 'datasets' package is not installed")
def test_hf_source_reads_local_text_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    path = tmp_path / "rows.txt"
    path.write_text("first line\nsecond line\n", encoding="utf-8")
    c = hf_corpus("text", data_files=[str(path)])
    assert c.tokens.tobytes() == b"first line\nsecond line"


def test_a_directory_reads_every_file_below_it_sorted_by_relative_path(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "b" / "deep").mkdir(parents=True)
    (root / "a").mkdir()
    (root / "b" / "deep" / "x.txt").write_bytes(b"bx")
    (root / "b" / "a.txt").write_bytes(b"ba")
    (root / "a" / "z.txt").write_bytes(b"az")
    (root / "c.txt").write_bytes(b"c")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_bytes(b"hidden")
    (root / ".notes").write_bytes(b"hidden")
    c = text_files_corpus([str(root)])
    assert c.tokens.tobytes() == b"az\nba\nbx\nc"  # a/z.txt, b/a.txt, b/deep/x.txt, c.txt
    (root / "a-b.txt").write_bytes(b"ab")  # "a-b.txt" < "a/z.txt" as relative paths ('-' < '/')
    assert text_files_corpus([str(root)]).tokens.tobytes() == b"ab\naz\nba\nbx\nc"
    (root / "a-b.txt").unlink()
    again = text_files_corpus([str(root)])
    assert again.digest == c.digest  # the same bytes, the same windows and example ids
    # a file and a directory in the order given
    (tmp_path / "first.txt").write_bytes(b"1")
    assert text_files_corpus([str(tmp_path / "first.txt"), str(root)]).tokens.tobytes() == b"1\naz\nba\nbx\nc"


def test_missing_empty_and_unreadable_paths_name_the_entry(tmp_path: Path) -> None:
    (tmp_path / "ok.txt").write_bytes(b"text")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.txt").write_bytes(b"")
    cases = {
        str(tmp_path / "missing"): r"data.paths\[1\].*no such file or directory",
        str(tmp_path / "empty"): r"data.paths\[1\].*holds no files",
        str(tmp_path / ("x" * 5000)): r"data.paths\[1\].*cannot read",  # a name the OS refuses
    }
    for entry, pattern in cases.items():
        with pytest.raises(ConfigError, match=pattern):
            text_files_corpus([str(tmp_path / "ok.txt"), entry])
    with pytest.raises(ConfigError, match=r"data.paths: the files are empty"):
        text_files_corpus([str(tmp_path / "empty.txt")])


def test_submit_pins_absolute_paths_and_the_digest_of_the_submitters_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peerd.data.config import pin_local_source

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_bytes(b"hello world, " * 100)
    monkeypatch.chdir(tmp_path)
    pinned = pin_local_source(DataConfig(source="text", paths=["docs"], seq_len=16))
    assert pinned.paths == [str(tmp_path / "docs")]
    assert pinned.expect_digest == text_files_corpus([str(tmp_path / "docs")]).digest
    assert len(build_dataset(pinned)) == (1300 - 17) // 16 + 1
    # a peer whose copy differs fails naming the pin instead of training on other bytes
    (tmp_path / "docs" / "a.txt").write_bytes(b"other words, " * 100)
    with pytest.raises(ConfigError, match="expect_digest"):
        build_dataset(pinned)
    assert pin_local_source(DataConfig()) == DataConfig()  # the built-in corpus needs no pin
