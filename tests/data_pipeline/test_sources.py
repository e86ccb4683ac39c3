"""Parquet and ArrayRecord sources read documents lazily and exactly (against the texts that were written),
name the file when it cannot be read or lacks the column; prefetching leaves the batch stream and its
checkpointed iterator state unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dsv41_jax.config import ConfigError
from dsv41_jax.data.corpus import ArrayRecordDocuments, CorpusCapped, ParquetDocuments, open_documents
from dsv41_jax.data.pipeline import packed_dataset

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")
arm = pytest.importorskip("array_record.python.array_record_module")


@pytest.fixture(scope="module")
def texts(corpus) -> list[str]:
    """Documents with non-ASCII text and an empty one (kept: lazy sources take documents as they are)."""
    return [f"doc {i}: é ∑ {'x' * i}" for i in range(23)] + [""] + corpus[:6]


@pytest.fixture(scope="module")
def parquet_files(texts, tmp_path_factory) -> list:
    root = tmp_path_factory.mktemp("pq")
    paths = []
    for k, part in enumerate((texts[:17], texts[17:])):
        path = root / f"part-{k}.parquet"
        table = pa.table({"id": list(range(len(part))), "body": part})
        pq.write_table(table, path, row_group_size=5)  # several row groups per file
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def arrayrecord_files(texts, tmp_path_factory) -> list:
    root = tmp_path_factory.mktemp("ar")
    paths = []
    for k, part in enumerate((texts[:11], texts[11:])):
        path = root / f"part-{k}.array_record"
        writer = arm.ArrayRecordWriter(str(path), "group_size:1")
        for t in part:
            writer.write(t.encode("utf-8"))
        writer.close()
        paths.append(path)
    return paths


def test_parquet_random_access(parquet_files, texts):
    docs = open_documents("parquet", (str(parquet_files[0].parent / "*.parquet"),), 1000, parquet_column="body")
    assert isinstance(docs, ParquetDocuments) and len(docs) == len(texts)
    order = np.random.default_rng(0).permutation(len(texts))
    assert [docs[int(i)] for i in order] == [texts[i] for i in order]  # shuffled reads cross row groups
    assert docs[-1] == texts[-1] and docs[3:9] == texts[3:9]
    assert len(docs._groups) <= docs.cache  # only a few row groups are ever held
    with pytest.warns(CorpusCapped, match=f"data.max_documents = 7 caps the corpus: {len(texts) - 7} of {len(texts)}"):
        capped = open_documents("parquet", tuple(map(str, parquet_files)), 7, parquet_column="body")
    assert len(capped) == 7 and list(capped) == texts[:7]
    with pytest.raises(IndexError):
        capped[7]


def test_arrayrecord_random_access(arrayrecord_files, texts):
    docs = open_documents("arrayrecord", tuple(str(p) for p in arrayrecord_files), 1000)
    assert isinstance(docs, ArrayRecordDocuments) and len(docs) == len(texts)
    order = np.random.default_rng(1).permutation(len(texts))
    assert [docs[int(i)] for i in order] == [texts[i] for i in order]
    with pytest.warns(CorpusCapped, match=f"{len(texts) - 11 - 4} of {len(texts) - 11} documents"):
        assert len(open_documents("arrayrecord", (str(arrayrecord_files[1]),), 4)) == 4


def test_errors_name_the_file(parquet_files, arrayrecord_files, tmp_path):
    with pytest.raises(ConfigError, match="no column 'text'.*columns: id, body") as err:
        open_documents("parquet", (str(parquet_files[0]),))
    assert str(parquet_files[0]) in str(err.value)
    with pytest.raises(ConfigError, match="holds int64, not strings"):
        open_documents("parquet", (str(parquet_files[0]),), parquet_column="id")
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(ConfigError, match=f"{bad}: cannot read as parquet"):
        open_documents("parquet", (str(bad),))
    with pytest.raises(ConfigError, match=f"{bad}: cannot read as ArrayRecord"):
        open_documents("arrayrecord", (str(bad),))
    with pytest.raises(ConfigError, match="missing.*matches no file"):
        open_documents("arrayrecord", (str(tmp_path / "missing*.array_record"),))


def test_parquet_source_packs_like_the_same_list(parquet_files, texts, trained):
    path, token_map, cfg = trained
    make = lambda docs: iter(packed_dataset(docs, path, cfg, token_map, seq_len=40, batch_size=2, seed=3))
    lazy, eager = make(ParquetDocuments(parquet_files, "body")), make(list(texts))
    for _ in range(4):
        a, b = next(lazy), next(eager)
        assert all(np.array_equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("read_threads, prefetch", [(0, 0), (4, 3), (0, 2)])
def test_prefetch_keeps_stream_and_state(trained, corpus, read_threads, prefetch):
    """Against the default pipeline (16 read threads, no batch prefetch): the same batches, and a state
    taken with batches waiting in the buffer resumes at the first batch not yet handed out."""
    path, token_map, cfg = trained
    make = lambda **kw: iter(packed_dataset(corpus[:12], path, cfg, token_map, seq_len=48, batch_size=2, seed=0,
                                            **kw))
    ref = make()
    want = [next(ref) for _ in range(6)]
    it = make(read_threads=read_threads, prefetch=prefetch)
    got = [next(it) for _ in range(3)]
    state = json.loads(json.dumps(it.get_state()))
    got += [next(it) for _ in range(3)]
    resumed = make(read_threads=read_threads, prefetch=prefetch)
    resumed.set_state(state)
    again = [next(resumed) for _ in range(3)]
    for x, y in zip(want, got, strict=True):
        assert all(np.array_equal(x[k], y[k]) for k in x)
    for x, y in zip(want[3:], again, strict=True):
        assert all(np.array_equal(x[k], y[k]) for k in x)


def test_remote_uris_read_like_local_files(gcs_bucket, parquet_files, arrayrecord_files, texts):
    """``data.paths`` as ``gs://`` URIs (through ``etils.epath``, here served from a local directory): text,
    jsonl and parquet read the same documents as from local disk, patterns expand per directory level, and what
    a remote source cannot do is refused by name."""
    import pickle
    import shutil

    uri, local = gcs_bucket
    (local / "a").mkdir(parents=True)
    (local / "b").mkdir()
    for k, part in enumerate((texts[:9], texts[9:])):
        (local / "a" / f"{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    (local / "b" / "one.txt").write_text("a whole file\n")
    for path in parquet_files:
        shutil.copy(path, local / "b" / path.name)

    jsonl = open_documents("jsonl", (f"{uri}/a/*.jsonl",))
    assert jsonl == [t for t in texts if t] == open_documents("jsonl", tuple(str(p) for p in sorted(
        (local / "a").glob("*.jsonl"))))
    assert open_documents("text", (f"{uri}/b/one.txt",)) == ["a whole file\n"]
    remote = open_documents("parquet", (f"{uri}/b/part-[01].parquet",), parquet_column="body")
    assert list(remote) == texts and remote[-3] == texts[-3]
    assert list(pickle.loads(pickle.dumps(remote))) == texts  # grain's workers get a copy that reopens its files

    with pytest.raises(ConfigError, match=r"gs://bucket/a/\*\.txt.* matches no file"):
        open_documents("text", (f"{uri}/a/*.txt",))
    with pytest.raises(ConfigError, match=r"'\*\*' is not supported in remote paths"):
        open_documents("jsonl", (f"{uri}/**/*.jsonl",))
    shutil.copy(arrayrecord_files[0], local / "b" / "x.array_record")
    with pytest.raises(ConfigError, match=r"gs://bucket/b/x.array_record: ArrayRecord .* local paths"):
        open_documents("arrayrecord", (f"{uri}/b/*.array_record",))
