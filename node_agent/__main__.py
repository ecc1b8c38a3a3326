"""``python -m node_agent`` is ``gpufrac-agent``."""

from node_agent.cli import main

raise SystemExit(main())
