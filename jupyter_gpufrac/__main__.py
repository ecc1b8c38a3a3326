"""``python -m jupyter_gpufrac`` is ``jupyter gpufrac``."""

from jupyter_gpufrac.cli import main

raise SystemExit(main())
