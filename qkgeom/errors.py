"""The project's own error class. Bad input or a refused operation raises a subclass of
QKGeomError: the CLI prints its message on one line and exits 2. Anything else is a bug in
qkgeom: the CLI prints the traceback and exits 1 (cli.main). QKGEOM_DEBUG=1 shows the traceback
for user errors too."""


class QKGeomError(Exception):
    """Bad input or a refused operation (one line, exit 2); the message names the problem."""


class ConfigError(QKGeomError, ValueError):
    """A configuration that cannot be used; the message names the offending key/value."""


def read_text(path, error: type[QKGeomError] = QKGeomError) -> str:
    """The UTF-8 text of a file the user gave (a config, a sweep, a text sample, a vocabulary); a file
    in another encoding is bad input (`error`, one line naming the file and the byte), not a bug."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None


def out_of_memory(e: BaseException) -> str | None:
    """One line for an allocation the machine refused (host memory, or a GPU's: torch.OutOfMemoryError),
    else None: a run too large for the machine wants a smaller setting, not a bug report."""
    import re

    text = str(e)
    if not (isinstance(e, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower()):
        return None
    size = re.search(r"[Tt]ried to allocate (\d+ bytes|[\d.]+ [KMGT]iB)", text)
    if size and size.group(1).endswith(" bytes"):
        asked = f"{int(size.group(1).split()[0]) / 2**30:.2f} GiB"
    else:
        asked = size.group(1) if size else "memory"
    where = "GPU" if "CUDA" in text or "GPU" in text else "host"
    return (f"out of {where} memory (allocating {asked} failed): lower train.batch_size, the sequence length or "
            "the model's width, or use a larger machine")  # fmt: skip
