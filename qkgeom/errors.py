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
