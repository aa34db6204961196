"""`python -m serve.engines.vllm ... -- VLLM-ARGV`: the shim (serve/engines/vllm/server.py)."""

import sys

from serve.engines.vllm.server import main

sys.exit(main())
