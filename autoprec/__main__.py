"""`python -m autoprec`: the same as the `autoprec` command."""

from .cli import main

raise SystemExit(main())
