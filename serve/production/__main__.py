"""`python -m serve.production` (serve/production/cli.py)."""

import os

from serve.production.cli import main

os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
raise SystemExit(main())
