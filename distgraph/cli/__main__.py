"""``python -m distgraph.cli ...`` is the ``distgraph`` command."""

from distgraph.cli import main

raise SystemExit(main())
