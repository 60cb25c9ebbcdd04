"""``python -m memento``: the command line (see `memento.cli`)."""

from .cli import main

raise SystemExit(main())
