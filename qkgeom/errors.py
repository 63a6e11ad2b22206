"""The project's own error class. Bad input or a refused operation raises a subclass of
QKGeomError: the CLI prints its message on one line and exits 2. Anything else is a bug in
qkgeom: the CLI prints the traceback and exits 1 (cli.main). QKGEOM_DEBUG=1 shows the traceback
for user errors too."""


class QKGeomError(Exception):
    """Bad input or a refused operation (one line, exit 2); the message names the problem."""
