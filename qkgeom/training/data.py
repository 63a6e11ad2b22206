"""Text corpora: sources, download, vocabulary, memory-mapped encoded splits, batches.

A source is a folder holding train.txt, valid.txt and test.txt, or the name of a
WikiText corpus (``wikitext-2``, ``wikitext-103``), found in the local mirror named by
``QKGEOM_WIKITEXT_DIR`` or downloaded once into the cache (``QKGEOM_CACHE``, default
``~/.cache/qkgeom``). Encoded splits are cached as flat binary files and opened with
``np.memmap``, so a corpus is never held twice in memory.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qkgeom.config import REPO_ROOT, DataConfig
from qkgeom.errors import QKGeomError
from qkgeom.results import atomic_write_bytes

SPLITS = ("train", "valid", "test")
CHUNK_CHARS = 1 << 24  # encode 16M characters at a time: bounded memory on any corpus
UNK_ID = 0  # reserved id for characters never seen in the training split

# Official archives of the raw (untokenised) corpora; their published checksums are MD5.
WIKITEXT = {
    "wikitext-2": ("https://wikitext.smerity.com/wikitext-2-raw-v1.zip", "md5:f407a2d53283fc4a49bcff21bc5f3770"),
    "wikitext-103": ("https://wikitext.smerity.com/wikitext-103-raw-v1.zip", "md5:0ca3512bd7a238be4a63ce7b434f8935"),
}


class DataError(QKGeomError, RuntimeError):
    """A corpus that cannot be found, downloaded or read; the message says what to do."""


def wikitext_mirror() -> Path:
    """Local WikiText mirror: $QKGEOM_WIKITEXT_DIR, default ../shared/data/wikitext beside the checkout.

    It holds one folder per corpus name (wikitext-2/{train,valid,test}.txt). Tests, benchmarks
    and CI read the real text through this one setting.
    """
    default = REPO_ROOT.parent / "shared" / "data" / "wikitext"
    return Path(os.environ.get("QKGEOM_WIKITEXT_DIR", default))


def cache_dir() -> Path:
    """Where downloaded corpora are cached: $QKGEOM_CACHE, default ~/.cache/qkgeom."""
    return Path(os.environ.get("QKGEOM_CACHE", Path.home() / ".cache" / "qkgeom"))


def file_digest(path: Path, algo: str = "sha256") -> str:
    """The hex digest of a file's bytes, read in chunks."""
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fetch_into(url: str, part: Path, have: int, timeout: float) -> None:
    """One attempt: the rest of `url` from byte `have` appended to `part` (all of it where the server
    ignores the range); a body shorter than its Content-Length raises IncompleteRead."""
    req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        if have and r.status != 206:  # server ignored the range: start over
            have = 0
        length = r.headers.get("Content-Length")
        total = have + int(length) if length is not None else None
        with open(part, "ab" if have else "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
    got = part.stat().st_size
    if total is not None and got < total:
        raise http.client.IncompleteRead(b"", total - got)


def download(
    url: str, dest: Path, checksum: str, retries: int = 5, timeout: float = 30.0, backoff: float = 1.0
) -> Path:
    """Download `url` to `dest`, resuming a partial ``.part`` file with HTTP Range requests.

    `checksum` is ``"sha256:<hex>"`` (or ``"md5:<hex>"`` where only that is published); a
    mismatch deletes the partial file and raises. `dest` appears only once verified.
    """
    algo, _, expected = checksum.partition(":")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    last: Exception | None = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        have = part.stat().st_size if part.exists() else 0
        try:
            _fetch_into(url, part, have, timeout)
            last = None
            break
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:  # already complete
                last = None
                break
            if 400 <= e.code < 500:
                raise DataError(f"download of {url} failed: HTTP {e.code} {e.reason}") from None
            last = e
        except (TimeoutError, urllib.error.URLError, http.client.HTTPException, ConnectionError, OSError) as e:
            last = e
            if isinstance(getattr(e, "reason", None), socket.gaierror):
                break  # the host name does not resolve: offline, and retrying will not help
    if last is not None:
        raise DataError(
            f"could not download {url} ({last}); if offline, put train.txt, "
            "valid.txt and test.txt in a folder and set data.source to that folder"
        )
    actual = file_digest(part, algo)
    if actual != expected:
        part.unlink()
        raise DataError(f"checksum mismatch for {url}: expected {algo} {expected}, got {actual}; partial file removed")
    os.replace(part, dest)
    return dest


def fetch_wikitext(name: str, url: str | None = None, checksum: str | None = None) -> Path:
    """Folder with train/valid/test.txt of a raw WikiText corpus, downloading it on first use."""
    if name not in WIKITEXT:
        raise DataError(f"unknown corpus {name!r}; known: {', '.join(WIKITEXT)} or a folder path")
    url0, sum0 = WIKITEXT[name]
    url, checksum = url or url0, checksum or sum0
    root = cache_dir() / name
    if all((root / f"{s}.txt").is_file() for s in SPLITS):
        return root
    archive = download(url, cache_dir() / "downloads" / Path(url).name, checksum)
    with zipfile.ZipFile(archive) as z:
        for split in SPLITS:
            member = next((m for m in z.namelist() if m.endswith(f"wiki.{split}.raw")), None)
            if member is None:
                raise DataError(f"archive {archive} has no wiki.{split}.raw")
            atomic_write_bytes(root / f"{split}.txt", z.read(member))
    return root


def resolve_source(source: str) -> Path:
    """The folder holding the three splits for `source` (a folder path or a corpus name)."""
    p = Path(source).expanduser()
    if source not in WIKITEXT or p.exists():
        if not p.is_dir():
            raise DataError(f"data source {source!r} is neither a folder nor one of {', '.join(WIKITEXT)}")
    else:
        root = wikitext_mirror()
        if "QKGEOM_WIKITEXT_DIR" in os.environ and not root.is_dir():  # a typo would download instead, unsaid
            raise DataError(f"QKGEOM_WIKITEXT_DIR={os.environ['QKGEOM_WIKITEXT_DIR']} is not a folder: point it at "
                            f"a WikiText mirror, or unset it to download {source} into {cache_dir()}")  # fmt: skip
        p = root / source if (root / source).is_dir() else fetch_wikitext(source)
    for split in SPLITS:
        f = p / f"{split}.txt"
        if not f.is_file():
            raise DataError(f"data folder {p} has no {split}.txt (it needs train.txt, valid.txt, test.txt)")
        if f.stat().st_size == 0:
            raise DataError(f"data file {f} is empty")
    return p


def _read_chunks(path: Path):
    with open(path, encoding="utf-8", newline="") as f:
        try:
            while chunk := f.read(CHUNK_CHARS):
                yield chunk
        except UnicodeDecodeError as e:  # name the file: the bare error says only "byte 0xff in position 12"
            raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start} of a chunk)") from None


def _codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


@dataclass(frozen=True)
class Vocab:
    """Token ids. char: id 0 is `unk`, ids 1.. are the training split's characters in code-point
    order. byte: ids are the UTF-8 bytes 0..255 (nothing is unknown)."""

    kind: str
    chars: str = ""

    @property
    def size(self) -> int:
        return 256 if self.kind == "byte" else len(self.chars) + 1

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.kind == "byte" else np.uint16 if self.size < 65536 else np.uint32)

    def encode(self, text: str) -> np.ndarray:
        if self.kind == "byte":
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()
        table = _codepoints(self.chars)
        cp = _codepoints(text)
        idx = np.searchsorted(table, cp)
        known = (idx < len(table)) & (table[np.minimum(idx, len(table) - 1)] == cp)
        return np.where(known, idx + 1, UNK_ID).astype(self.dtype)

    def decode(self, ids: np.ndarray) -> str:
        if self.kind == "byte":
            return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")
        return "".join("\ufffd" if i == UNK_ID else self.chars[i - 1] for i in np.asarray(ids).tolist())

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "chars": self.chars}, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Vocab:
        d = json.loads(text)
        return cls(kind=d["kind"], chars=d["chars"])

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def build_vocab(train_path: Path, kind: str) -> Vocab:
    """Vocabulary of the training split, read in chunks."""
    if kind == "byte":
        return Vocab("byte")
    seen: set[int] = set()
    for chunk in _read_chunks(train_path):
        seen.update(np.unique(_codepoints(chunk)).tolist())
    return Vocab("char", "".join(chr(c) for c in sorted(seen)))


def encode_file(path: Path, vocab: Vocab) -> np.memmap:
    """Encoded ids of a text file, cached on disk and returned as a read-only memmap."""
    st = path.resolve().stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{vocab.digest}".encode()).hexdigest()[:24]
    out = cache_dir() / "encoded" / f"{path.stem}-{key}.{vocab.dtype.name}.bin"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in _read_chunks(path):
                    f.write(vocab.encode(chunk).tobytes())
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    if out.stat().st_size == 0:
        raise DataError(f"{path} encodes to no tokens")
    return np.memmap(out, dtype=vocab.dtype, mode="r")


@dataclass
class Corpus:
    """Encoded train/valid/test splits (memmaps) and their vocabulary."""

    vocab: Vocab
    splits: dict[str, np.ndarray]
    folder: Path


def unigram_baseline(corpus: Corpus) -> float:
    """Cross-entropy (nats/token) of the validation split under the training split's token frequencies
    (add-one smoothed): what a model that ignores all context would score."""
    counts = np.bincount(np.asarray(corpus.splits["train"]), minlength=corpus.vocab.size) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(corpus.splits["valid"])].mean())


def load_corpus(cfg: DataConfig, vocab: Vocab | None = None) -> Corpus:
    """Resolve, (download,) build the vocabulary (unless given, e.g. on resume) and encode."""
    folder = resolve_source(cfg.source)
    vocab = vocab or build_vocab(folder / "train.txt", cfg.tokenizer)
    return Corpus(vocab, {s: encode_file(folder / f"{s}.txt", vocab) for s in SPLITS}, folder)


def batch_offsets(n_tokens: int, n_ctx: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Random start offsets for one training step, a pure function of (seed, step): resuming
    at any step reproduces the data order without saved RNG state."""
    high = n_tokens - n_ctx - 1
    if high <= 0:
        raise DataError(f"split has {n_tokens} tokens, fewer than n_ctx + 1 = {n_ctx + 1}")
    return np.random.default_rng([seed, step]).integers(0, high, size=batch_size)


def fixed_offsets(n_tokens: int, n_ctx: int, n_seqs: int) -> np.ndarray:
    """Evenly spaced start offsets (validation / probe batches): fixed for a corpus."""
    high = n_tokens - n_ctx - 1
    if high <= 0:
        raise DataError(f"split has {n_tokens} tokens, fewer than n_ctx + 1 = {n_ctx + 1}")
    return np.linspace(0, high, n_seqs).astype(np.int64)


def gather(data: np.ndarray, offsets: np.ndarray, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token targets, both (len(offsets), n_ctx) int64."""
    idx = offsets[:, None] + np.arange(n_ctx + 1)[None, :]
    block = np.asarray(data[idx], dtype=np.int64)
    return block[:, :-1], block[:, 1:]
