"""data: vocabulary, encoding cache, sources, and the downloader against a loopback HTTP server."""

import hashlib
import io
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from qkgeom import config as C
from qkgeom.training import data as D


def write_folder(root, train="hello world\n", valid="held lord ~\n", test="test\n"):
    root.mkdir(parents=True, exist_ok=True)
    for name, text in (("train", train), ("valid", valid), ("test", test)):
        (root / f"{name}.txt").write_text(text)
    return root


def test_char_vocab_unk_and_roundtrip(tmp_path):
    folder = write_folder(tmp_path / "c")
    corpus = D.load_corpus(C.DataConfig(source=str(folder)))
    v = corpus.vocab
    assert v.size == len(set("hello world\n")) + 1
    ids = v.encode("held lord ~")
    assert ids[-1] == D.UNK_ID and (ids[:-1] != D.UNK_ID).all()  # '~' never in train
    assert v.decode(v.encode("hello")) == "hello"
    assert np.array_equal(np.asarray(corpus.splits["valid"]), v.encode("held lord ~\n"))
    assert D.Vocab.from_json(v.to_json()) == v


def test_byte_vocab(tmp_path):
    folder = write_folder(tmp_path / "b", valid="é\n")
    corpus = D.load_corpus(C.DataConfig(source=str(folder), tokenizer="byte"))
    assert corpus.vocab.size == 256
    assert list(corpus.splits["valid"]) == list("é\n".encode())


def test_encoding_is_chunked_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "CHUNK_CHARS", 7)
    text = "abcdefghij" * 50 + "\n"
    folder = write_folder(tmp_path / "k", train=text, valid=text)
    a = D.load_corpus(C.DataConfig(source=str(folder)))
    assert isinstance(a.splits["train"], np.memmap)
    assert a.vocab.decode(np.asarray(a.splits["train"])) == text
    files = sorted((D.cache_dir() / "encoded").glob("train-*"))
    mtime = files[-1].stat().st_mtime_ns
    D.load_corpus(C.DataConfig(source=str(folder)))
    assert files[-1].stat().st_mtime_ns == mtime  # reused, not rewritten


def test_real_wikitext_char_level(wikitext):
    corpus = D.load_corpus(C.DataConfig(source=str(wikitext / "wikitext-2")))
    assert corpus.vocab.size == 283 + 1  # README: 283 distinct characters in train
    assert len(corpus.splits["train"]) == 10_780_437
    assert len(corpus.splits["valid"]) == 1_120_192
    assert (np.asarray(corpus.splits["valid"]) == D.UNK_ID).sum() == 0  # every valid char occurs in train


def test_named_source_uses_mirror(wikitext, monkeypatch):
    monkeypatch.setenv("QKGEOM_WIKITEXT_DIR", str(wikitext))
    assert D.resolve_source("wikitext-2") == wikitext / "wikitext-2"


def test_a_mirror_setting_that_names_no_folder_is_refused(tmp_path, monkeypatch):
    """QKGEOM_WIKITEXT_DIR set to a folder that does not exist (a typo) fell through to the download, so a
    user online trained on a fresh download instead of their mirror, unsaid. Unset, the download is the
    intended fallback (a clone without ../shared); a mirror folder without the corpus falls back too."""
    monkeypatch.setenv("QKGEOM_WIKITEXT_DIR", str(tmp_path / "typo"))
    monkeypatch.setenv("QKGEOM_CACHE", str(tmp_path / "cache"))
    with pytest.raises(D.DataError, match=f"QKGEOM_WIKITEXT_DIR={tmp_path / 'typo'} is not a folder: point it"):
        D.resolve_source("wikitext-2")
    assert not (tmp_path / "cache").exists()  # refused before any download
    write_folder(tmp_path / "cache" / "wikitext-2")  # a cached download: what the fallback reads
    (tmp_path / "mirror").mkdir()
    monkeypatch.setenv("QKGEOM_WIKITEXT_DIR", str(tmp_path / "mirror"))
    assert D.resolve_source("wikitext-2") == tmp_path / "cache" / "wikitext-2"
    monkeypatch.delenv("QKGEOM_WIKITEXT_DIR")
    monkeypatch.setattr(D, "REPO_ROOT", tmp_path / "no-checkout")  # the default mirror is absent too
    assert D.resolve_source("wikitext-2") == tmp_path / "cache" / "wikitext-2"


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(D.DataError, match="neither a folder"):
        D.resolve_source(str(tmp_path / "nope"))
    (tmp_path / "e").mkdir()
    with pytest.raises(D.DataError, match="has no train.txt"):
        D.resolve_source(str(tmp_path / "e"))
    folder = write_folder(tmp_path / "z", valid="")
    with pytest.raises(D.DataError, match="is empty"):
        D.resolve_source(str(folder))


def test_batches_are_a_function_of_seed_and_step():
    a = D.batch_offsets(10_000, 32, 4, seed=1, step=5)
    assert np.array_equal(a, D.batch_offsets(10_000, 32, 4, seed=1, step=5))
    assert not np.array_equal(a, D.batch_offsets(10_000, 32, 4, seed=1, step=6))
    data = np.arange(100)
    x, y = D.gather(data, np.array([3, 10]), 5)
    assert x.tolist() == [[3, 4, 5, 6, 7], [10, 11, 12, 13, 14]] and np.array_equal(y, x + 1)


# --- downloader -------------------------------------------------------------------------------


class Server:
    """Loopback HTTP server for one payload; supports Range; can drop the first response midway."""

    def __init__(self, payload: bytes, drop_after: int | None = None):
        self.payload, self.drop_after, self.requests = payload, drop_after, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                rng = self.headers.get("Range")
                outer.requests.append(rng)
                start = int(rng.split("=")[1].split("-")[0]) if rng else 0
                body = outer.payload[start:]
                self.send_response(206 if rng else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if outer.drop_after is not None and len(outer.requests) == 1:
                    self.wfile.write(body[: outer.drop_after])
                    self.wfile.flush()
                    self.connection.shutdown(2)  # connection dropped mid-file
                    return
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/corpus.zip"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def make_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for split in D.SPLITS:
            z.writestr(f"wikitext-2-raw/wiki.{split}.raw", f" = {split} = \n" + "x" * 50_000)
    return buf.getvalue()


def test_download_verifies_and_is_atomic(tmp_path):
    payload = make_zip()
    srv = Server(payload)
    try:
        dest = D.download(srv.url, tmp_path / "a.zip", "sha256:" + hashlib.sha256(payload).hexdigest(), backoff=0)
        assert dest.read_bytes() == payload
        folder = D.fetch_wikitext("wikitext-2", url=srv.url, checksum="md5:" + hashlib.md5(payload).hexdigest())
        assert (folder / "valid.txt").read_text().startswith(" = valid = ")
    finally:
        srv.close()


def test_download_corrupted_file_is_rejected(tmp_path):
    payload = make_zip()
    srv = Server(payload[:-10] + b"corrupted!")
    try:
        with pytest.raises(D.DataError, match="checksum mismatch"):
            D.download(srv.url, tmp_path / "a.zip", "sha256:" + hashlib.sha256(payload).hexdigest(), backoff=0)
        assert list(tmp_path.iterdir()) == []  # neither the file nor a .part is left
    finally:
        srv.close()


def test_download_resumes_after_dropped_connection(tmp_path):
    payload = make_zip()
    srv = Server(payload, drop_after=20_000)
    try:
        dest = D.download(srv.url, tmp_path / "a.zip", "sha256:" + hashlib.sha256(payload).hexdigest(), backoff=0)
        assert dest.read_bytes() == payload
        assert srv.requests == [None, "bytes=20000-"]  # the second request resumed, not restarted
    finally:
        srv.close()


def test_download_offline_error_says_what_to_do(tmp_path):
    srv = Server(b"")
    url = srv.url
    srv.close()  # nothing listens on that port any more
    with pytest.raises(D.DataError, match="set data.source to that folder"):
        D.download(url, tmp_path / "a.zip", "sha256:00", retries=1, backoff=0, timeout=2)
