"""`python -m autoprec`: the same as the `autoprec` command."""

from autoprec.cli import main

raise SystemExit(main())
